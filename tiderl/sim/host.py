"""A shared host: the work of every part that runs on one machine's CPUs, processor-shared.
No JAX.

On a GPU cluster the rollout ranks and the trainer own separate devices. On one CPU machine
(the `cpu-fitted` profile) they do not: the engine's worker thread, the trainer's worker
thread and the event loop (env client and server) share the same cores and one interpreter
lock. The host is modelled as processor sharing with `capacity` effective cores: while `n`
pieces of work are in flight, each progresses at `min(1, capacity / n)` of its full rate
(the rate calibration measured it at, alone). Calibration estimates `capacity` from how much
work slows down when other work runs beside it (`tiderl.sim.calibrate`).

- `fixed(work)`: work whose duration is fixed when it starts (an engine step: the rank sleeps
  that long), at the sharing in effect then;
- `await elastic(work)`: work that runs until done, its rate re-evaluated whenever other work
  starts or ends (a trainer phase).
"""

from __future__ import annotations

import asyncio
import heapq


class SharedHost:
    def __init__(self, *, capacity: float = 1.0):
        if capacity <= 0:
            raise ValueError(f"host capacity {capacity} must be positive (effective cores)")
        self.capacity = capacity
        self._ends: list[float] = []  # heap: end times of fixed work in flight
        self._elastic = 0
        self._changed: asyncio.Event | None = None
        self.shared_s = 0.0
        """Seconds of elastic work spent slowed by other work."""

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _in_flight(self, now: float) -> int:
        while self._ends and self._ends[0] <= now:
            heapq.heappop(self._ends)
        return len(self._ends) + self._elastic

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def fixed(self, work_s: float) -> float:
        """Registers work starting now; returns its duration."""
        if work_s <= 0:
            return 0.0
        now = self._now()
        n = self._in_flight(now) + 1
        d = work_s * max(1.0, n / self.capacity)
        heapq.heappush(self._ends, now + d)
        self._notify()
        return d

    async def elastic(self, work_s: float) -> None:
        """Runs work (seconds at full rate) to completion."""
        if work_s <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        self._elastic += 1
        self._notify()
        try:
            left = work_s
            while left > 1e-9:
                now = self._now()
                n = self._in_flight(now)
                rate = min(1.0, self.capacity / n)
                horizon = self._ends[0] - now if self._ends else float("inf")
                step = max(1e-6, min(left / rate, horizon))  # the loop's clock resolution
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=step)
                except TimeoutError:
                    pass
                dt = self._now() - now
                left -= dt * rate
                if rate < 1.0:
                    self.shared_s += dt
        finally:
            self._elastic -= 1
            self._notify()
