"""Starvation: groups keep ending but none becomes trainable, or none ends at all. No JAX.

An untrained policy on a hard task scores alike on every sibling (zero reward variance: GRPO
has no signal), or its env fails every task; the trainer then waits for data forever. A policy
that has learned its tasks does the same from the other end (every sibling solves them): the
warning then says so instead of blaming the policy. The
controller reports each finished group here and asks `check` whenever it wakes while waiting:

- groups dropped in a row ≥ `controller.warn_dropped_in_a_row`: a warning saying what the drops
  mean and what to try, again each time the count doubles (the doubling survives short
  recoveries and starts over after ten minutes without a warning);
- seconds the trainer waited with no group becoming trainable ≥ `controller.warn_starved_s`:
  the same, for a slow or stuck env (no group ends at all), again each time that doubles;
- ≥ `controller.max_dropped_in_a_row` / `controller.max_starved_s`: `Starved` is raised; the
  controller stops the run with a checkpoint (DAPO bounds its generation batches the same way).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("tiderl.control.controller")

SOLVED = 1.0
"""The reward of a solved task (what the built-in suites pay a success)."""


class Starved(Exception):
    """A starvation hard limit passed while the trainer waited for data (one-line reason)."""


class Starvation:
    def __init__(self, cfg: Any, *, advice: str = ""):
        self.cfg = cfg
        """The ControllerConfig (its warn_/max_ dropped-in-a-row and starved_s keys)."""
        self.advice = advice
        """Run-specific things to try (`tiderl.control.progress.starvation_advice`)."""
        self.last_trainable = 0.0
        self.wait_t0 = 0.0
        self.row_rewards: set[float] = set()
        """Mean rewards of the groups dropped in a row (a few: 0.00 says "too hard")."""
        self.row_solved = 0
        self.row_dropped = 0
        """Of the groups dropped in a row: how many, and how many every sibling solved
        (reward ≥ SOLVED: the policy has learned those tasks, it is not failing them)."""
        self._warn_at = 0
        self._warned_t = -math.inf
        self._warn_s_at = 0.0
        self._ends: dict[str, int] = {}

    # -- what happened --------------------------------------------------------------------
    def group_ended(self, trajs: Any, trainable: bool, now: float) -> None:
        if trainable:
            self.last_trainable = now
            self.row_rewards.clear()
            self.row_solved = self.row_dropped = 0
            return
        ok = [t.reward for t in trajs if t.ok]
        self.row_dropped += 1
        self.row_solved += bool(ok) and min(ok) >= SOLVED
        if len(self.row_rewards) < 4 and ok:
            self.row_rewards.add(round(sum(ok) / len(ok), 2))

    def begin_wait(self, now: float) -> None:
        """The trainer (or sync mode's rollout) starts waiting for groups."""
        self.wait_t0 = now

    def waited(self, now: float) -> float:
        """Seconds the trainer has waited with no group becoming trainable."""
        return now - max(self.wait_t0, self.last_trainable)

    def wake_in(self, now: float) -> float | None:
        """Seconds until the next wall-clock threshold (warning or stop), None if there is none."""
        c = self.cfg
        marks = [m for m in (c.max_starved_s, max(c.warn_starved_s, self._warn_s_at)) if m > 0]
        if not marks:
            return None
        return max(0.0, min(marks) - self.waited(now)) + 1e-3

    # -- what to say ----------------------------------------------------------------------
    def check(self, *, now: float, step: int, in_a_row: int, dropped: Mapping[str, int],
              in_flight: int, episodes: int, before_warning: Callable[[], None],
              end_reasons: Mapping[str, int] | None = None) -> None:
        """Warns or raises `Starved` per the module docstring; `before_warning` runs first
        (the controller logs the progress line the warning is about). `end_reasons` (episodes
        so far by how they ended) points at limits that cut every episode short."""
        c = self.cfg
        waited = self.waited(now)
        self._ends = dict(end_reasons or {})
        if c.max_dropped_in_a_row and in_a_row >= c.max_dropped_in_a_row:
            raise Starved(
                f"{in_a_row} groups in a row could not be trained (controller."
                f"max_dropped_in_a_row={c.max_dropped_in_a_row}; {self._words(dropped)})."
                f"{self._try()}")
        if c.max_starved_s and waited >= c.max_starved_s:
            raise Starved(
                f"no group became trainable in {waited:.0f}s (controller.max_starved_s="
                f"{c.max_starved_s:g}; {self._words(dropped)}; {in_flight} groups still in "
                f"flight).{self._try()}")
        if now - self._warned_t >= 600:
            self._warn_at = 0
        if c.warn_dropped_in_a_row and in_a_row >= max(c.warn_dropped_in_a_row, self._warn_at):
            self._warn_at = 2 * in_a_row
            self._warned_t = now
            before_warning()
            log.warning(
                "step %d: the last %d groups to end could not be trained (%s). zero_variance: "
                "every reward in the group was equal, so GRPO has no signal; give the task a "
                "graded reward (e.g. env.options=[format_bonus=0.1] for the default task) or "
                "set trainer.zero_var_groups=keep. failed_tasks: fewer than "
                "controller.min_ok_per_group tasks ended ok; see the env server's log.%s "
                "controller.max_dropped_in_a_row stops the run after that many (now %s); "
                "controller.time_limit_s bounds the wait.",
                step, in_a_row, self._words(dropped), self._try(),
                c.max_dropped_in_a_row or "no limit")
        if waited < c.warn_starved_s:
            self._warn_s_at = 0.0
        if c.warn_starved_s and waited >= max(c.warn_starved_s, self._warn_s_at):
            self._warn_s_at = 2 * waited
            before_warning()
            log.warning(
                "step %d: the trainer has waited %.0fs and no group became trainable (%s; %d "
                "groups in flight, %d episodes running). If none end, the env is slow or stuck "
                "(see the env latency on the progress line); if they end dropped, see the "
                "dropped reasons.%s controller.max_starved_s stops the run after that long "
                "(now %s).", step, waited, self._words(dropped), in_flight, episodes,
                self._try(), f"{c.max_starved_s:g}s" if c.max_starved_s else "no limit")

    def _words(self, dropped: Mapping[str, int]) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(dropped.items()) if v)
        out = f"dropped so far: {counts or 'none'}"
        if self.row_rewards:
            scores = ", ".join(f"{r:.2f}" for r in sorted(self.row_rewards))
            out += f"; mean reward of the groups dropped in a row: {scores}"
        return out

    def _try(self) -> str:
        tips = []
        ends = self._ends
        total = sum(ends.values())
        if total and ends.get("context_limit", 0) > total / 2:
            tips.append(f"{ends['context_limit']} of {total} episodes ended at the context "
                        "limit: raise rollout.max_context (with trainer.row_len and "
                        "model.max_seq_len)")
        elif total and ends.get("turn_limit", 0) > total / 2:
            tips.append(f"{ends['turn_limit']} of {total} episodes ran out of turns: raise "
                        "env.max_turns")
        if self.row_solved:
            tips.append(f"{self.row_solved} of the {self.row_dropped} groups dropped in a row "
                        "were solved by every sibling: the policy has learned those tasks, so "
                        "harder ones (env.options) give GRPO signal again, or the run can stop")
        if self.advice and self.row_solved < self.row_dropped:
            tips.append(self.advice)
        return f" Try: {'; '.join(tips)}." if tips else ""
