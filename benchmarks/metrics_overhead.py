"""What the run's metrics cost: the embedded default job with the loggers off and on, side by
side in one process, interleaved (off/on, on/off, ...), medians over repeats.

- off: `controller.loggers=[jsonl]`, no console.
- on: `controller.loggers=[jsonl,tensorboard,wandb]` (W&B offline), the console (the progress
  line every second and the per-step line, logged to stderr), decoded eval samples.

Step time, per contender, is the median gap between consecutive step records (steps after
the first `--skip`, so compilation is out; evaluation rounds are in, and the median keeps them
from dominating), in wall-clock seconds and in CPU seconds of the whole process (every thread:
XLA's, the event loop, the sink thread). On a shared machine the wall clock mostly measures
the neighbours; CPU time per step is what this process spent, so its ratio is the one to read.
W&B's own service process (wandb-core) is a child of this one: its CPU seconds over a run are
added to the process's, per step, when psutil is there to read them (it is stopped after each
run with the loggers on, so the other contender does not carry it).
Besides the side-by-side ratios it times the metric code itself in both contenders, in CPU
seconds of the thread running it — the controller's step record and live snapshot, the sink's
JSONL/Prometheus write and console line, sample decoding, the learning-rate read, and the
TensorBoard/W&B writes on their own thread — per step. The last line is one JSON object.

    python benchmarks/metrics_overhead.py [--steps 40] [--repeats 3]
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
import threading
import time
import warnings

warnings.filterwarnings("ignore")

CONTENDERS = {
    "off": ["controller.loggers=[jsonl]", "controller.console=false"],
    "on": ["controller.loggers=[jsonl,tensorboard,wandb]", "controller.console=true",
           "controller.progress_every_s=1"],
}
SPENT: collections.Counter[str] = collections.Counter()
"""CPU seconds inside the metric code, by where (reset per run)."""
CLOCKS: list[tuple[float, float]] = []
"""(wall, process CPU) seconds at each step record, as the sink receives it."""
_DEPTH = threading.local()


def timed(cls, name: str, key: str) -> None:
    """Wraps `cls.name` to add the CPU time of its thread to SPENT[key] (outermost call only:
    the timed functions call each other)."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(*a, **k):
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        t0 = time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            _DEPTH.n = depth
            if depth == 0:
                SPENT[key] += time.thread_time() - t0

    setattr(cls, name, wrapper)


def instrument() -> None:
    import tiderl.train.executor as executor
    from tiderl.control.controller import Controller
    from tiderl.control.metrics import MetricsSink
    from tiderl.control.samples import SampleWriter
    from tiderl.control.sinks import TensorBoardSink, WandbSink

    # Event loop: the step record (trajectory stats included), the live snapshot, the sink.
    log = MetricsSink.log

    def clocked(self, record):
        if record.get("kind") == "step":
            CLOCKS.append((time.perf_counter(), time.process_time()))
        return log(self, record)

    MetricsSink.log = clocked
    timed(Controller, "_log_step", "loop")
    timed(Controller, "progress", "loop")
    timed(MetricsSink, "progress", "loop")
    timed(MetricsSink, "log", "loop")
    timed(MetricsSink, "log_samples", "loop")
    timed(SampleWriter, "write", "loop")
    # Trainer thread: the learning-rate read before each update.
    orig = executor.schedule_count

    def count(opt):
        t0 = time.thread_time()
        try:
            return orig(opt)
        finally:
            SPENT["trainer"] += time.thread_time() - t0

    executor.schedule_count = count
    # Sink thread: tensorboardX and W&B.
    for cls in (TensorBoardSink, WandbSink):
        timed(cls, "log", "sink_thread")
        timed(cls, "log_samples", "sink_thread")


async def one(name: str, steps: int, eval_every: int) -> dict:
    from tiderl.config import load_config
    from tiderl.control.metrics import read_metrics
    from tiderl.runtime.job import run_job

    SPENT.clear()
    CLOCKS.clear()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run_dir={tmp}/run", f"controller.steps={steps}",
                                 "controller.time_limit_s=0", "controller.checkpoint_every=0",
                                 f"controller.eval_every={eval_every}", *CONTENDERS[name]])
        t0, c0 = time.perf_counter(), children_cpu()
        summary = await run_job(cfg)
        wall, children = time.perf_counter() - t0, children_cpu() - c0
        n = len([r for r in read_metrics(f"{tmp}/run") if r["kind"] == "step"])
        if "wandb" in cfg.controller.loggers:
            import wandb

            # Stop W&B's service process, so its CPU counts for this contender only.
            children = max(children, children_cpu() - c0)
            wandb.teardown()
    assert n == len(CLOCKS) == summary["steps"], (n, len(CLOCKS))
    return {"clocks": list(CLOCKS), "spent": dict(SPENT), "run_s": wall, "steps": n,
            "children_cpu_s": children}


def children_cpu() -> float:
    """CPU seconds of this process's live children (the W&B service), 0 without psutil."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
    p.add_argument("--eval-every", type=int, default=10)
    args = p.parse_args()
    from tiderl.control.logs import setup_logging

    setup_logging()  # the console contender really writes its lines (stderr)
    instrument()
    asyncio.run(one("on", args.skip + 2, 0))  # untimed warm-up: compile everything once
    rows: dict[str, list[dict]] = {k: [] for k in CONTENDERS}
    for rep in range(args.repeats):
        order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
        for name in order:
            r = asyncio.run(one(name, args.steps, args.eval_every))
            kept = r["clocks"][args.skip:]
            for i, clock in enumerate(("wall", "cpu")):
                gaps = [b[i] - a[i] for a, b in zip(kept, kept[1:], strict=False)]
                r[f"{clock}_ms"] = 1e3 * statistics.median(gaps)
            r["metric_ms"] = {k: 1e3 * v / r["steps"] for k, v in r["spent"].items()}
            r["metric_ms"]["wandb_service"] = 1e3 * r["children_cpu_s"] / r["steps"]
            r["cpu_ms"] += r["metric_ms"]["wandb_service"]
            rows[name].append(r)
            print(f"repeat {rep} {name:>3}: median step {r['wall_ms']:7.1f} ms wall, "
                  f"{r['cpu_ms']:7.1f} ms CPU; metric code per step (CPU) "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(r["metric_ms"].items())),
                  flush=True)
    out: dict = {"steps": args.steps, "repeats": args.repeats}
    for clock in ("wall", "cpu"):
        med = {k: statistics.median(r[f"{clock}_ms"] for r in v) for k, v in rows.items()}
        per = [(on[f"{clock}_ms"] / off[f"{clock}_ms"] - 1) * 100
               for on, off in zip(rows["on"], rows["off"], strict=True)]
        out.update({f"step_{clock}_ms_off": med["off"], f"step_{clock}_ms_on": med["on"],
                    f"overhead_{clock}_pct": (med["on"] / med["off"] - 1) * 100,
                    f"overhead_{clock}_pct_per_repeat": per})
    for name, v in rows.items():
        for where in ("loop", "trainer", "sink_thread", "wandb_service"):
            out[f"metric_code_{where}_ms_{name}"] = statistics.median(
                r["metric_ms"].get(where, 0.0) for r in v)
        code = sum(out[f"metric_code_{w}_ms_{name}"]
                   for w in ("loop", "trainer", "sink_thread", "wandb_service"))
        out[f"metric_code_pct_of_cpu_step_{name}"] = code / out["step_cpu_ms_" + name] * 100
    print(f"loggers on vs off: {out['overhead_cpu_pct']:+.2f}% CPU per step (per repeat "
          + ", ".join(f"{x:+.1f}%" for x in out["overhead_cpu_pct_per_repeat"])
          + f"), {out['overhead_wall_pct']:+.2f}% wall (per repeat "
          + ", ".join(f"{x:+.1f}%" for x in out["overhead_wall_pct_per_repeat"])
          + f"); the metric code itself: {out['metric_code_pct_of_cpu_step_on']:.2f}% of a "
          f"step's CPU with the loggers on, {out['metric_code_pct_of_cpu_step_off']:.2f}% off")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
