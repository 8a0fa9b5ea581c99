"""The virtual clock: a looptime event loop, plus the real CPU time the control plane spends.
No JAX.

Sleeps take no real time; the loop's time jumps to the next timer once nothing is ready. The
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

import looptime

T = TypeVar("T")


class CpuMeter:
    """Real seconds the loop spent running callbacks."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.iterations = 0


def _patch(loop: Any, meter: CpuMeter, charge: bool, host: Any = None) -> None:
    run_once = loop._run_once
    # looptime keeps its clock as integer ticks in a name-mangled attribute.
    attr = "_LoopTimeEventLoop__now"
    tick = 1e-6  # looptime's default resolution

    def measured() -> None:
        t0 = time.perf_counter()
        run_once()
        dt = time.perf_counter() - t0
        meter.cpu_s += dt
        meter.iterations += 1
        if charge and hasattr(loop, attr):
            if host is not None:
                dt = host.fixed(dt)
            setattr(loop, attr, getattr(loop, attr) + int(dt / tick))

    loop._run_once = measured


def run_virtual(coro: Coroutine[Any, Any, T], *, charge_cpu: bool = False,
                meter: CpuMeter | None = None, host: Any = None) -> T:
    """Runs `coro` to completion on a fresh virtual-time loop (starting at t = 0)."""
    # One no-op cycle before each jump suffices: the simulator runs nothing outside the loop
    # (no threads, no sockets), and looptime's default 42 cost ~40 idle iterations per jump.
    loop = looptime.new_event_loop(start=0.0, noop_cycles=1)
    meter = meter if meter is not None else CpuMeter()
    _patch(loop, meter, charge_cpu, host)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        loop.close()
        asyncio.set_event_loop(None)
