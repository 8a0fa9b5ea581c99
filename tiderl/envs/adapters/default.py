"""The default task: guess a hidden number with higher/lower feedback. No JAX, no deps.

Built so a ~100k-parameter decoder trained from scratch on CPU can learn it in minutes, and so
that learning is *provably* closed-loop: with n=8 and 3 guesses a uniformly random guesser wins
169/512 = 33.0% of episodes, the best policy that ignores observations wins 3/8 = 37.5% (three
distinct guesses), and binary search on the feedback wins 7/8 = 87.5%. Success above 37.5% can
only come from reading the feedback. `benchmarks/default_task.py` measures all three exactly.

Actions are one token under the byte tokenizer (a digit); observations are one short word.

`format=chat` is the same game for a pretrained chat model: a system prompt states the rules and
the answer format, observations are sentences, and the answer is read leniently (the first
integer in the reply, so "I guess 4." is a guess of 4). Targets, rewards, shaping and the rates
above are the same; the byte form (the default) keeps its strict one-digit answers.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from tiderl.envs.adapters.base import Adapter, Step, int_option

FIRST = "guess 1-{n}"
HIGHER, LOWER, CORRECT, INVALID, LOST = "higher", "lower", "correct", "invalid", "lost"

# The chat form: rules in the system prompt, observations as sentences. {lo}-{hi} is the range
# still consistent with the feedback (shown with hint=range, as in the byte form).
CHAT_SYSTEM = ("We play a guessing game. The secret number is an integer from 1 to {n}. You "
               "have {guesses} tries. After a wrong guess you are told whether the secret "
               "number is higher or lower. Answer with a single number and nothing else.")
CHAT_FIRST = "What is your guess (1-{n})?"
CHAT_WORDS = {HIGHER: "Higher!", LOWER: "Lower!", CORRECT: "Correct!",
              INVALID: "That is not a number from 1 to {n}.",
              LOST: "Wrong, and that was your last try."}
CHAT_RANGE = " It is from {lo} to {hi}."
CHAT_NEXT = " Your next guess?"
FORMATS = ("byte", "chat")
_INTEGER = re.compile(r"[-+]?[0-9]+")


def target_of(seed: int, n: int) -> int:
    """The hidden number of env seed `seed` (uniform over 1..n across seeds)."""
    return random.Random(seed).randrange(n) + 1


def parse_guess(action: str, n: int) -> int | None:
    """The guessed number, or None when the action is not exactly one integer in 1..n (the
    byte form: a digit and nothing else)."""
    text = action.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return value if 1 <= value <= n else None


def parse_chat_guess(action: str, n: int) -> int | None:
    """The first integer in a chat reply ("My guess is 4." -> 4), or None when there is none or
    it is outside 1..n (a reply's later numbers never rescue a first one out of range)."""
    found = _INTEGER.search(action)
    if found is None:
        return None
    value = int(found.group())
    return value if 1 <= value <= n else None


class GuessNumber(Adapter):
    """Guess the number in 1..n within `guesses` tries; reward 1 on a hit, else 0."""

    client_options = frozenset({"n", "guesses", "format_bonus", "bonus", "hint", "targets",
                                "target", "format"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        # format=chat: the game for a pretrained chat model (module docstring); byte: one digit.
        self.format = self.options.get("format", "byte")
        if self.format not in FORMATS:
            raise ValueError(f"suite option format={self.format!r} must be 'byte' or 'chat'")
        self.max_n = 9 if self.format == "byte" else 1000
        self.n = int_option(self.options, "n", 8, lo=2, hi=self.max_n, where="suite option")
        self.guesses = int_option(self.options, "guesses", 3, lo=1, hi=64, where="suite option")
        # Reward shaping for policies trained from scratch: a failed episode earns
        # format_bonus × (valid guesses / guesses), so a byte-level policy first learns to answer
        # with a digit. Success stays exactly 1.0 and is what evaluation counts.
        self.format_bonus = float(self.options.get("format_bonus", "0"))
        if not 0.0 <= self.format_bonus < 1.0:
            raise ValueError(f"suite option format_bonus={self.format_bonus} must be in [0, 1)")
        # bonus=consistent pays the bonus only for guesses still possible given the feedback so
        # far (inside the range, so each turn's feedback must be read to earn it); bonus=valid
        # (the default) for any valid guess. Neither changes what a win pays or what is counted.
        self.bonus = self.options.get("bonus", "valid")
        if self.bonus not in ("valid", "consistent"):
            raise ValueError(f"suite option bonus={self.bonus!r} must be 'valid' or 'consistent'")
        # hint=range appends the range still consistent with all feedback ("higher 5-8"): the
        # same game and the same open-loop/optimal rates, but each observation carries the
        # state, so a tiny policy need not attend back across turns to act optimally.
        self.hint = self.options.get("hint", "none")
        if self.hint not in ("none", "range"):
            raise ValueError(f"suite option hint={self.hint!r} must be 'none' or 'range'")
        self.lo, self.hi = 1, self.n
        # targets=member: each sibling of a GRPO group gets its own hidden number (the prompt is
        # the same for every target, so a group is still G samples of one prompt). A policy
        # that already wins some targets then keeps seeing varied rewards, where one target per
        # group soon gives all-equal groups that carry no GRPO signal.
        self.targets = self.options.get("targets", "group")
        if self.targets not in ("group", "member"):
            raise ValueError(f"suite option targets={self.targets!r} must be 'group' or 'member'")
        self.valid = 0
        self.consistent = 0
        self.target = 0
        self.used = 0
        self.success = False
        self.history: list[str] = []

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = {"seed": seed}
        # target=K fixes every task's hidden number; target=0 is none, so no guess can win (a
        # null task: every group has zero reward variance, to check how a run handles that).
        for name in ("n", "guesses", "target"):
            if name in options:
                fields[name] = int(options[name])
        return fields

    @classmethod
    def system_prompt(cls, options: Mapping[str, str]) -> str | None:
        """The rules and answer format (format=chat); None for the byte form."""
        if options.get("format", "byte") != "chat":
            return None
        return CHAT_SYSTEM.format(n=options.get("n", "8"), guesses=options.get("guesses", "3"))

    def reset(self, task: Mapping[str, Any]) -> str:
        # n <= 9 keeps every byte-form action a single digit, i.e. one byte token.
        self.n = int_option(task, "n", self.n, lo=2, hi=self.max_n)
        self.guesses = int_option(task, "guesses", self.guesses, lo=1, hi=64)
        seed = int_option(task, "seed", 0, lo=0, hi=(1 << 63) - 1)
        if self.targets == "member":
            seed = seed * 1_000_003 + int_option(task, "member", 0, lo=0, hi=1 << 20)
        self.target = int_option(task, "target", target_of(seed, self.n), lo=0, hi=self.n)
        self.used = 0
        self.valid = 0
        self.consistent = 0
        self.lo, self.hi = 1, self.n
        self.success = False
        self.history = []
        return (CHAT_FIRST if self.format == "chat" else FIRST).format(n=self.n)

    def step(self, action: str) -> Step:
        if self.success or self.used >= self.guesses:
            raise RuntimeError("step after the episode ended (a bug in the caller or server)")
        self.used += 1
        guess = (parse_chat_guess if self.format == "chat" else parse_guess)(action, self.n)
        self.valid += guess is not None
        self.consistent += guess is not None and self.lo <= guess <= self.hi
        self.history.append(action[:16])
        if guess == self.target:
            self.success = True
            return Step(self._said(CORRECT), True, 1.0)
        if self.used >= self.guesses:
            return Step(self._said(LOST), True, self._shaped())
        if guess is None:
            return Step(self._hinted(INVALID), False, 0.0)
        if self.target > guess:
            self.lo = max(self.lo, guess + 1)
            return Step(self._hinted(HIGHER), False, 0.0)
        self.hi = min(self.hi, guess - 1)
        return Step(self._hinted(LOWER), False, 0.0)

    def _said(self, word: str) -> str:
        """`word` as the observation of this form (a sentence in the chat form)."""
        if self.format == "byte":
            return word
        return CHAT_WORDS[word].format(n=self.n)

    def _hinted(self, word: str) -> str:
        """A mid-episode observation: the feedback, the remaining range with hint=range, and
        (chat form) the prompt for the next guess."""
        if self.format == "byte":
            return f"{word} {self.lo}-{self.hi}" if self.hint == "range" else word
        rng = CHAT_RANGE.format(lo=self.lo, hi=self.hi) if self.hint == "range" else ""
        return self._said(word) + rng + CHAT_NEXT

    def close(self) -> tuple[float, dict[str, Any]]:
        return (1.0 if self.success else self._shaped(),
                {"success": self.success, "target": self.target, "guesses_used": self.used,
                 "valid_guesses": self.valid, "consistent_guesses": self.consistent})

    def _shaped(self) -> float:
        paid = self.consistent if self.bonus == "consistent" else self.valid
        return self.format_bonus * paid / self.guesses
