"""The trainer's device calls in the real job against the same calls replayed alone.

The simulator's `cpu-fitted` profile prices the trainer's Ref forward and Actor passes from
micro-benchmarks run alone (`python -m tiderl.sim.calibrate`). This script measures what the
same calls cost inside the job that `python -m tiderl.sim.validate` runs: the validation job
(`--job`) run for real in one mode (`--mode`, sync by default: its trainer phase runs with
the rollout idle, so nothing of the job runs beside it) at a seed the validator does not
compare, every Ref forward and Actor forward+backward timed as it runs (each blocked on its
result), then every recorded call replayed alone in the same process on the same backend
(median of `--repeats`), and priced by the profile's fit. Per run: the calls' mean time in
the job, alone and fitted, and the event loop thread's CPU while the calls ran (a busy loop
would take the interpreter lock from the trainer's thread). Runs after an untimed warm-up
run; the ratios are medians over `--runs`.

    python benchmarks/trainer_in_job.py [--job served] [--mode sync] [--runs 3] [--quick]

Blocking on each call's result changes the job's dispatch a little (the trainer then waits
for each call as `trainer.sync_timings` would). The last line is one JSON object
(`ref_in_job_over_alone`, `actor_in_job_over_alone`, `ref_in_job_over_fit`, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _lens(mb) -> list[int]:
    """Sequence lengths of a packed micro-batch (its segments' token counts)."""
    import numpy as np

    segs = np.asarray(mb.segment_ids_bt)
    return [int(n) for row in segs for n in np.bincount(row)[1:] if n]


class Recorder:
    """Times the backend's Ref forward and Actor passes (blocked on their results) and keeps
    what it takes to replay them; with the loop thread's CPU over each call."""

    def __init__(self) -> None:
        from tiderl.train.backend import TrainerBackend

        self.cls = TrainerBackend
        self.orig = (TrainerBackend.ref_forward, TrainerBackend.actor_forward,
                     TrainerBackend.actor_backward)
        self.ref: list[tuple] = []
        self.actor: list[tuple] = []
        self.loop_cpu = self.wall = 0.0
        self._fwd: dict[int, float] = {}
        self._main = time.pthread_getcpuclockid(threading.main_thread().ident)

    def __enter__(self) -> Recorder:
        import jax

        ref_f, act_f, act_b = self.orig
        rec = self

        def timed(fn):
            c0, t0 = time.clock_gettime(rec._main), time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            rec.loop_cpu += time.clock_gettime(rec._main) - c0
            rec.wall += dt
            return out, dt

        def ref_forward(self, batch):
            out, dt = timed(lambda: jax.block_until_ready(ref_f(self, batch)))
            rec.ref.append((self, batch, dt))
            return out

        def actor_forward(self, batch):
            out, dt = timed(lambda: jax.block_until_ready(act_f(self, batch)))
            rec._fwd[id(batch)] = dt
            return out

        def actor_backward(self, vjp, outs, ref, batch, mb):
            def run():
                m = act_b(self, vjp, outs, ref, batch, mb)
                jax.block_until_ready(self._grads)
                return m

            out, dt = timed(run)
            rec.actor.append((self, batch, ref, mb, rec._fwd.pop(id(batch), 0.0) + dt))
            return out

        self.cls.ref_forward, self.cls.actor_forward, self.cls.actor_backward = (
            ref_forward, actor_forward, actor_backward)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.ref_forward, self.cls.actor_forward, self.cls.actor_backward = self.orig

    def replay(self, repeats: int) -> tuple[list[float], list[float]]:
        """Every recorded call again, alone, on its backend: (Ref times, Actor times)."""
        import jax

        ref_f, act_f, act_b = self.orig

        def med(fn) -> float:
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        ref = [med(lambda be=be, b=b: jax.block_until_ready(ref_f(be, b)))
               for be, b, _ in self.ref]

        def actor(be, b, r, mb) -> None:
            outs, vjp = act_f(be, b)
            jax.block_until_ready(outs)
            act_b(be, vjp, outs, r, b, mb)
            jax.block_until_ready(be._grads)

        act = [med(lambda be=be, b=b, r=r, mb=mb: actor(be, b, r, mb))
               for be, b, r, mb, _ in self.actor]
        return ref, act


def one_run(cfg, served, costs, row_len: int, repeats: int) -> dict[str, float]:
    from tiderl.sim.validate import run_real

    with Recorder() as rec:
        out = run_real(cfg, served)
    ref_alone, act_alone = rec.replay(repeats)
    # Each batch has one Ref call and one Actor pass: the fits are over the same batches.
    ref_fit = [costs.ref_forward([_lens(mb)], row_len=row_len) for *_, mb, _ in rec.actor]
    act_fit = [costs.actor_forward([_lens(mb)], row_len=row_len)
               + costs.actor_backward([_lens(mb)], row_len=row_len)
               for _, _, _, mb, _ in rec.actor]
    mean = statistics.fmean
    ref_job = [dt for _, _, dt in rec.ref]
    act_job = [dt for *_, dt in rec.actor]
    return {"wall_s": out["summary"]["wall_s"], "ref_calls": len(ref_job),
            "actor_calls": len(act_job),
            "ref_in_job_ms": mean(ref_job) * 1e3, "ref_alone_ms": mean(ref_alone) * 1e3,
            "ref_fit_ms": mean(ref_fit) * 1e3,
            "actor_in_job_ms": mean(act_job) * 1e3, "actor_alone_ms": mean(act_alone) * 1e3,
            "actor_fit_ms": mean(act_fit) * 1e3,
            "loop_cpu_share": rec.loop_cpu / rec.wall if rec.wall else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="served", help="the validation job (tiderl.sim.validate)")
    p.add_argument("--mode", default="sync", choices=("sync", "async", "stream", "tiderl"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=1000, help="not a seed the validator compares")
    p.add_argument("--repeats", type=int, default=3, help="replays of each call (median)")
    p.add_argument("--profile", default="cpu-fitted")
    p.add_argument("--quick", action="store_true", help="one run of 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.steps = 1, 3
    logging.disable(logging.WARNING)

    from tiderl.runtime.parts import trainer_config_for_mode
    from tiderl.sim.costs import SimCostModel, model_shape
    from tiderl.sim.device_profile import load_profile
    from tiderl.sim.validate import prime_compiles, run_config, run_real, server_overrides

    costs = SimCostModel(load_profile(args.profile), model_shape("tiny"))
    served = server_overrides(args.seed, args.job)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        warm = run_config(args.mode, 2, args.seed, f"{tmp}/warm", args.job)
        prime_compiles(warm)
        run_real(warm, served)  # untimed
        for i in range(args.runs):
            cfg = run_config(args.mode, args.steps, args.seed, f"{tmp}/run{i}", args.job)
            r = one_run(cfg, served, costs, trainer_config_for_mode(cfg).row_len,
                        args.repeats)
            runs.append(r)
            print(f"run {i}: Ref {r['ref_calls']} calls, {r['ref_in_job_ms']:.2f} ms in the "
                  f"job, {r['ref_alone_ms']:.2f} alone, {r['ref_fit_ms']:.2f} fitted | Actor "
                  f"{r['actor_calls']} calls, {r['actor_in_job_ms']:.2f} in the job, "
                  f"{r['actor_alone_ms']:.2f} alone, {r['actor_fit_ms']:.2f} fitted | loop "
                  f"thread CPU {r['loop_cpu_share']:.1%} of the calls' time", flush=True)
    med = statistics.median
    figures = {
        "job": args.job, "mode": args.mode, "runs": len(runs), "steps": args.steps,
        "seed": args.seed, "profile": args.profile,
        "ref_in_job_over_alone": med(r["ref_in_job_ms"] / r["ref_alone_ms"] for r in runs),
        "actor_in_job_over_alone": med(r["actor_in_job_ms"] / r["actor_alone_ms"]
                                       for r in runs),
        "ref_in_job_over_fit": med(r["ref_in_job_ms"] / r["ref_fit_ms"] for r in runs),
        "actor_in_job_over_fit": med(r["actor_in_job_ms"] / r["actor_fit_ms"] for r in runs),
        "ref_alone_over_fit": med(r["ref_alone_ms"] / r["ref_fit_ms"] for r in runs),
        "actor_alone_over_fit": med(r["actor_alone_ms"] / r["actor_fit_ms"] for r in runs),
        "loop_cpu_share": med(r["loop_cpu_share"] for r in runs),
    }
    print(f"in the job over alone: Ref {figures['ref_in_job_over_alone']:.3f}, Actor "
          f"{figures['actor_in_job_over_alone']:.3f}; over the fit: Ref "
          f"{figures['ref_in_job_over_fit']:.3f}, Actor {figures['actor_in_job_over_fit']:.3f}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
