"""The virtual clock: a virtual-time event loop, plus the real CPU time the control plane spends.
No JAX.

Sleeps take no real time; the loop's time jumps to the next timer once nothing is ready
(`VirtualLoop`: looptime's clock — integer microsecond ticks, the same jump to the next timer —
without its per-iteration I/O poll and no-op cycles, which a simulator that runs nothing
outside the loop does not need; the schedule is the one looptime gives). The
host work of every callback (the controller, CTB, ranks, buffer — and the simulated backends'
own bookkeeping) is measured in real seconds per loop iteration; with `charge_cpu`, it is also
added to the virtual clock, so a control plane too slow for its cluster shows up as lost time.
With a `SharedHost` (one CPU machine), that work is one more stream on the shared host: it
takes longer while other work runs, and slows that work down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

TICKS_PER_S = 1_000_000
"""The clock's resolution: looptime's default (1 µs), so timer arithmetic matches it exactly."""


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is virtual: when nothing is ready, time jumps to the next timer.

    The clock is an integer count of microsecond ticks, advanced exactly as looptime advances
    it (`round(timeout * 1e6)` ticks, one tick for a positive timeout under a microsecond), so
    timers fire in the same order and at the same instants as on `looptime.new_event_loop`.
    looptime also polls for real I/O and spends no-op iterations before every jump (for
    threads and sockets the loop cannot see); the simulator has neither, so here a jump costs
    one iteration. Waiting with nothing scheduled is a deadlock and raises.
    """

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self.now_ticks = round(start * TICKS_PER_S)
        self._selector.select = self._jump  # type: ignore[method-assign]
        self._held = 0.0
        self._held_host: Any = None
        self.busy_s = 0.0
        """Seconds the clock advanced for work on the loop's own thread (held work and, with
        `charge_cpu`, the measured callbacks): the time it held the interpreter lock."""

    def hold(self, seconds: float, host: Any = None) -> None:
        """Modelled host work that runs on the loop's thread (the real job's env client and
        server, on its event loop): the clock advances by `seconds` when the current
        iteration's callbacks are done, so nothing else on the loop runs meanwhile. With a
        `SharedHost`, the iteration's held work is one piece of work on it."""
        self._held += max(0.0, seconds)
        self._held_host = host

    def _run_once(self) -> None:
        super()._run_once()  # type: ignore[misc]
        if self._held:
            d, h = self._held, self._held_host
            self._held = 0.0
            d = h.fixed(d) if h is not None else d
            self.busy_s += d
            self.now_ticks += round(d * TICKS_PER_S)

    def time(self) -> float:
        return self.now_ticks / TICKS_PER_S

    def _jump(self, timeout: float | None) -> list[Any]:
        if timeout == 0:
            return []
        if timeout is None:
            raise RuntimeError("simulated job deadlocked: no callback is ready and no timer is "
                               "scheduled (a coroutine awaits something nothing will set)")
        sched = self._scheduled  # type: ignore[attr-defined]
        if sched and sched[0]._when < self.time() + self._clock_resolution:
            return []  # due within the clock's resolution: runs this iteration, no jump
        step = round(timeout * TICKS_PER_S)
        if 0 < timeout < 1 / TICKS_PER_S:
            step += 1
        self.now_ticks += step
        return []


class CpuMeter:
    """Real seconds the loop spent running callbacks: wall seconds (`time.perf_counter`, the
    default), or with `clock=time.thread_time` the CPU seconds of the loop's thread, which do
    not grow when other processes share the machine's cores (`tiderl.sim.validate` compares
    against real runs with that host's sharing modelled separately)."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.cpu_s = 0.0
        self.iterations = 0
        self.clock = clock


def _patch(loop: Any, meter: CpuMeter, charge: bool, host: Any = None) -> None:
    run_once = loop._run_once
    tick = 1 / TICKS_PER_S
    clock = meter.clock

    def measured() -> None:
        t0 = clock()
        run_once()
        dt = clock() - t0
        meter.cpu_s += dt
        meter.iterations += 1
        if charge:
            if host is not None:
                dt = host.fixed(dt)
            loop.busy_s += int(dt / tick) * tick
            loop.now_ticks += int(dt / tick)

    loop._run_once = measured


def run_virtual(coro: Coroutine[Any, Any, T], *, charge_cpu: bool = False,
                meter: CpuMeter | None = None, host: Any = None, loop: Any = None) -> T:
    """Runs `coro` to completion on a fresh virtual-time loop (starting at t = 0): a
    `VirtualLoop`, or `loop` (e.g. looptime's, to compare schedules; `charge_cpu` needs a
    `VirtualLoop`)."""
    if loop is None:
        loop = VirtualLoop(start=0.0)
    elif charge_cpu:
        raise ValueError("run_virtual(charge_cpu=True) charges the CPU time to a VirtualLoop's "
                         "clock; leave `loop` unset")
    meter = meter if meter is not None else CpuMeter()
    _patch(loop, meter, charge_cpu, host)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        loop.close()
        asyncio.set_event_loop(None)
