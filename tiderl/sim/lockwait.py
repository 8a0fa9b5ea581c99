"""The engine's wait for the interpreter lock, measured in situ: the `host.lock_wait_s` of the
`cpu-fitted` profile (`tiderl.sim.host.SharedHost.device_call`).

On one CPU machine the real job is one process: the event loop's thread runs the controller,
CTB, the env client and the env server in Python, and the rank's worker thread takes the
interpreter lock back after every device operation of an engine step. While the loop is busy,
each of those takes waits; an engine step measured alone costs a fraction of what it costs in
the job (the `pressure` job on this 2-core machine: 2-3x). The model: at the loop's busy share
`u`, a step waits `lock_wait_s * u / (1 - u)` on top of its device time (a queue behind a
server busy `u` of the time).

`python -m tiderl.sim.validate --measure-lock-wait` (the real job runs only through the
validator, an entry point) runs the validated job (`--job`; the `pressure` job when that is
the default one) for real in every mode at seed 1000 (not a seed it compares), recording
every device call of the engine's prefill (`recorded_calls`:
`Engine._run`'s inputs and its time in the job) and the loop thread's CPU over the steps
(`LoopCpu`, sampled from another thread: `u`), then replays the same calls alone on the same
engine (`in_job_calls`): `lock_wait_s = mean(in job - alone) * (1 - u) / u`, pooled over the
runs (`lock_wait_s`).

JAX is imported inside the functions only (the package stays JAX-free).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def recorded_calls() -> Iterator[list[tuple[Any, float, tuple]]]:
    """Every prefill device call of every `Engine` while open: (engine, seconds, inputs)."""
    from tiderl.serving.engine import Engine

    calls: list[tuple[Any, float, tuple]] = []
    run = Engine._run

    def timed(self, fn, rows, tokens_bt, start, n_new, b, temps=None, delta=None, image=None):
        t0 = time.perf_counter()
        out = run(self, fn, rows, tokens_bt, start, n_new, b, temps=temps, delta=delta,
                  image=image)
        seconds = time.perf_counter() - t0
        if image is None:  # text rows: replayable from host data
            calls.append((self, seconds, (fn, [(h.slot, h.task_id, h.temperature) for h in rows],
                                          tokens_bt.copy(), list(start), list(n_new), b,
                                          temps, delta)))
        return out

    Engine._run = timed
    try:
        yield calls
    finally:
        Engine._run = run


class _Row:
    """A replayed row: what `Engine._run` reads of a task's handle."""

    def __init__(self, slot: int | None, task_id: int, temperature: float) -> None:
        self.slot, self.task_id, self.temperature = slot or 0, task_id, temperature


def replay(eng: Any, inputs: tuple) -> float:
    from tiderl.serving.engine import Engine

    fn, rows, tokens_bt, start, n_new, b, temps, delta = inputs
    t0 = time.perf_counter()
    Engine._run(eng, fn, [_Row(*r) for r in rows], tokens_bt, start, n_new, b, temps=temps,
                delta=delta)
    return time.perf_counter() - t0


class LoopCpu:
    """Samples the CPU seconds of one thread (the event loop's) from another thread."""

    def __init__(self, ident: int, every_s: float = 0.05) -> None:
        self.clock = time.pthread_getcpuclockid(ident)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), time.clock_gettime(self.clock)))
            self._stop.wait(every_s)

    def __enter__(self) -> LoopCpu:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()
        self.samples.append((time.perf_counter(), time.clock_gettime(self.clock)))

    def share(self, last_s: float) -> float:
        """The thread's CPU share over the last `last_s` seconds sampled."""
        end_t, end_c = self.samples[-1]
        t0, c0 = min(self.samples, key=lambda s: abs(s[0] - (end_t - last_s)))
        return (end_c - c0) / (end_t - t0) if end_t > t0 else 0.0


def lock_wait_s(runs: Sequence[dict[str, float]]) -> float:
    """`lock_wait_s` pooled over runs of `in_job_calls`' figures: each run's mean extra per
    call times `(1 - u) / u` (u capped at 0.95, as the model caps it), averaged."""
    per = [r["extra_ms"] * 1e-3 * (1 - min(r["u"], 0.95)) / max(min(r["u"], 0.95), 1e-3)
           for r in runs]
    return statistics.fmean(per)


def in_job_calls(calls: Sequence[tuple[Any, float, tuple]], u: float, *,
                 max_replays: int = 400) -> dict[str, float]:
    """One run's figures: its recorded engine calls (`recorded_calls`) replayed alone on
    the same engine against their time in the job, and the loop's busy share `u`."""
    if not calls:
        raise RuntimeError("lock-wait measurement: the run made no engine calls")
    sample = calls[:: max(1, len(calls) // max_replays)]
    alone = [replay(eng, inputs) for eng, _, inputs in sample]
    in_job = [s for _, s, _ in sample]
    return {"u": u, "calls": len(calls), "replayed": len(sample),
            "in_job_ms": statistics.fmean(in_job) * 1e3, "alone_ms": statistics.fmean(alone) * 1e3,
            "extra_ms": statistics.fmean(a - b for a, b in zip(in_job, alone, strict=True)) * 1e3}
