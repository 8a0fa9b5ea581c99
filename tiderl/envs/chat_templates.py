"""The checkpoint's own Jinja chat template as a turn template. No JAX.

A chat template renders a whole conversation to text; tiderl needs it turn by turn, as token ids,
without ever re-rendering earlier turns. So the template is rendered once, at construction, on
conversations whose messages are sentinels; the text between the sentinels gives the pieces (the
start of the chat, a default system turn, user/assistant headers, what follows an action's stop
token), split into text and added-token ids. `TurnTemplate` then encodes only the runs of text
around each observation, and the rollout appends the sampled action ids verbatim.

That is exact for templates whose rendering of turn k is a prefix of the rendering of turn k+1
with actions kept as they are (ChatML/Qwen2.5 with its default system message, Llama 3.x with its
date header, Qwen3 on actions without a <think> block, Gemma 3 with the system prompt folded into
the first user turn). It is checked at construction by re-rendering 3-turn conversations and
comparing token ids with the tokenized full rendering: a template that fails without a system
prompt raises a ValueError naming model.tokenizer; one that fails only with a system prompt gets
no system turn (so a configured controller.system_prompt is rejected by launch's validation).

Where a template rewrites earlier assistant turns (Qwen3 drops the <think> block of assistant
turns before the last user message; Llama 3 trims action whitespace), tiderl keeps the tokens the
model sampled and conditioned on: the trajectory then differs from what `apply_chat_template`
would render for the finished conversation, by design.

The Jinja environment mirrors transformers' (transformers/utils/chat_template_utils.py): a
sandbox with trim_blocks/lstrip_blocks, loop controls, `{% generation %}` blocks, the `tojson`
filter and `raise_exception`, `strftime_now`, `dict`, `namespace` globals; the tokenizer's named
special tokens (bos_token, eos_token, ...) are template variables. A template that reads the date
(`strftime_now`, Llama 3.2) renders it once, when the template is built.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from tiderl.envs.turns import Part, TurnTemplate

_SENTINEL = "@@tiderl-{}@@"  # no whitespace: survives templates that trim message content


def compile_chat_template(source: str) -> Any:
    """The compiled template in a sandbox configured as transformers configures it."""
    return _compile(source)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """Rejects underscore names, so a template cannot reach interpreter internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class TextFix:
    """What a template does to a message's text before writing it (Llama 3's `| trim`)."""

    op: str = ""  # "", "strip", "lstrip" or "rstrip"
    chars: str | None = None

    def __call__(self, text: str) -> str:
        return getattr(text, self.op)(self.chars) if self.op else text


_FIXES = (TextFix(), TextFix("strip"), TextFix("strip", "\n"), TextFix("lstrip"),
          TextFix("rstrip"), TextFix("lstrip", "\n"), TextFix("rstrip", "\n"))
_PROBES = (" \n\tprobe text\n\t ", "\n\nprobe\n", "  probe")


@dataclasses.dataclass(frozen=True)
class ChatTemplate(TurnTemplate):
    """A turn template derived from a Jinja chat template; keeps the template's source."""

    source: str = ""
    user_fix: TextFix = TextFix()
    system_fix: TextFix = TextFix()

    def _user_text(self, text: str) -> str:
        return self.user_fix(text)

    def _system_text(self, text: str) -> str:
        return self.system_fix(text)


class NotTurnDecomposable(ValueError):
    """The chat template cannot be rendered turn by turn with actions kept verbatim."""


def jinja_template(tok: Any, *, name: str = "jinja", chat_template: str | None = None,
                   **template_kwargs: Any) -> ChatTemplate:
    """The turn template of `tok`'s own chat template (or `chat_template`); `template_kwargs`
    are extra template variables (date_string, enable_thinking, ...), as apply_chat_template's
    kwargs."""
    source = chat_template if chat_template is not None else getattr(tok, "chat_template", None)
    where = f"the chat template of model.tokenizer={str(getattr(tok, 'path', '?'))!r}"
    if not source:
        raise ValueError(f"{where}: the tokenizer has no chat_template (tokenizer_config.json or "
                         "chat_template.jinja); use a built-in template family instead")
    import jinja2

    try:
        compiled = compile_chat_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"{where} does not compile: {e}") from e
    variables = {**getattr(tok, "special_tokens", {}), **template_kwargs}

    def render(messages: list[dict[str, str]], gen: bool) -> str:
        try:
            return compiled.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=gen, **variables)
        except jinja2.TemplateError as e:
            raise NotTurnDecomposable(f"{where} fails on a plain conversation: {e}") from e

    try:
        return _derive(tok, source, name, render)
    except NotTurnDecomposable as e:
        raise ValueError(f"{e}; tiderl needs a template that renders turn by turn (each turn's "
                         "rendering a prefix of the next); use a built-in template family "
                         "(chatml, llama3) or a tokenizer folder with a plainer template") from e


def _derive(tok: Any, source: str, name: str, render: Callable[[list, bool], str]
            ) -> ChatTemplate:
    where = f"the chat template of model.tokenizer={str(getattr(tok, 'path', '?'))!r}"
    U = [_SENTINEL.format(f"user{i}") for i in range(3)]
    A = [_SENTINEL.format(f"assistant{i}") for i in range(2)]
    S = _SENTINEL.format("system")
    turns = [_msg("user", U[0]), _msg("assistant", A[0]), _msg("user", U[1]),
             _msg("assistant", A[1]), _msg("user", U[2])]

    # Without a system message: X U0 Y A0 W U1 Y A1 W U2 Y.
    X, Y = _pieces(render(turns[:1], True), [U[0]], where)
    pieces = _pieces(render(turns, True), [U[0], A[0], U[1], A[1], U[2]], where)
    if pieces[:2] != [X, Y] or pieces[3] != Y or pieces[5] != Y or pieces[2] != pieces[4]:
        raise NotTurnDecomposable(
            f"{where} renders earlier turns differently once later turns follow (the "
            "generation prompt or an assistant turn changes)")
    W = pieces[2]
    added = _added_tokens(tok)
    stop_text = _token_at_start(W, added)
    if stop_text is None:
        raise NotTurnDecomposable(
            f"{where} does not end an assistant turn with a special token ({W[:40]!r} follows "
            "the action)")
    after = W[len(stop_text):]

    # With a system message: Xs S V U0 Y ...; none if the template refuses it, rewrites it in a
    # way the usual text fixes do not describe, or renders later turns differently after it.
    system, system_fix = None, TextFix()
    try:
        Xs, V, Ys = _pieces(render([_msg("system", S), *turns[:1]], True), [S, U[0]], where)
        s3 = _pieces(render([_msg("system", S), *turns], True),
                     [S, *(m["content"] for m in turns)], where)
        if Ys == Y and s3 == [Xs, V, Y, W, Y, W, Y]:
            system_fix = _fix_of(render, lambda t: [_msg("system", t), turns[0]], Xs,
                                 V + U[0] + Y, where)
            system = (Xs, V)
    except NotTurnDecomposable:
        system = None

    user_open = _common_suffix([X, after] + ([system[1]] if system else []))
    first = _first_token_pos(user_open, added)
    user_open = user_open[first:] if first is not None else ""
    begin = getattr(tok, "bos_token", None) or ""
    if not (X.startswith(begin) and (system is None or system[0].startswith(begin))):
        begin = ""
    opener = _token_at_start(user_open, added)
    split = Y.rfind(opener) if opener else -1
    user_close, assistant_open = (Y[:split], Y[split:]) if split >= 0 else ("", Y)

    def parts(text: str) -> tuple[Part, ...]:
        return _to_parts(text, added)

    def cut(text: str, tail: str) -> str:
        return text[:len(text) - len(tail)] if tail else text

    stop_id = added[stop_text]
    eos_ids = tuple(int(i) for i in getattr(tok, "eos_ids", ()) if int(i) != stop_id)
    fields: dict[str, Any] = dict(
        tokenizer=tok, name=name, begin=parts(begin),
        user_open=parts(user_open), user_close=parts(user_close),
        assistant_open=parts(assistant_open), stop=(stop_id,),
        after_action=parts(cut(after, user_open)),
        default_system=parts(cut(X[len(begin):], user_open)), extra_stop=eos_ids, source=source,
        user_fix=_fix_of(render, lambda t: [_msg("user", t)], X, Y, where))
    if system is not None:
        Xs, V = system
        fields.update(system_open=parts(Xs[len(begin):]), system_close=parts(cut(V, user_open)),
                      system_fix=system_fix)
    template = ChatTemplate(**fields)
    _check_tokens(template, render, where, system=None)
    if template.system_open:
        try:
            _check_tokens(template, render, where, system=_CHECK_SYSTEM)
        except NotTurnDecomposable:  # no system turn rather than an inexact one
            template = dataclasses.replace(template, system_open=(), system_close=(),
                                           system_fix=TextFix())
    return template


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _pieces(text: str, sentinels: Sequence[str], where: str) -> list[str]:
    """`text` split at each sentinel, which must each appear once and in order."""
    out, pos = [], 0
    for s in sentinels:
        i = text.find(s, pos)
        if i < 0 or text.count(s) != 1:
            raise NotTurnDecomposable(
                f"{where} does not write each message's content once and in order")
        out.append(text[pos:i])
        pos = i + len(s)
    out.append(text[pos:])
    return out


def _added_tokens(tok: Any) -> dict[str, int]:
    added = getattr(tok, "added_tokens", None)
    if added:
        return dict(added)
    out = {}
    for text in getattr(tok, "special_tokens", {}).values():
        i = tok.token_to_id(text) if hasattr(tok, "token_to_id") else None
        if i is not None:
            out[text] = int(i)
    return out


def _token_at_start(text: str, added: dict[str, int]) -> str | None:
    """The (longest) added token `text` starts with, if any."""
    return next((t for t in sorted(added, key=len, reverse=True) if text.startswith(t)), None)


def _first_token_pos(text: str, added: dict[str, int]) -> int | None:
    """Where the first added token in `text` starts, if any."""
    hits = [text.find(t) for t in added if t in text]
    return min(hits) if hits else None


def _common_suffix(texts: list[str]) -> str:
    n = 0
    while all(len(t) > n for t in texts) and len({t[len(t) - n - 1] for t in texts}) == 1:
        n += 1
    return texts[0][len(texts[0]) - n:] if n else ""


def _to_parts(text: str, added: dict[str, int]) -> tuple[Part, ...]:
    """Text split into runs and added-token ids (longest token first, as a tokenizer splits)."""
    if not text:
        return ()
    present = sorted((t for t in added if t and t in text), key=len, reverse=True)
    if not present:
        return (text,)
    out: list[Part] = []
    for piece in re.split("(" + "|".join(map(re.escape, present)) + ")", text):
        if piece in added:
            out.append(added[piece])
        elif piece:
            out.append(piece)
    return tuple(out)


def _fix_of(render: Callable[[list, bool], str], messages: Callable[[str], list], before: str,
            after: str, where: str) -> TextFix:
    """Which of the usual text fixes (none, strip, ...) the template applies to a message."""
    seen = []
    for probe in _PROBES:
        out = render(messages(probe), True)
        if not (out.startswith(before) and out.endswith(after)
                and len(out) >= len(before) + len(after)):
            raise NotTurnDecomposable(f"{where} writes the text around a message differently "
                                      "depending on its content")
        seen.append((probe, out[len(before):len(out) - len(after)]))
    for fix in _FIXES:
        if all(fix(p) == got for p, got in seen):
            return fix
    raise NotTurnDecomposable(f"{where} rewrites message text ({seen[0][0]!r} is written as "
                              f"{seen[0][1]!r})")


_CHECK_OBS = ("You are in a kitchen.\nThere is a fridge here. ", "  The fridge opens; it holds "
              "an apple.\n", "Taken. Score: 10/10")
_CHECK_ACT = ("open fridge", "take apple")


_CHECK_SYSTEM = " Play the game.\nBe brief."


def _check_tokens(template: ChatTemplate, render: Callable[[list, bool], str], where: str, *,
                  system: str | None) -> None:
    """Token ids built turn by turn equal the tokenized full rendering of a 3-turn conversation;
    the action ids are encode(action) + stop, as an engine would sample them."""
    tok = template.tokenizer
    ids = template.prompt(_CHECK_OBS[0], system=system)
    messages = ([] if system is None else [_msg("system", system)]) + [
        _msg("user", _CHECK_OBS[0])]
    for act, obs in zip(_CHECK_ACT, _CHECK_OBS[1:], strict=True):
        ids += tok.encode(act) + [template.stop[0]]
        ids += template.observation(obs)
        messages += [_msg("assistant", act), _msg("user", obs)]
    expected = tok.encode(render(messages, True))
    if ids != expected:
        at = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False))
                   if a != b),
                  min(len(ids), len(expected)))
        raise NotTurnDecomposable(
            f"{where}: token ids built turn by turn differ from the tokenized rendering at "
            f"position {at} (turn by turn {tok.decode(ids[at:at + 8], skip_special=False)!r},"
            f" rendered {tok.decode(expected[at:at + 8], skip_special=False)!r})")
