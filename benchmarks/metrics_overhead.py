"""What the run's metrics cost: the embedded default job with the loggers off and on, side by
side in one process, interleaved (off/on, on/off, ...), medians over repeats.

- off: `controller.loggers=[jsonl]`, no console.
- on: `controller.loggers=[jsonl,tensorboard,wandb]` (W&B offline), the console (the progress
  line every second and the per-step line, logged to stderr), decoded eval samples.

Step time is the median wall-clock gap between consecutive step records (steps after the
first `--skip`, so compilation is out; evaluation rounds are in, and the median keeps them from
dominating). Besides the side-by-side ratio it times the metric code itself in both
contenders — the controller's step record and live snapshot, the sink's JSONL/Prometheus
write, the console, sample decoding, the learning-rate read, and the TensorBoard/W&B writes on
their own thread — and reports it per step. The last line is one JSON object.

    python benchmarks/metrics_overhead.py [--steps 40] [--repeats 3]

The machine is shared and noisy: read the side-by-side ratio with its spread (min/max over
repeats) next to the directly timed cost, which noise inflates only a little.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

CONTENDERS = {
    "off": ["controller.loggers=[jsonl]", "controller.console=false"],
    "on": ["controller.loggers=[jsonl,tensorboard,wandb]", "controller.console=true",
           "controller.progress_every_s=1"],
}
SPENT: collections.Counter[str] = collections.Counter()
"""Seconds inside the metric code, by where (reset per run)."""


def timed(cls, name: str, key: str) -> None:
    """Wraps `cls.name` to add its wall time to SPENT[key] (whichever thread runs it)."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            SPENT[key] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def instrument() -> None:
    import tiderl.train.backend as backend
    from tiderl.control.controller import Controller
    from tiderl.control.metrics import MetricsSink
    from tiderl.control.samples import SampleWriter
    from tiderl.control.sinks import TensorBoardSink, WandbSink

    # Event loop: the step record (trajectory stats included), the live snapshot, the sink.
    timed(Controller, "_log_step", "loop")
    timed(Controller, "progress", "loop")
    timed(MetricsSink, "progress", "loop")
    timed(MetricsSink, "log_samples", "loop")
    timed(SampleWriter, "write", "loop")
    # Trainer thread: the learning-rate read before each update.
    orig = backend.schedule_count

    def count(opt):
        t0 = time.perf_counter()
        try:
            return orig(opt)
        finally:
            SPENT["trainer"] += time.perf_counter() - t0

    backend.schedule_count = count
    # Sink thread: tensorboardX and W&B.
    for cls in (TensorBoardSink, WandbSink):
        timed(cls, "log", "sink_thread")
        timed(cls, "log_samples", "sink_thread")


async def one(name: str, steps: int, eval_every: int) -> dict:
    from tiderl.config import load_config
    from tiderl.control.metrics import read_metrics
    from tiderl.job import run_job

    SPENT.clear()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run_dir={tmp}/run", f"controller.steps={steps}",
                                 "controller.time_limit_s=0", "controller.checkpoint_every=0",
                                 f"controller.eval_every={eval_every}", *CONTENDERS[name]])
        t0 = time.perf_counter()
        summary = await run_job(cfg)
        wall = time.perf_counter() - t0
        recs = read_metrics(f"{tmp}/run")
    walls = [r["wall_s"] for r in recs if r["kind"] == "step"]
    return {"walls": walls, "spent": dict(SPENT), "run_s": wall, "steps": summary["steps"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
    p.add_argument("--eval-every", type=int, default=10)
    args = p.parse_args()
    from tiderl.logs import setup_logging

    setup_logging()  # the console contender really writes its lines (stderr)
    instrument()
    asyncio.run(one("on", args.skip + 2, 0))  # untimed warm-up: compile everything once
    rows: dict[str, list[dict]] = {k: [] for k in CONTENDERS}
    for rep in range(args.repeats):
        order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
        for name in order:
            r = asyncio.run(one(name, args.steps, args.eval_every))
            gaps = [b - a for a, b in zip(r["walls"][args.skip:], r["walls"][args.skip + 1:],
                                          strict=False)]
            n = len(r["walls"])
            r.update(step_s=statistics.median(gaps), step_s_mean=statistics.mean(gaps),
                     metric_ms_per_step={k: 1e3 * v / n for k, v in r["spent"].items()})
            rows[name].append(r)
            print(f"repeat {rep} {name:>3}: median step {r['step_s'] * 1e3:7.1f} ms (mean "
                  f"{r['step_s_mean'] * 1e3:7.1f}), metric code per step "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in
                              sorted(r["metric_ms_per_step"].items())), flush=True)
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in rows.items()}
    ratios = [on["step_s"] / off["step_s"] for on, off in zip(rows["on"], rows["off"],
                                                              strict=True)]
    code = {k: statistics.median(sum(r["metric_ms_per_step"].get(w, 0.0)
                                     for w in ("loop", "trainer")) for r in v)
            for k, v in rows.items()}
    sink = statistics.median(r["metric_ms_per_step"].get("sink_thread", 0.0)
                             for r in rows["on"])
    out = {
        "step_ms_off": med["off"] * 1e3, "step_ms_on": med["on"] * 1e3,
        "overhead_pct": (med["on"] / med["off"] - 1) * 100,
        "overhead_pct_per_repeat": [(x - 1) * 100 for x in ratios],
        "metric_code_ms_per_step_off": code["off"], "metric_code_ms_per_step_on": code["on"],
        "metric_code_pct_on": code["on"] / (med["on"] * 1e3) * 100,
        "sink_thread_ms_per_step": sink,
        "sink_thread_pct": sink / (med["on"] * 1e3) * 100,
        "steps": args.steps, "repeats": args.repeats,
    }
    print(f"loggers on vs off: {out['overhead_pct']:+.2f}% step time (per repeat "
          + ", ".join(f"{x:+.1f}%" for x in out["overhead_pct_per_repeat"])
          + f"); metric code {out['metric_code_pct_on']:.2f}% of a step on the event loop "
          f"and trainer, {out['sink_thread_pct']:.2f}% on the sink thread")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
