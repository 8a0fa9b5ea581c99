"""One agent task's conversation: its token history and the OpenAI replies built from it. No JAX.

`Conversation.request(...)` checks a chat request against the history (the first request
renders the prompt; a later one must extend the history, see `tiderl.agents.chat`) and returns
the token ids to append; after the turn ran, `reply(...)` appends the sampled action (token
ids, behaviour logprobs and weight versions exactly as the engine returned them), reads tool
calls from its text, and builds the assistant message the agent gets (and must send back).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tiderl.agents.chat import (
    ChatError,
    ChatRenderer,
    difference,
    normalize_messages,
    normalize_tools,
    with_placeholders,
)
from tiderl.agents.toolcalls import Parser, parse
from tiderl.envs.config import ImageConfig


@dataclasses.dataclass
class Pending:
    """A checked request: what the turn appends and how its reply is shaped."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    new_ids: list[int]
    max_tokens: int | None
    stop: tuple[str, ...]
    parse_tools: bool
    logprobs: bool
    token_ids: bool
    images: list[Any] = dataclasses.field(default_factory=list)
    """The new messages' images patched for the vision tower (`models.vision_inputs.
    PatchedImage`), in the order of their placeholder runs in `new_ids`."""


@dataclasses.dataclass
class Reply:
    message: dict[str, Any]
    finish_reason: str
    action_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    malformed_tool_call: bool


class Conversation:
    """The token history of one agent task (token in, token out)."""

    def __init__(self, renderer: ChatRenderer, parser: Parser,
                 images: ImageConfig | None = None, vision: Any = None):
        self.renderer, self.parser = renderer, parser
        self.images = images or ImageConfig()
        self.vision = vision
        """A vision-language policy's `models.vision_inputs.ImagePrompt` (None: a text policy,
        which refuses images)."""
        self.patched: list[Any] = []
        """The images of `tokens`' placeholder runs, in order (what the engine took)."""
        self.tok = renderer.tok
        self.stop_ids = renderer.template.stop_ids
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stopped = True
        self.turns = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # -- a request -----------------------------------------------------------------------------
    def request(self, body: Mapping[str, Any], *, max_action_tokens: int) -> Pending:
        """Checks `body` (a chat.completions request) against the history; raises ChatError."""
        msgs = normalize_messages(body.get("messages"), self.images)
        tools = normalize_tools(body.get("tools"))
        seen = next((i for i, m in enumerate(msgs) if m.get("images")), None)
        if seen is not None and self.vision is None:
            raise ChatError(400, f"messages[{seen}] carries {len(msgs[seen]['images'])} images "
                                 "but the policy has no vision tower (a text-only model): it "
                                 "cannot read them; send text only, or train a vision-language "
                                 "model", param=f"messages[{seen}].content", code="no_vision")
        if msgs[-1]["role"] == "assistant":
            raise ChatError(400, f"messages[{len(msgs) - 1}] is an assistant message: the "
                                 "endpoint generates the next assistant turn; end the request "
                                 "with a user or tool message", param="messages")
        if not self.messages:
            new = msgs
            ids = self.renderer.prompt(self._shown(msgs), tools)
        else:
            n = len(self.messages)
            if tools != self.tools:
                raise ChatError(400, "'tools' differ from the task's first request (its prompt, "
                                     "which lists them, is already resident); send the same "
                                     "tools on every request of a task", param="tools",
                                code="history_mismatch")
            if len(msgs) <= n:
                raise ChatError(400, f"messages has {len(msgs)} entries but the task's history "
                                     f"already has {n}: a request must repeat the history and "
                                     "append new messages after the last assistant reply",
                                param="messages", code="history_mismatch")
            for i in range(n):
                why = difference(msgs[i], self.messages[i])
                if why:
                    raise ChatError(400, f"messages[{i}] does not extend the task's resident "
                                         f"history: {why}; send the history as it was returned "
                                         "and append new messages after it",
                                    param=f"messages[{i}]", code="history_mismatch")
            new = msgs[n:]
            if any(m["role"] == "assistant" for m in new):
                raise ChatError(400, "new messages include an assistant message the model did "
                                     "not write; append only user and tool messages",
                                param="messages", code="history_mismatch")
            ids = self.renderer.continuation(self._shown(self.messages), self._shown(new),
                                             tools, stopped=self.stopped)
        ids, patched = self._with_images(ids, new, first=len(msgs) - len(new))
        return Pending(messages=msgs, tools=tools, new_ids=ids, images=patched,
                       max_tokens=_max_tokens(body, max_action_tokens),
                       stop=_stop(body.get("stop")),
                       parse_tools=bool(tools) and body.get("tool_choice") != "none"
                       and self.parser != "none",
                       logprobs=bool(body.get("logprobs")),
                       token_ids=bool(body.get("return_token_ids")))

    def _shown(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template renders them (a VLM: image placeholders in the text)."""
        return messages if self.vision is None else with_placeholders(messages,
                                                                      self.vision.placeholder)

    def _with_images(self, ids: list[int], new: list[dict[str, Any]], *, first: int
                     ) -> tuple[list[int], list[Any]]:
        """A VLM's rendered ids with each new image's placeholder expanded to its token count,
        and the new images patched (earlier messages' images are in the context already)."""
        if self.vision is None:
            return ids, []
        from tiderl.models.vision_inputs import patch_image

        patched = []
        for i, m in enumerate(new, first):
            for k, im in enumerate(m.get("images", ())):
                try:
                    patched.append(patch_image(im, self.vision.vision, self.vision.processing))
                except ValueError as e:
                    raise ChatError(400, f"messages[{i}] image {k + 1}: {e}",
                                    param=f"messages[{i}].content", code="invalid_image") from None
        try:
            return self.vision.expand(patched, ids), patched
        except ValueError:
            raise ChatError(400, f"the new messages carry {len(patched)} images but their text "
                                 f"renders another number of image placeholders: the text holds "
                                 f"the placeholder {self.vision.placeholder!r} of its own; send "
                                 "images as image_url parts only", param="messages",
                            code="invalid_image") from None

    # -- its turn ---------------------------------------------------------------------------------
    def reply(self, p: Pending, action_ids: Sequence[int], logprobs: Sequence[float],
              versions: Sequence[int], *, length_stop: bool) -> Reply:
        """Appends the request's ids and the sampled action; returns the assistant reply."""
        if not self.messages:
            self.tools = p.tools
        self._extend(p.new_ids, 0)
        self.patched += p.images
        prompt_len = len(self.tokens)
        action = list(action_ids)
        self.tokens += action
        self.loss_mask += [1] * len(action)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.stopped = bool(action) and action[-1] in self.stop_ids
        self.turns += 1
        body = action[:-1] if self.stopped else action
        text = self.tok.decode(body)
        finish = "length" if length_stop and not self.stopped else "stop"
        cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:  # OpenAI's `stop`: the text up to the sequence; the tokens stay as sampled
            text, finish = text[:cut], "stop"
        parsed = parse(text, self.parser) if p.parse_tools else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsed is not None and parsed.tool_calls:
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": parsed.tool_calls}
            finish = "tool_calls"
        self.messages = [*p.messages, normalize_messages([message])[0]]
        return Reply(message=message, finish_reason=finish, action_ids=action,
                     logprobs=[float(x) for x in logprobs], versions=[int(v) for v in versions],
                     prompt_len=prompt_len,
                     malformed_tool_call=parsed is not None and parsed.malformed)

    def _extend(self, ids: Sequence[int], mask: int) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def logprob_entries(self, r: Reply) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(r.action_ids, r.logprobs, strict=True):
            text = self.tok.decode([t], skip_special=False)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": []})
        return out

    @property
    def transcript_messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.messages]


def _max_tokens(body: Mapping[str, Any], cap: int) -> int:
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw is None:
        return cap
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ChatError(400, f"max_tokens={raw!r} must be a positive integer",
                        param="max_tokens")
    return min(raw, cap)  # the run's rollout.max_action_tokens bounds every action


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw) or len(
            raw) > 4:
        raise ChatError(400, f"stop={json.dumps(raw)[:80]} must be a string or a list of up to "
                             "4 non-empty strings", param="stop")
    return tuple(raw)
