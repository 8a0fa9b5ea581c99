"""Tool calls read from model output in the formats checkpoints' chat templates ask for, and the
documented fallback (plain content) for output that tries a format and fails it."""

from __future__ import annotations

import json

import pytest

from tiderl.agents.toolcalls import parse, parser_for


def fn(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_qwen_blocks_with_content_before_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"word": "été"}}\n'
            '</tool_call>')
    p = parse(text, "hermes")
    assert p.content == "Let me compute." and not p.malformed
    assert [fn(c) for c in p.tool_calls] == [("calc", {"expression": "2+3"}),
                                             ("lookup", {"word": "été"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in p.tool_calls)
    assert len({c["id"] for c in p.tool_calls}) == 2


def test_hermes_block_cut_before_its_closing_tag_and_string_arguments():
    p = parse('<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}',
              "hermes")
    assert p.content is None and [fn(c) for c in p.tool_calls] == [("calc", {"expression": "1"})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "calc", "arguments": {expression: 2}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                               # no name
    '<tool_call>\n{"name": "calc", "arguments": [1, 2]}\n</tool_call>',            # not an object
    '<tool_call>\n["calc"]\n</tool_call>'])
def test_badly_formatted_hermes_calls_fall_back_to_content(text):
    p = parse(text, "hermes")
    assert p.content == text and p.tool_calls == [] and p.malformed


def test_llama3_json_calls():
    p = parse('{"name": "calc", "parameters": {"expression": "6*7"}}', "llama3")
    assert p.content is None and [fn(c) for c in p.tool_calls] == [("calc", {"expression": "6*7"})]
    two = parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": '
                '{"x": 1}}', "llama3")
    assert [fn(c) for c in two.tool_calls] == [("a", {}), ("b", {"x": 1})]
    assert parse("The answer is 42.", "llama3").tool_calls == []
    bad = parse('{"name": "calc", "parameters": {"expression": ', "llama3")
    assert bad.malformed and bad.content.startswith('{"name"') and bad.tool_calls == []


def test_plain_text_is_content_and_parsers_follow_the_template():
    assert parse("no calls here", "hermes").content == "no calls here"
    assert parse("<tool_call> x", "none").tool_calls == []
    assert parser_for("... <tool_call>\\n{...}</tool_call> ...") == "hermes"
    assert parser_for('... {"name": function name, "parameters": ...}') == "llama3"
    assert parser_for("{{ messages }}") == "none"
    assert parser_for("<tool_call>", "llama3") == "llama3"
