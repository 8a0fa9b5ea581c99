"""Checkpoint chat templates rendered turn by turn: token ids equal transformers'
apply_chat_template on the same conversation (tiny BPE tokenizers trained here, real templates
written out below, nothing downloaded)."""

from __future__ import annotations

import json

import pytest

from tiderl.envs.chat_templates import jinja_template
from tiderl.envs.templates import Transcript, template_for
from tiderl.models.tokenizer import HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

# Qwen2.5-Instruct's template (tools branch included); it writes a default system message.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3's template: drops <think> blocks of assistant turns before the last user message.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

_LLAMA_HEAD = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
"""
_LLAMA31_DATE = r"""{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
"""
_LLAMA32_DATE = r"""{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
"""
_LLAMA_BODY = r"""{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
LLAMA31 = _LLAMA_HEAD + _LLAMA31_DATE + _LLAMA_BODY  # Llama 3.1 Instruct
LLAMA32 = _LLAMA_HEAD + _LLAMA32_DATE + _LLAMA_BODY.replace(  # Llama 3.2 Instruct: today's date
    """{%- if builtin_tools is defined or tools is not none %}""",
    """{%- if tools is not none %}""")

# Gemma 3's template (text content only): a system prompt is folded into the first user turn.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Pre-tokenizer splits of the real tokenizer.json files (Qwen2 and Llama 3 differ in digits).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

CORPUS = ["user assistant system\n\n", "You are in a kitchen.\nThere is a fridge here.",
          "open fridge\ntake apple from fridge", "The fridge opens; it holds an apple.",
          "Taken. Score: 10/10", "Play the game. Be brief.", "You are Qwen, created by "
          "Alibaba Cloud. You are a helpful assistant.", "Cutting Knowledge Date: December "
          "2023\nToday Date: 26 Jul 2024\n\n", "<think>\nthe apple is in the fridge\n</think>"]


def _checkpoint(folder, *, split, specials, extra_added=(), template, bos=None, eos, pad=None,
                gen_eos=None):
    """A tiny byte-level BPE with the family's pre-tokenizer and special tokens, saved by
    transformers as a checkpoint folder (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) plus generation_config.json; returns transformers' tokenizer."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 30, trainer)
    if extra_added:  # Qwen3's <think> and </think>: added, not special
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_added])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                              eos_token=eos, pad_token=pad,
                                              chat_template=template)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    if gen_eos is not None:
        ids = [hf.convert_tokens_to_ids(t) for t in gen_eos]
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0]}))
    return hf


def qwen25(folder):
    return _checkpoint(folder, split=QWEN_SPLIT, specials=QWEN_SPECIALS, template=QWEN25,
                       eos="<|im_end|>", pad="<|endoftext|>",
                       gen_eos=["<|im_end|>", "<|endoftext|>"])


def qwen3(folder):
    return _checkpoint(folder, split=QWEN_SPLIT, specials=QWEN_SPECIALS,
                       extra_added=("<think>", "</think>"), template=QWEN3, eos="<|im_end|>",
                       pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"])


def llama(folder, template):
    return _checkpoint(folder, split=LLAMA_SPLIT, specials=LLAMA_SPECIALS, template=template,
                       bos="<|begin_of_text|>", eos="<|eot_id|>",
                       gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])


OBS = ["You are in a kitchen.\nThere is a fridge here.", " The fridge opens; it holds an apple.\n",
       "Taken. Score: 10/10"]
ACTS = ["open fridge", "take apple"]


def _hf_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    if not isinstance(out, list):  # a BatchEncoding
        out = out["input_ids"]
    return list(out)


def _check_parity(tpl, ours, hf, system, **kwargs):
    """Builds 3 turns through Transcript; before each action (and at the end) its ids equal
    apply_chat_template(..., add_generation_prompt=True) on the conversation so far, and each
    such rendering is a prefix of the next."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": OBS[0]})
    t = Transcript.start(tpl, OBS[0], system=system)
    previous: list[int] = []
    for k in range(3):
        expected = _hf_ids(hf, messages, **kwargs)
        assert t.tokens == expected, (k, ours.decode(t.tokens, skip_special=False),
                                      hf.decode(expected))
        assert expected[:len(previous)] == previous  # the prefix property, in transformers too
        previous = expected
        if k == 2:
            break
        sampled = ours.encode(ACTS[k]) + [tpl.stop[0]]  # what an engine samples: text + stop
        assert t.add_action(sampled) == ACTS[k]
        t.add_observation(OBS[k + 1])
        messages += [{"role": "assistant", "content": ACTS[k]},
                     {"role": "user", "content": OBS[k + 1]}]
    # The loss mask covers exactly the sampled action ids.
    assert sum(t.loss_mask) == sum(len(ours.encode(a)) + 1 for a in ACTS)
    return t


@pytest.mark.parametrize("system", [None, "Play the game.\nBe brief."])
def test_qwen25_turn_by_turn_equals_apply_chat_template(tmp_path, system):
    hf = qwen25(tmp_path)
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    assert tpl.name == "jinja" and tpl.system_open
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert tpl.stop == (im_end,) and tpl.stop_ids == {im_end, eot}
    # No system prompt: the template's default system message is part of the prompt.
    assert "You are Qwen" in ours.decode(tpl.prompt("hi"))
    _check_parity(tpl, ours, hf, system)


@pytest.mark.parametrize("system", [None, "  Play the game.\nBe brief. "])
def test_llama31_turn_by_turn_equals_apply_chat_template(tmp_path, system):
    hf = llama(tmp_path, LLAMA31)
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    ids = {t: ours.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")}
    assert tpl.stop == (ids["<|eot_id|>"],) and tpl.stop_ids == set(ids.values())
    assert tpl.begin == (ours.token_to_id("<|begin_of_text|>"),) and tpl.system_open
    # The date header is written with or without a system prompt (trimmed, as the template does).
    assert "Today Date: 26 Jul 2024" in ours.decode(tpl.prompt("hi"))
    _check_parity(tpl, ours, hf, system)


@pytest.mark.parametrize("system", [None, "Play the game."])
def test_llama32_with_a_fixed_date_string(tmp_path, system):
    hf = llama(tmp_path, LLAMA32)
    ours = HFTokenizer(tmp_path)
    tpl = jinja_template(ours, date_string="03 Feb 2025")  # the template reads strftime_now
    assert "Today Date: 03 Feb 2025" in ours.decode(tpl.prompt("hi"))
    _check_parity(tpl, ours, hf, system, date_string="03 Feb 2025")


@pytest.mark.parametrize("system", [None, "Play the game."])
def test_qwen3_plain_actions_match_and_think_blocks_are_kept_as_sampled(tmp_path, system):
    hf = qwen3(tmp_path)
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    assert ours.chat_template == QWEN3 and tpl.system_open  # read from chat_template.jinja
    # No default system message in Qwen3: the prompt starts at the user turn.
    assert tpl.prompt("hi")[0] == ours.token_to_id("<|im_start|>")
    _check_parity(tpl, ours, hf, system)

    # An action with a reasoning block: the transcript keeps the sampled ids (what the model
    # conditioned on); Qwen3's template drops the block from earlier turns when re-rendering.
    think = "<think>\nthe apple is in the fridge\n</think>\n\nopen fridge"
    t = Transcript.start(tpl, OBS[0], system=system)
    sampled = ours.encode(think) + [tpl.stop[0]]
    assert ours.token_to_id("<think>") in sampled
    assert t.add_action(sampled).endswith("open fridge")
    t.add_observation(OBS[1])
    head = [] if system is None else [{"role": "system", "content": system}]
    rerendered = _hf_ids(hf, head + [{"role": "user", "content": OBS[0]},
                                     {"role": "assistant", "content": think},
                                     {"role": "user", "content": OBS[1]}])
    assert ours.token_to_id("<think>") not in rerendered
    assert ours.token_to_id("<think>") in t.tokens and t.tokens != rerendered
    start, end = t.action_spans[0]
    assert t.tokens[start:end] == sampled


def test_qwen3_without_thinking_is_not_turn_decomposable(tmp_path):
    """enable_thinking=False writes an empty think block in the generation prompt only, so the
    prompt of turn 1 is not a prefix of turn 2's rendering: refused, naming model.tokenizer."""
    qwen3(tmp_path)
    with pytest.raises(ValueError, match="model.tokenizer=.*earlier turns differently"):
        jinja_template(HFTokenizer(tmp_path), enable_thinking=False)


def test_template_without_a_special_turn_end_is_refused(tmp_path):
    plain = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    _checkpoint(tmp_path, split=QWEN_SPLIT, specials=QWEN_SPECIALS, template=plain,
                eos="<|endoftext|>")
    with pytest.raises(ValueError, match="model.tokenizer=.*special token"):
        template_for(HFTokenizer(tmp_path), "auto")
    with pytest.raises(ValueError, match="does not compile"):
        jinja_template(HFTokenizer(tmp_path), chat_template="{% for %}")


def test_header_that_merges_with_the_action_is_refused(tmp_path):
    """'assistant: ' + action: the tokenizer joins the space to the action's first word in the
    full rendering, so encode(action) ids could never match it; caught at construction."""
    spaced = ("{% for m in messages %}{{ '<|im_start|>' + m.role + ': ' + m.content + "
              "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|im_start|>assistant: ' }}{% endif %}")
    _checkpoint(tmp_path, split=QWEN_SPLIT, specials=QWEN_SPECIALS, template=spaced,
                eos="<|im_end|>")
    with pytest.raises(ValueError, match="model.tokenizer=.*token ids built turn by turn differ"):
        template_for(HFTokenizer(tmp_path), "auto")


def test_template_that_rejects_a_system_role_has_no_system_turn(tmp_path):
    no_system = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception("
                 "'System role not supported') }}{% endif %}{{ '<|im_start|>' + m.role + '\n' + "
                 "m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
    hf = _checkpoint(tmp_path, split=QWEN_SPLIT, specials=QWEN_SPECIALS, template=no_system,
                     eos="<|im_end|>")
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    assert tpl.system_open == () and tpl.stop_ids == {ours.token_to_id("<|im_end|>")}
    _check_parity(tpl, ours, hf, None)
    with pytest.raises(ValueError, match="no system turn"):
        tpl.prompt("hi", system="Play.")


@pytest.mark.parametrize("system", [None, "Play the game."])
def test_gemma3_folds_the_system_prompt_into_the_first_user_turn(tmp_path, system):
    """The system text is written inside the first user turn (then the user text, trimmed):
    the derived pieces place it there, and the text runs around it are encoded as one, as
    transformers encodes them."""
    hf = _checkpoint(tmp_path, split=QWEN_SPLIT, template=GEMMA3, bos="<bos>", eos="<eos>",
                     specials=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
                     gen_eos=["<eos>", "<end_of_turn>"])
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    sot = ours.token_to_id("<start_of_turn>")
    assert tpl.begin == (ours.token_to_id("<bos>"),) and tpl.system_open == (sot, "user\n")
    assert tpl.system_close == ("\n\n",) and tpl.user_open == ()
    assert tpl.stop_ids == {ours.token_to_id("<end_of_turn>"), ours.token_to_id("<eos>")}
    _check_parity(tpl, ours, hf, system)


def test_truncated_action_is_closed_with_the_turn_end(tmp_path):
    qwen25(tmp_path)
    ours = HFTokenizer(tmp_path)
    tpl = template_for(ours, "auto")
    t = Transcript.start(tpl, OBS[0])
    t.add_action(ours.encode("open fri"))  # hit the action limit: no stop token sampled
    new = t.add_observation(OBS[1])
    assert new[0] == ours.token_to_id("<|im_end|>") and t.loss_mask[-len(new)] == 0


def test_launch_validate_accepts_a_system_prompt_for_a_checkpoint_template(tmp_path):
    from tiderl.config import load_config
    from tiderl.configlib import ConfigError
    from tiderl.launch import validate

    llama(tmp_path / "llama", LLAMA31)
    # The tiny tokenizers here have a few hundred tokens: an embedding that fits them.
    validate(load_config(None, [f"model.tokenizer={tmp_path / 'llama'}", "model.vocab_size=1024",
                                "controller.system_prompt=Play well."]))
    # A checkpoint whose template is not turn-decomposable is a config error on model.tokenizer.
    qwen3(tmp_path / "qwen3")
    cfg = json.loads((tmp_path / "qwen3" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[-1].content }}"  # renders only the last message
    (tmp_path / "qwen3" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "qwen3" / "chat_template.jinja").unlink()
    assert load_tokenizer(str(tmp_path / "qwen3")).chat_template == cfg["chat_template"]
    with pytest.raises(ConfigError, match="config key 'model.tokenizer'.*renders turn by turn"):
        validate(load_config(None, [f"model.tokenizer={tmp_path / 'qwen3'}",
                                    "model.vocab_size=1024"]))
