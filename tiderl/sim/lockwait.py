"""The engine's wait for the interpreter lock, measured in situ: the `host.lock_wait_s` of the
`cpu-fitted` profile (`tiderl.sim.host.SharedHost.device_call`).

On one CPU machine the real job is one process: the event loop's thread runs the controller,
CTB, the env client and the env server in Python, and the rank's worker thread takes the
interpreter lock back after every device operation of an engine step. While the loop is busy,
each of those takes waits; an engine step measured alone costs a fraction of what it costs in
the job (the `pressure` job on this 2-core machine: 2-3x). The model: at the loop's busy share
`u`, a step waits `lock_wait_s * u / (1 - u)` on top of its device time (a queue behind a
server busy `u` of the time).

`measure(cfgs)` runs each job for real, records every device call of the engine's prefill
(`Engine._run`: its inputs and its time in the job), the loop thread's CPU over the steps
(sampled from another thread: `u`), then replays the same calls alone on the same engine:
`lock_wait_s = mean(in job - alone) * (1 - u) / u`, pooled over the jobs. Calibration uses its
own seed, not the seeds `tiderl.sim.validate` compares.

JAX is imported inside the functions only (the package stays JAX-free).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def _recorded_calls() -> Iterator[list[tuple[Any, float, tuple]]]:
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


def _replay(eng: Any, inputs: tuple) -> float:
    from tiderl.serving.engine import Engine

    fn, rows, tokens_bt, start, n_new, b, temps, delta = inputs
    t0 = time.perf_counter()
    Engine._run(eng, fn, [_Row(*r) for r in rows], tokens_bt, start, n_new, b, temps=temps,
                delta=delta)
    return time.perf_counter() - t0


class _LoopCpu:
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

    def __enter__(self) -> _LoopCpu:
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


def measure_job(cfg: Any, *, max_replays: int = 400) -> dict[str, float]:
    """One real run of `cfg`: its engine calls in the job and alone, and the loop's busy
    share over its steps."""
    from tiderl.control.metrics import read_metrics
    from tiderl.runtime.job import run_job

    with _recorded_calls() as calls, _LoopCpu(threading.get_ident()) as cpu:
        asyncio.run(run_job(cfg))
    steps = [r for r in read_metrics(cfg.run_dir) if r.get("kind") == "step"]
    if not steps or not calls:
        raise RuntimeError(f"lock-wait calibration: the run in {cfg.run_dir} made no steps or "
                           "no engine calls; check the job's config")
    u = cpu.share(steps[-1]["wall_s"])
    sample = calls[:: max(1, len(calls) // max_replays)]
    alone = [_replay(eng, inputs) for eng, _, inputs in sample]
    in_job = [s for _, s, _ in sample]
    return {"u": u, "calls": len(calls), "replayed": len(sample),
            "in_job_ms": statistics.fmean(in_job) * 1e3, "alone_ms": statistics.fmean(alone) * 1e3,
            "extra_ms": statistics.fmean(a - b for a, b in zip(in_job, alone, strict=True)) * 1e3}


def measure(cfgs: Sequence[Any]) -> dict[str, Any]:
    """`lock_wait_s` pooled over real runs of `cfgs` (each after its kernels are compiled and
    an untimed warm-up run of the same config), with each run's figures."""
    import dataclasses

    from tiderl.runtime.job import run_job
    from tiderl.sim.validate import prime_compiles

    runs = []
    for cfg in cfgs:
        warm = dataclasses.replace(cfg, run_dir=cfg.run_dir + "-warm", controller=dataclasses
                                   .replace(cfg.controller, steps=2))
        prime_compiles(warm)
        asyncio.run(run_job(warm))
        runs.append(measure_job(cfg))
    per = [r["extra_ms"] * 1e-3 * (1 - min(r["u"], 0.95)) / max(min(r["u"], 0.95), 1e-3)
           for r in runs]
    return {"seconds": statistics.fmean(per), "runs": [{k: round(v, 4) if isinstance(v, float)
                                                         else v for k, v in r.items()}
                                                        for r in runs]}
