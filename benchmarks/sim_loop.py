"""The simulator's event loop: `tiderl.sim.clock.VirtualLoop` against looptime's loop.

Both run the same simulated job (`tiderl.sim.cluster.SimConfig`: 32 GPUs, Qwen2.5-7B, WebShop +
ALFWorld, `--mode`, `--steps` steps, no evaluation) in this process, one after the other,
rotated each repeat, the first round untimed (warm-up: imports, the workload fit's caches).
Timed: CPU seconds of the process (`time.process_time`; the machine may be shared, so wall time
is printed but not compared) and loop iterations. The step records of both must be identical
(same schedule, to the microsecond): the script fails otherwise.

    python benchmarks/sim_loop.py [--mode sync] [--steps 1] [--repeats 3]

Last stdout line: one JSON object (`cpu_ratio_looptime_over_virtual`, the medians, the
iteration counts, `same_records`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.sim import cluster  # noqa: E402
from tiderl.sim.clock import run_virtual  # noqa: E402


def looptime_virtual(coro, *, charge_cpu=False, meter=None, host=None):
    """`run_virtual` on looptime's loop, one no-op cycle per jump (the simulator's former
    setting; looptime's default of 42 costs ~40 idle iterations per jump). CPU time is
    measured, never charged (as the jobs here run)."""
    import looptime

    return run_virtual(coro, meter=meter, loop=looptime.new_event_loop(start=0.0, noop_cycles=1))


CONTENDERS = {"virtual": run_virtual, "looptime": looptime_virtual}


def one(name: str, cfg: cluster.SimConfig) -> tuple[float, float, int, list]:
    cluster.run_virtual = CONTENDERS[name]
    t0, c0 = time.perf_counter(), time.process_time()
    r = cluster.simulate_job(cfg)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    recs = [{k: v for k, v in x.items() if k not in ("real_s", "process_s")} for x in r.records]
    return cpu, wall, r.cpu.iterations, recs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="sync")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    cfg = cluster.SimConfig(mode=a.mode, model="qwen2.5-7b", gpus=32, steps=a.steps,
                            eval_every=0, rollout_ratio=0.25)
    names = list(CONTENDERS)
    for n in names:  # warm-up, untimed
        one(n, cfg)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    iters, records = {}, {}
    for rep in range(a.repeats):
        order = names[rep % 2:] + names[:rep % 2]
        for n in order:
            c, w, it, recs = one(n, cfg)
            cpu[n].append(c)
            iters[n], records[n] = it, recs
            print(f"repeat {rep} {n:9s} cpu {c:6.2f} s  wall {w:6.2f} s  iterations {it}",
                  flush=True)
    med = {n: statistics.median(v) for n, v in cpu.items()}
    same = records["virtual"] == records["looptime"]
    out = {"mode": a.mode, "steps": a.steps, "cpu_median_s": med,
           "cpu_ratio_looptime_over_virtual": med["looptime"] / med["virtual"],
           "iterations": iters, "same_records": same}
    print(json.dumps(out))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
