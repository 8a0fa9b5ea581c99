"""The default task in its chat form (env.options format=chat, docs/how-to/real-model.md): the
lenient parser, the adapter's sentences and system prompt, the same game and rewards as the
byte form, the byte form unchanged, and the system prompt reaching the first prefill through
the checkpoint's own chat template (or ahead of the first observation when a template has no
system role)."""

from __future__ import annotations

import itertools

import pytest

from tiderl.envs.adapters.default import (CHAT_SYSTEM, FIRST, GuessNumber, parse_chat_guess,
                                          parse_guess)
from tiderl.envs.config import EnvConfig
from tiderl.envs.tasks import system_prompt
from tiderl.envs.templates import Transcript, byte_template, chatml_template


@pytest.mark.parametrize("reply,want", [
    ("4", 4), (" 4\n", 4), ("I guess 4.", 4), ("My guess is 7, or maybe 2", 7),
    ("1-8: 1-8 is a number", 1), ("+3", 3), ("08", 8), ("Five", None), ("", None),
    ("9", None), ("0", None), ("-3 then 4", None), ("12", None), ("x4y", 4),
    ("٣", None),  # only ASCII digits count
])
def test_the_lenient_parser_reads_the_first_integer(reply, want):
    assert parse_chat_guess(reply, 8) == want


@pytest.mark.parametrize("reply,want", [("4", 4), (" 4 ", 4), ("I guess 4", None),
                                        ("4.", None), ("9", None), ("", None)])
def test_the_byte_form_stays_strict(reply, want):
    assert parse_guess(reply, 8) == want


def _play(options, seed, actions):
    g = GuessNumber(options)
    obs = [g.reset({"seed": seed})]
    for a in actions:
        step = g.step(a)
        obs.append(step.observation)
        if step.done:
            break
    return obs, g.close()


def test_chat_form_says_sentences_and_states_the_rules():
    opts = {"format": "chat", "hint": "range"}
    assert GuessNumber.system_prompt(opts) == CHAT_SYSTEM.format(n=8, guesses=3)
    assert "integer from 1 to 8" in GuessNumber.system_prompt(opts)
    assert "3 tries" in GuessNumber.system_prompt(opts)
    assert GuessNumber.system_prompt({"format": "chat", "n": "5", "guesses": "4"}).count(
        "1 to 5") == 1
    assert GuessNumber.system_prompt({}) is None  # the byte form has no system turn
    # seed 1's target is 3 (n=8): higher, then lower, then the last try.
    obs, (reward, info) = _play(opts, 1, ["I think 1", "Is it 5?", "7"])
    assert info["target"] == 3
    assert obs == ["What is your guess (1-8)?", "Higher! It is from 2 to 8. Your next guess?",
                   "Lower! It is from 2 to 4. Your next guess?",
                   "Wrong, and that was your last try."]
    assert reward == 0.0 and info["valid_guesses"] == 3
    obs, _ = _play({"format": "chat"}, 1, ["seven", "3"])
    assert obs[1:] == ["That is not a number from 1 to 8. Your next guess?", "Correct!"]


def test_chat_form_is_the_same_game_with_the_same_rewards():
    """Every action sequence over 0..9 (and a non-answer) on every target: the chat form with
    the replies written as words around the digit pays what the byte form pays for the bare
    digits, ends on the same turn, and counts the same (valid, consistent) guesses."""
    shaping = {"format_bonus": "0.1", "bonus": "consistent", "hint": "range",
               "targets": "member"}
    for seed, acts in itertools.product(range(8), itertools.product("0159x", repeat=3)):
        byte_obs, byte_end = _play(shaping, seed, acts)
        chat_obs, chat_end = _play({**shaping, "format": "chat"}, seed,
                                   [f"My guess: {a}." for a in acts])
        assert len(byte_obs) == len(chat_obs) and byte_end == chat_end, (seed, acts)
    assert _play(shaping, 0, [])[0] == [FIRST.format(n=8)]


def test_chat_form_options_are_checked():
    with pytest.raises(ValueError, match="format='json' must be 'byte' or 'chat'"):
        GuessNumber({"format": "json"})
    GuessNumber({"format": "chat", "n": "20"})  # words, not one byte: n may pass 9
    with pytest.raises(ValueError, match="out of range 2..9"):
        GuessNumber({"n": "20"})


def test_a_run_takes_its_system_turn_from_the_suite():
    assert system_prompt(EnvConfig(options=("format=chat", "guesses=4"))) == CHAT_SYSTEM.format(
        n=8, guesses=4)
    assert system_prompt(EnvConfig()) is None
    assert system_prompt(EnvConfig(tasks="t.jsonl", reward="m:f")) is None  # single-turn rows


class _Bytes:
    """A byte-level tokenizer with the ChatML role markers as added tokens 256, 257."""

    bos_id, eos_id, im_start_id, im_end_id = 258, 259, 256, 257
    vocab_size = 272
    _named = {"<|im_start|>": 256, "<|im_end|>": 257, "<bos>": 258, "<|endoftext|>": 259}

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def token_to_id(self, name):
        return self._named.get(name)


def test_the_system_turn_reaches_the_first_prefill():
    tok = _Bytes()
    chat = Transcript.start(chatml_template(tok), "What is your guess (1-8)?", system="RULES")
    assert tok.decode(chat.tokens) == ("system\nRULES\nuser\nWhat is your guess (1-8)?\n"
                                       "assistant\n")
    assert chat.tokens.count(256) == 3 and set(chat.loss_mask) == {0}
    # No system role (the byte template): the rules lead the first observation instead.
    folded = Transcript.start(byte_template(tok), "guess", system="RULES")
    assert folded.tokens == byte_template(tok).prompt("RULES\n\nguess")
    assert Transcript.start(byte_template(tok), "guess").tokens == byte_template(tok).prompt(
        "guess")
