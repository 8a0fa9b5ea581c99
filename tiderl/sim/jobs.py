"""Simulated jobs for the experiments, many at a time, and how the experiments report them.
No JAX.

`run_all` simulates a set of `SimConfig`s (in worker processes when asked; a run may wait for
others' results) and keeps what an experiment reads of each (`Result`: its summary, step
records and counters, with `breakdown`, where its time went). The rest is what
`tiderl.sim.experiments` prints and writes with: tables (`table`, `breakdown_table`), the
latency-staleness bound of fig8 (`latency_bound`), step records as JSONL (`save_steps`) and
matplotlib without a display (`pyplot`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiderl.sim.cluster import SimConfig, simulate_job


def say(*a: Any) -> None:
    print(*a, flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3g}"
    return str(v)


def table(rows: Sequence[Sequence[Any]], head: Sequence[str]) -> None:
    cells = [list(map(str, head))] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for k, r in enumerate(cells):
        say("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                      enumerate(zip(r, widths, strict=True))))
        if k == 0:
            say("  ".join("-" * w for w in widths))


@dataclasses.dataclass
class Result:
    """What an experiment keeps of one simulated job (picklable: runs may be in workers)."""

    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    stats: dict[str, Any]
    real_s: float
    process_s: float


def _simulate(cfg: SimConfig) -> Result:
    r = simulate_job(cfg)
    ranks = r.ranks
    stats = {"recomputed_evicted": sum(x.stats.recomputed_evicted for x in ranks),
             "forced_evictions": sum(x.stats.forced_evictions for x in ranks),
             "decisions": dict(r.controller.manager.decisions),
             "role_changes": r.trainer.role_changes, "breakdown": breakdown(r.records)}
    return Result(r.summary, r.steps, stats, r.real_s, r.process_s)


BREAKDOWN = ("wall_s", "rwt_s", "twt_s", "swap_s", "switch_s", "sync_s", "role_change_s",
             "eval_s")


def breakdown(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Where a run's time went, in seconds summed over its steps: the virtual wall clock,
    rollout throttled (RWT), trainer waiting for data (TWT), Ref/Actor swaps (`time_swap`,
    which includes the hybrid engine's switches), those switches alone, weight syncs, role
    changes, and evaluations in flight (they overlap training: not a share of the wall)."""
    steps = [r for r in records if r.get("kind") == "step"]
    out = dict.fromkeys(BREAKDOWN, 0.0)
    for r in steps:
        out["rwt_s"] += r.get("rwt_s", 0.0)
        out["twt_s"] += r.get("twt_s", 0.0)
        out["swap_s"] += r.get("time_swap", 0.0)
        out["switch_s"] += r.get("time_switch", 0.0)
        out["sync_s"] += r.get("sync_s", 0.0) or 0.0
        out["role_change_s"] += r.get("role_change_s", 0.0) or 0.0
    out["wall_s"] = steps[-1].get("wall_s", 0.0) if steps else 0.0
    out["eval_s"] = sum(r.get("eval_time_s", 0.0) for r in records if r.get("kind") == "eval")
    return out


def latency_bound(sync: Result, max_staleness: int) -> dict[str, float]:
    """The goodput no asynchronous mode can pass when generation is latency-bound: the sync
    run's rollout phase starts a step's groups together and ends with its slowest one, so its
    mean is the batch's tail latency L (its engines' busy share says whether the devices or
    the tasks' own latency set it). The staleness bound lets groups start at most
    1 + max_staleness steps before the step that trains them, so a step lasts at least
    L / (1 + max_staleness), and goodput is at most a step's tokens over that."""
    steps = sync.steps[1:] or sync.steps  # the first step also starts the engines
    lat = statistics.mean(r["t_rollout_end"] - r["t_rollout_start"] for r in steps)
    tokens = statistics.mean(r["action_tokens"] for r in steps)
    t_min = lat / (1 + max_staleness)
    return {"batch_latency_s": lat, "engine_busy": statistics.mean(
        r["engine_busy"] for r in steps), "step_floor_s": t_min,
            "goodput_ceiling": tokens / t_min if t_min > 0 else math.nan}


def breakdown_table(runs: dict[str, Result]) -> None:
    """One row per run: goodput, where its time went (`breakdown`), and what KV pressure
    cost its rollout (hit rate, evicted tokens computed again, forced evictions)."""
    rows = [(label, r.summary.get("goodput", math.nan),
             *(r.stats.get("breakdown", {}).get(k, math.nan) for k in BREAKDOWN),
             r.summary.get("rollout", {}).get("kv_hit_rate", math.nan),
             r.stats.get("recomputed_evicted", math.nan),
             r.stats.get("forced_evictions", math.nan))
            for label, r in runs.items()]
    table(rows, ("run", "goodput tok/s", "wall s", "RWT s", "TWT s", "swaps s",
                 "switches s", "syncs s", "role chg s", "eval in flight s", "KV hit rate",
                 "recomputed tok", "evictions"))


def run_all(cfgs: dict[str, SimConfig], jobs: int = 1,
            follow: Callable[[dict[str, Result]], dict[str, SimConfig]] | None = None
            ) -> dict[str, Result]:
    """Simulates every config (in `jobs` worker processes when > 1); returns them in the order
    given. `follow(finished)` is called as runs finish and may return more configs (a run
    that depends on others' results): they start before the configs not yet started."""
    out: dict[str, Result] = {}
    todo = list(cfgs.items())
    extra: dict[str, SimConfig] = {}

    def more() -> None:
        new = follow(out) if follow is not None else {}
        new = {k: v for k, v in new.items() if k not in extra and k not in cfgs}
        extra.update(new)
        todo[:0] = list(new.items())

    if jobs <= 1 or len(cfgs) <= 1 and follow is None:
        while todo:
            label, cfg = todo.pop(0)
            out[label] = _simulate(cfg)
            _report(label, out[label])
            more()
    else:
        import concurrent.futures as cf

        with cf.ProcessPoolExecutor(min(jobs, max(2, len(cfgs)))) as pool:
            running: dict[cf.Future[Result], str] = {}
            while todo or running:
                while todo and len(running) < jobs:
                    label, cfg = todo.pop(0)
                    running[pool.submit(_simulate, cfg)] = label
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for f in done:
                    label = running.pop(f)
                    out[label] = f.result()
                    _report(label, out[label])
                more()
    order = [*cfgs, *extra]
    return {k: out[k] for k in order}


def _report(label: str, r: Result) -> None:
    s = r.summary
    say(f"  {label:28s} goodput {s.get('goodput', math.nan):9.1f} tok/s  "
        f"steps {s.get('steps', 0):3d}  virtual {s.get('wall_s', 0):8.0f} s  "
        f"RWT {s.get('rwt_s', 0):7.0f} s  TWT {s.get('twt_s', 0):7.0f} s  "
        f"real {r.real_s:5.0f} s (cpu {r.process_s:5.0f} s)")


def save_steps(out: Path, name: str, runs: dict[str, Result]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{name}.jsonl").open("w") as f:
        for label, run in runs.items():
            for r in run.steps:
                f.write(json.dumps({"run": label, **r}, default=str) + "\n")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
