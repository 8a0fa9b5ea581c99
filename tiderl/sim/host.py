"""A shared host: rollout and trainer work slowing each other down when they overlap. No JAX.

On a GPU cluster the rollout ranks and the trainer own separate devices. On one CPU machine
(the `cpu-fitted` profile) they do not: the engine's thread, the trainer's thread, the env
server and the controller share the same cores and one interpreter lock. Calibration measures
how much each side slows down while the other runs (`slowdown_rollout`, `slowdown_trainer`:
the ratio of an operation's time with the other side busy to its time alone), and the
simulator applies it:

- rollout work (an engine step, an env call's protocol overhead) has a fixed duration once
  started: its work times the rollout slowdown if a trainer phase is running then;
- trainer work progresses at 1 / `slowdown_trainer` of its rate while any rollout work is in
  flight and at full rate otherwise, re-evaluated whenever rollout work starts or ends.
"""

from __future__ import annotations

import asyncio
import heapq


class SharedHost:
    def __init__(self, *, slowdown_rollout: float = 1.0, slowdown_trainer: float = 1.0):
        self.s_rollout, self.s_trainer = max(1.0, slowdown_rollout), max(1.0, slowdown_trainer)
        self._ends: list[float] = []  # heap of rollout work end times
        self._trainer_jobs = 0
        self._changed: asyncio.Event | None = None
        self.overlap_s = 0.0
        """Trainer seconds spent slowed by rollout work."""

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _rollout_active(self, now: float) -> bool:
        while self._ends and self._ends[0] <= now:
            heapq.heappop(self._ends)
        return bool(self._ends)

    def rollout(self, work_s: float) -> float:
        """Registers rollout work starting now; returns its duration."""
        if work_s <= 0:
            return 0.0
        d = work_s * (self.s_rollout if self._trainer_jobs else 1.0)
        heapq.heappush(self._ends, self._now() + d)
        if self._changed is not None:
            self._changed.set()
        return d

    async def trainer(self, work_s: float) -> None:
        """Runs trainer work (seconds at full rate) to completion."""
        if work_s <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        self._trainer_jobs += 1
        try:
            left = work_s
            while left > 1e-9:
                now = self._now()
                busy = self._rollout_active(now)
                rate = 1.0 / self.s_trainer if busy else 1.0
                horizon = self._ends[0] - now if busy else float("inf")
                step = max(1e-6, min(left / rate, horizon))  # the loop's clock resolution
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=step)
                except TimeoutError:
                    pass
                dt = self._now() - now
                left -= dt * rate
                if busy:
                    self.overlap_s += dt
        finally:
            self._trainer_jobs -= 1
