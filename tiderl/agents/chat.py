"""Chat messages as token ids, turn by turn, with the model's chat template. No JAX.

An agent's first request is rendered whole (its messages and tools, with the generation
prompt), as `apply_chat_template` renders it. Every later request must repeat the task's
history — including each assistant reply exactly as it was returned — and append new messages
(tool results, user turns); only those are rendered, and the ids are appended to the task's
resident context. The sampled action tokens are never decoded and re-encoded: the trajectory
holds what the engine produced.

With a checkpoint's Jinja template, the new messages are rendered by the template itself: the
conversation is rendered with the last assistant message's content replaced by a sentinel (and
its tool calls dropped, since the model wrote those as text inside its action), and the text
after the sentinel — the turn end the model sampled as its stop token, the new messages, the
generation prompt — is what gets appended. `check()` proves the result equals the tokenized
full rendering on a tool-using conversation. Built-in templates (byte, ChatML, Llama 3 without
a checkpoint template) render system/user/assistant messages from their turn pieces and have no
tool role.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tiderl.envs.chat_templates import ChatTemplate, compile_chat_template
from tiderl.envs.config import ImageConfig
from tiderl.envs.images import Image, ImageError, b64decode, from_bytes
from tiderl.envs.templates import Part, TurnTemplate

_SENTINEL = "@@tiderl-action@@"
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(Exception):
    """A request the endpoint refuses: an HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                      code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _content(content: Any, where: str, limits: ImageConfig
             ) -> tuple[str, list[tuple[int, Image]]]:
    """A message's text and its images, each with the character offset in the text where it
    sits (text parts joined; `image_url` parts with data URLs decoded and checked)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):  # content parts: text and images
        out: list[str] = []
        images: list[tuple[int, Image]] = []
        at = 0
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
                at += len(part["text"])
            elif kind == "image_url":
                images.append((at, _image(part.get("image_url"), f"{where}.content[{i}]",
                                          limits)))
            else:
                raise ChatError(400, f"{where}.content[{i}] is neither a text part ({{'type': "
                                     "'text', 'text': ...}) nor an image part ({'type': "
                                     "'image_url', 'image_url': {'url': 'data:image/png;base64,"
                                     "...'}})", param=f"{where}.content")
        return "".join(out), images
    raise ChatError(400, f"{where}.content must be a string, a list of text and image parts or "
                         f"null, got {type(content).__name__}", param=f"{where}.content")


def _image(raw: Any, where: str, limits: ImageConfig) -> Image:
    """An `image_url` part's image: a data URL of a PNG or JPEG within env.images."""
    url = raw.get("url") if isinstance(raw, Mapping) else raw
    if not isinstance(url, str):
        raise ChatError(400, f"{where}.image_url must be {{'url': 'data:image/png;base64,...'}}",
                        param=where, code="invalid_image")
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise ChatError(400, f"{where}.image_url.url is not a base64 data URL; send the image "
                             "inline as data:image/png;base64,... (the endpoint fetches no URL)",
                        param=where, code="invalid_image")
    try:
        return from_bytes(b64decode(data, limits, where=where), limits, where=where,
                          mime=head[len("data:"):-len(";base64")] or None)
    except ImageError as e:
        raise ChatError(400, e.message, param=where,
                        code="image_too_large" if e.status == 413 else "invalid_image") from None


def _check_roles(messages: Sequence[Mapping[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if m.get("images") and m["role"] != "user":
            raise ChatError(400, f"messages[{i}] is a {m['role']} message with image parts; "
                                 "images go in user messages (as in the OpenAI API): send the "
                                 "screenshot in a user message after it", param=f"messages[{i}]",
                            code="invalid_image")


def _check_totals(messages: Sequence[Mapping[str, Any]], limits: ImageConfig) -> None:
    images = [im for m in messages for im in m.get("images", ())]
    if len(images) > limits.max_images:
        raise ChatError(400, f"the request carries {len(images)} images, over the limit of "
                             f"{limits.max_images} (env.images.max_images); send fewer (keep the "
                             "most recent ones) or raise env.images.max_images",
                        param="messages", code="image_too_large")
    total = sum(len(im.data) for im in images)
    if total > limits.max_total_bytes:
        raise ChatError(400, f"the request carries {total} bytes of images, over the limit of "
                             f"{limits.max_total_bytes} (env.images.max_total_bytes); send fewer "
                             "or smaller images or raise env.images.max_total_bytes",
                        param="messages", code="image_too_large")


def _arguments(raw: Any, where: str) -> str:
    if isinstance(raw, Mapping):
        return json.dumps(raw, ensure_ascii=False)
    if isinstance(raw, str):
        return raw
    raise ChatError(400, f"{where}.function.arguments must be a JSON string", param=where)


def normalize_messages(raw: Any, images: ImageConfig | None = None) -> list[dict[str, Any]]:
    """The request's messages in one canonical form (role, content text, tool calls/ids; a
    message with image parts also has `images`, the checked Image objects, and `image_at`,
    each one's character offset in the content), images checked against `images`."""
    limits = images or ImageConfig()
    if not isinstance(raw, list) or not raw:
        raise ChatError(400, "'messages' must be a non-empty list of message objects",
                        param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatError(400, f"{where} must be an object with 'role' and 'content'",
                            param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(400, f"{where}.role={role!r} is not one of {', '.join(ROLES)}",
                            param=f"{where}.role")
        text, pictures = _content(m.get("content"), where, limits)
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text}
        if pictures:
            msg["image_at"] = tuple(at for at, _ in pictures)
            msg["images"] = tuple(im for _, im in pictures)
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ChatError(400, f"{where}.tool_calls must be a list", param=where)
            norm = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ChatError(400, f"{where}.tool_calls[{j}] needs function.name",
                                    param=f"{where}.tool_calls")
                norm.append({"id": str(c.get("id", "")), "type": "function",
                             "function": {"name": fn["name"], "arguments": _arguments(
                                 fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")}})
            msg["tool_calls"] = norm
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    _check_roles(out)
    _check_totals(out, limits)
    return out


def with_placeholders(messages: Sequence[Mapping[str, Any]], placeholder: str
                      ) -> list[dict[str, Any]]:
    """Messages as a vision-language policy's template renders them: each image's
    `placeholder` text put into the content where its part came (`image_at`; images before
    the text when the parts list them first, as the Qwen-VL templates render parts in order),
    the Image objects dropped."""
    out = []
    for m in messages:
        shown = {k: v for k, v in m.items() if k not in ("images", "image_at")}
        text, cut, pieces = m["content"], 0, []
        for at in m.get("image_at", ()):
            pieces += [text[cut:at], placeholder]
            cut = at
        shown["content"] = "".join([*pieces, text[cut:]])
        out.append(shown)
    return out


def normalize_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or not all(
            isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str) for t in raw):
        raise ChatError(400, "'tools' must be a list of {'type': 'function', 'function': "
                             "{'name': ..., 'parameters': {...}}}", param="tools")
    return [dict(t) for t in raw]


def _args_obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def difference(got: Mapping[str, Any], want: Mapping[str, Any]) -> str | None:
    """How message `got` differs from the resident `want`, or None (tool-call ids and JSON
    spacing of arguments are not compared: frameworks regenerate both)."""
    if got["role"] != want["role"]:
        return f"role {got['role']!r} where the history has {want['role']!r}"
    if got["content"] != want["content"]:
        a, b = got["content"], want["content"]
        return f"content {a[:60]!r}{'…' if len(a) > 60 else ''} where the history has " \
               f"{b[:60]!r}{'…' if len(b) > 60 else ''}"
    ga, wa = got.get("tool_calls") or [], want.get("tool_calls") or []
    if [(c["function"]["name"], _args_obj(c["function"]["arguments"])) for c in ga] != [
            (c["function"]["name"], _args_obj(c["function"]["arguments"])) for c in wa]:
        return f"tool_calls {[c['function']['name'] for c in ga]} where the history has " \
               f"{[c['function']['name'] for c in wa]} (or other arguments)"
    if [im.digest for im in got.get("images", ())] != [im.digest for im in
                                                       want.get("images", ())] or got.get(
            "image_at", ()) != want.get("image_at", ()):
        return f"{len(got.get('images', ()))} images where the history has " \
               f"{len(want.get('images', ()))} (or other images, or elsewhere in the text)"
    if got.get("tool_call_id", "") != want.get("tool_call_id", ""):
        return f"tool_call_id {got.get('tool_call_id')!r} where the history has " \
               f"{want.get('tool_call_id')!r}"
    return None


def _for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: tool-call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args_obj(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


class ChatRenderer:
    """Renders requests to token ids with `template` (see the module docstring)."""

    def __init__(self, template: TurnTemplate):
        self.template = template
        self.tok = template.tokenizer
        self.source = template.source if isinstance(template, ChatTemplate) else ""
        if self.source:
            self._compiled = compile_chat_template(self.source)
            self._vars = dict(getattr(self.tok, "special_tokens", {}))
            names = {int(v): k for k, v in (getattr(self.tok, "added_tokens", None) or {}).items()}
            self._stop_text = names.get(template.stop[0]) or self.tok.decode(
                [template.stop[0]], skip_special=False)

    @property
    def supports_tools(self) -> bool:
        return bool(self.source)

    # -- jinja ------------------------------------------------------------------------------
    def _render(self, messages: Sequence[Mapping[str, Any]], tools: list | None) -> str:
        import jinja2

        try:
            return self._compiled.render(messages=_for_template(messages), tools=tools,
                                         documents=None, add_generation_prompt=True,
                                         **self._vars)
        except jinja2.TemplateError as e:
            raise ChatError(400, f"the model's chat template rejects this conversation: {e}",
                            param="messages") from e

    # -- builtin ----------------------------------------------------------------------------
    def _pieces(self, m: Mapping[str, Any]) -> list[Part]:
        t = self.template
        role, text = m["role"], m["content"]
        if role == "user":
            return [*t.user_open, t._user_text(text), *t.user_close]
        if role == "assistant":
            if m.get("tool_calls"):
                raise ChatError(400, f"the {t.name!r} turn template has no tool calls; serve a "
                                     "checkpoint whose chat template has them", param="messages")
            return [*t.assistant_open, text, t.stop[0], *t.after_action]
        if role == "system":
            if not t.system_open:
                raise ChatError(400, f"the {t.name!r} turn template has no system role",
                                param="messages")
            return [*t.system_open, t._system_text(text), *t.system_close]
        raise ChatError(400, f"the {t.name!r} turn template has no {role!r} role; serve a "
                             "checkpoint whose chat template has one", param="messages")

    # -- the two requests -------------------------------------------------------------------
    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: list | None) -> list[int]:
        """Ids of a task's first request: every message and the generation prompt."""
        if self.source:
            return list(self.tok.encode(self._render(messages, tools)))
        if tools:
            raise ChatError(400, f"'tools' need the checkpoint's chat template; the "
                                 f"{self.template.name!r} turn template has none", param="tools")
        t = self.template
        parts: list[Part] = list(t.begin)
        rest = list(messages)
        if rest and rest[0]["role"] == "system" and t.system_open:
            parts += self._pieces(rest.pop(0))
        else:
            parts += t.default_system
        for m in rest:
            parts += self._pieces(m)
        return t.render(parts + list(t.assistant_open))

    def continuation(self, history: Sequence[Mapping[str, Any]],
                     new: Sequence[Mapping[str, Any]], tools: list | None, *,
                     stopped: bool) -> list[int]:
        """Ids that follow the last assistant action (`history[-1]`): its closing stop token
        when the action was cut off, the template's turn end, `new` and the generation
        prompt."""
        t = self.template
        if not self.source:
            parts: list[Part] = [] if stopped else [t.stop[0]]
            parts += list(t.after_action)
            for m in new:
                parts += self._pieces(m)
            return t.render(parts + list(t.assistant_open))
        msgs = [*history[:-1], {"role": "assistant", "content": _SENTINEL}, *new]
        text = self._render(msgs, tools)
        at = text.find(_SENTINEL)
        if at < 0 or text.count(_SENTINEL) != 1:
            raise ChatError(500, "the chat template does not write the last assistant message "
                                 "once; it cannot be continued turn by turn", kind="server_error")
        tail = text[at + len(_SENTINEL):]
        if not tail.startswith(self._stop_text):
            raise ChatError(500, f"the chat template does not end an assistant turn with "
                                 f"{self._stop_text!r}; it cannot be continued turn by turn",
                            kind="server_error")
        ids = [] if stopped else [t.stop[0]]
        return ids + list(self.tok.encode(tail[len(self._stop_text):]))

    def check(self) -> None:
        """Turn-by-turn ids equal the tokenized full rendering of a tool-using conversation
        (and of a plain one): a ValueError naming the difference otherwise. Built-in templates
        are checked by their own tests."""
        if not self.source:
            return
        tools = [{"type": "function", "function": {
            "name": "lookup", "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                           "required": ["word"]}}}]
        for use_tools in (False, True):
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "Define apple."}]
            ids = self.prompt(msgs, tools if use_tools else None)
            act = "I will look it up."
            ids += list(self.tok.encode(act)) + [self.template.stop[0]]
            msgs.append({"role": "assistant", "content": act})
            new: list[dict[str, Any]] = (
                [{"role": "tool", "tool_call_id": "c1", "content": "a fruit"}] if use_tools
                else [{"role": "user", "content": "And pear?"}])
            ids += self.continuation(msgs, new, tools if use_tools else None, stopped=True)
            msgs += new
            want = list(self.tok.encode(self._render(msgs, tools if use_tools else None)))
            if ids != want:
                at = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b),
                          min(len(ids), len(want)))
                raise ValueError(
                    f"chat template {'with tools ' if use_tools else ''}rendered turn by turn "
                    f"differs from the full rendering at token {at}; the agent endpoint needs a "
                    "template that renders turn by turn")
