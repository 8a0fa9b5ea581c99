"""What the rollout manager measures (`RolloutManager.stats`, `new_window`). No JAX.

Two readings of the ranks' engine time: the busy share each rank slot's engine shows the
scheduler (an exponential average over about `BUSY_TAU_S` of loop time, kept current at every
scheduling round), and the share of the window since `new_window()` (the controller starts one
per step) the engines worked, beside where the live tasks spent that window; plus the token,
decision and end-reason counters since the start. A mixin so `rollout.py` stays about episodes,
turns and ranks; it reads the manager's state (`ranks`, `sched`, `retired`, `window`,
`decisions`, `end_reasons`, `submitted`, `episodes`).
"""

from __future__ import annotations

import math
from typing import Any

BUSY_TAU_S = 2.0
"""Time constant of the engine busy share the scheduler sees (seconds of loop time)."""


class Measuring:
    """The engine busy share and the window and cumulative stats of `RolloutManager` (see the
    module docstring)."""

    ranks: list[Any]
    sched: Any
    retired: Any
    window: Any
    decisions: dict[str, int]
    end_reasons: dict[str, int]
    submitted: int
    episodes: dict[str, Any]
    _busy_at: float | None
    _busy_s: list[float]
    _busy_sum: list[float]
    _busy_wall: float
    _window: tuple[float, list[float], dict[str, float]] | None

    def _busy_now(self) -> list[float]:
        # Seconds each rank slot's engine has worked; an empty slot (ERS moved its cell) none.
        return [0.0 if r is None else r.stats.busy_s for r in self.ranks]

    def _track_busy(self) -> None:
        """Keeps the scheduler's per-rank engine busy share current (exponential average
        over about `BUSY_TAU_S` of loop time)."""
        now = self.sched.clock()
        last = self._busy_at
        self._busy_at = now
        if last is None or len(self.ranks) != len(self._busy_s):  # first round, or slots added
            busy = self._busy_now()
            self._busy_s = busy
            self._busy_sum = [0.0] * len(busy)
            self._busy_wall = 0.0
            return
        dt = now - last
        if dt <= 0:  # several rounds at one instant: nothing has elapsed
            return
        busy = self._busy_now()
        # Decaying sums of busy seconds and of elapsed seconds: busy time arrives in lumps
        # (one per engine call), so a per-event rate would be all or nothing.
        decay = math.exp(-dt / BUSY_TAU_S)
        wall = self._busy_wall = self._busy_wall * decay + dt
        sums, seen, share = self._busy_sum, self._busy_s, self.sched.engine_busy
        for i, b in enumerate(busy):
            x = sums[i] * decay  # >= 0, so adding nothing (+0.0) leaves it exactly as is
            if b > seen[i]:
                x += b - seen[i]
            sums[i], seen[i] = x, b
            v = x / wall
            share[i] = v if v < 1.0 else 1.0

    def new_window(self) -> None:
        """Starts the window that `stats()`'s engine_busy and tasks_* average over (the
        controller starts one per step)."""
        self.sched.phases.advance(self.sched.clock())
        self._window = (self.sched.clock(), self._busy_now(), self.sched.phases.integrals())

    def _window_stats(self) -> dict[str, float]:
        if self._window is None:
            self.new_window()
        t0, busy0, sec0 = self._window
        now = self.sched.clock()
        ph = self.sched.phases
        ph.advance(now)
        dt = now - t0
        now_busy = self._busy_now()
        live = [i for i in range(len(self.ranks))
                if i not in self.sched.dead and self.ranks[i] is not None] or [0]
        if dt <= 0 or not self.ranks:  # nothing elapsed yet: the current counts
            busy = 0.0
            avg = ph.current()
        else:
            busy = sum(min(1.0, max(0.0, now_busy[i] - (busy0[i] if i < len(busy0) else 0.0))
                               / dt) for i in live) / len(live)
            avg = {k: (v - sec0[k]) / dt for k, v in ph.integrals().items()}
        return {"engine_busy": busy, "tasks_executing": avg["executing"],
                "tasks_ready": avg["ready"], "tasks_waiting": avg["waiting"],
                "tasks_queued": avg["queued"], "window_s": max(dt, 0.0)}

    def stats(self) -> dict[str, Any]:
        """Token and decision counters since the start; `engine_busy` (the share of the window
        the ranks' engines worked, mean over live ranks) and `tasks_executing` /
        `tasks_ready` / `tasks_waiting` (mean live tasks inside a turn, waiting for one with
        their observation in hand, and waiting on their environment) and `tasks_queued` (mean
        tasks submitted and not admitted yet) over the window since `new_window()`;
        `engine_steps` and `engine_busy_s`: the ranks' device rounds and their seconds so far;
        `window_cuts`: contexts the sliding image window cut so far."""
        live = [r for r in self.ranks if r is not None]
        every = [r.stats for r in live] + [self.retired]
        prompt = sum(s.prompt_tokens for s in every)
        cached = sum(s.cached_tokens for s in every)
        return {
            **self._window_stats(),
            "tasks_paused": self.sched.n_paused(),
            "shared_tokens": sum(s.shared_tokens for s in every),
            "restored_tokens": sum(s.restored_tokens for s in every),
            "kv_hit_rate": cached / max(1, prompt),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": sum(s.computed_tokens for s in every),
            "decode_tokens": sum(s.decode_tokens for s in every),
            "engine_steps": sum(s.steps for s in every),
            "engine_busy_s": sum(s.busy_s for s in every),
            "forced_evictions": sum(s.forced_evictions for s in every),
            "window_cuts": self.window.cuts,
            "decisions": dict(self.decisions),
            "end_reasons": dict(self.end_reasons),
            "tasks_submitted": self.submitted,
            "tasks_ended": sum(self.end_reasons.values()),
            "tasks_live": len(self.episodes),
            "per_rank": [{**r.kv_stats(), "hit_rate": r.stats.kv_hit_rate} for r in live],
        }
