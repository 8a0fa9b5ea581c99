"""Tool calls read from the model's output into the OpenAI `tool_calls` field. No JAX.

Two formats, as the checkpoints' chat templates ask for them:

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call; text before the first block is the message content. A final
  block the model did not close (it hit its token limit right after the JSON) is still read.
- `llama3` (Llama 3.1/3.2 JSON tool calling): the whole output is `{"name": ...,
  "parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`, several joined by
  `;`.

Documented fallback, as vLLM's parsers do: output that is not in the format, or that is in it
but does not parse (bad JSON, no name, arguments not an object), comes back as plain `content`
with no `tool_calls` and `finish_reason` "stop"; the trajectory keeps the tokens as sampled
either way, so the policy is trained on exactly what it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Literal

Parser = Literal["hermes", "llama3", "none"]
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]]
    malformed: bool = False
    """The output tried the format but did not parse (the fallback was taken)."""


def parser_for(template_source: str, setting: str = "auto") -> Parser:
    """The parser `setting` names, or for 'auto' the one the chat template's text asks for."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return "llama3"
    return "none"


def parse(text: str, parser: Parser) -> Parsed:
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3":
        return _llama3(text)
    return Parsed(text, [])


def _call(name: Any, args: Any) -> dict[str, Any] | None:
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return Parsed(text, [])
    calls = []
    for m in _HERMES.finditer(text):
        body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return Parsed(text, [], malformed=True)
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters", {}))) \
            if isinstance(obj, dict) else None
        if call is None:
            return Parsed(text, [], malformed=True)
        calls.append(call)
    content = text[:text.index("<tool_call>")].rstrip()
    return Parsed(content or None, calls)


def _llama3(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return Parsed(text, [], malformed=True)
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) \
            if isinstance(obj, dict) else None
        if call is None:
            return Parsed(text, [], malformed=True)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return Parsed(None, calls)
