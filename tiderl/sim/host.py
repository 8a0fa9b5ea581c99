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
  starts or ends (a trainer phase);
- `beside(work)`: another process's work (a served environment's), on a core of its own: it
  counts as work in flight for the others and is not slowed itself;
- `await device_call(seconds)`: a worker thread's device call (an engine step, a weight sync),
  plus its wait for the interpreter lock behind the event loop's thread (`lock_wait`, when
  `lock_wait_s` is set: `tiderl.sim.lockwait`); a trainer phase is `elastic` work followed by
  `lock_wait`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq

LOCK_WINDOW_S = 0.1
"""The window over which the loop's busy share is measured for lock waits."""
END_SLACK_S = 1e-6
"""The virtual loop's clock resolution (`tiderl.sim.clock.TICKS_PER_S`)."""


class SharedHost:
    def __init__(self, *, capacity: float = 1.0, lock_wait_s: float = 0.0):
        if capacity <= 0:
            raise ValueError(f"host capacity {capacity} must be positive (effective cores)")
        self.capacity = capacity
        self.lock_wait_s = lock_wait_s
        """A worker thread's device call's wait for the interpreter lock per unit of
        `u / (1 - u)`, `u` the event loop's busy share (`lock_wait`); 0: not modelled."""
        self._busy_marks: collections.deque[tuple[float, float]] = collections.deque()
        self.lock_waited_s = 0.0
        """Seconds device calls (engine steps, trainer phases, weight syncs) spent waiting for
        the interpreter lock."""
        self._ends: list[float] = []  # heap: end times of fixed work in flight
        self._elastic = 0
        self._changed: asyncio.Event | None = None
        self.shared_s = 0.0
        """Seconds of elastic work spent slowed by other work."""

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _in_flight(self, now: float) -> int:
        # Work that ends within the clock's resolution of now has ended: a sleep of its
        # duration wakes on a whole tick, which can fall a rounding short of its end.
        while self._ends and self._ends[0] <= now + END_SLACK_S:
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

    def beside(self, work_s: float) -> None:
        """Registers work starting now that runs on a core of its own (another process on the
        machine, e.g. a served environment): the host's other work shares the machine with it
        while it runs, and it is not slowed itself (its duration is the caller's)."""
        if work_s <= 0:
            return
        heapq.heappush(self._ends, self._now() + work_s)
        self._notify()

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

    async def device_call(self, seconds: float) -> float:
        """A worker thread's device call of `seconds` (an engine step), then its wait for the
        interpreter lock (`lock_wait`); returns the seconds of that wait."""
        self.mark()
        await asyncio.sleep(seconds)
        return await self.lock_wait()

    def mark(self) -> None:
        """Notes the event loop's busy time now (a device call starts or ends): the record
        `lock_wait` measures the loop's busy share over."""
        loop = asyncio.get_running_loop()
        busy = getattr(loop, "busy_s", None)
        if not self.lock_wait_s or busy is None:
            return
        now, marks = loop.time(), self._busy_marks
        marks.append((now, busy))
        while len(marks) > 2 and marks[1][0] <= now - LOCK_WINDOW_S:
            marks.popleft()

    async def lock_wait(self) -> float:
        """A worker thread's wait for the interpreter lock after a device call, when
        `lock_wait_s` is set: the worker takes the lock back after each device operation,
        the event loop's thread holds it while it runs Python (its held and charged work,
        `VirtualLoop.busy_s`), so at the loop's busy share `u` since the device calls' marks
        of the last `LOCK_WINDOW_S` the call waits `lock_wait_s * u / (1 - u)` (a queue
        behind a server busy `u` of the time; `u` capped at 0.95)."""
        self.mark()
        marks = self._busy_marks
        if len(marks) < 2:
            return 0.0
        (t0, b0), (now, busy) = marks[0], marks[-1]
        u = min(0.95, (busy - b0) / (now - t0)) if now > t0 else 0.0
        if wait := self.lock_wait_s * u / (1.0 - u):
            self.lock_waited_s += wait
            await asyncio.sleep(wait)
        return wait
