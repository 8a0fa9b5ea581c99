"""How much this machine's speed drifts: one fixed device call timed again and again.

`python -m tiderl.sim.calibrate` prices each operation from a few minutes of
micro-benchmarks, and `python -m tiderl.sim.validate` compares the simulator against real
runs made over another stretch of time. On a shared VM the same computation does not always
take the same time: this script builds the validation job's trainer (the embedded default
model and the calibration's settings) once, then every `--every` seconds for `--minutes`
times `--calls` Ref forwards of one fixed micro-batch (`tiderl.sim.speed.SpeedProbe`: 16 rows
of 128 tokens, the validation job's usual shape) and keeps their median. It prints the series
and its spread; the last line is one JSON object (`min_ms`, `median_ms`, `max_ms`,
`spread`: (max - min) / median, `p90_over_p10`).

    python benchmarks/host_drift.py [--minutes 5] [--every 15] [--calls 20] [--quick]

Run it on an otherwise idle machine: what it measures is what the machine gives one process
over time, the bound under which a profile fitted at one moment can price runs made at another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--calls", type=int, default=20, help="timed calls per sample (median)")
    p.add_argument("--quick", action="store_true", help="30 s, a sample every 5 s")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.every = 0.5, 5.0

    from tiderl.config import load_config
    from tiderl.sim.calibrate import VALIDATION_OVERRIDES
    from tiderl.sim.speed import SpeedProbe

    probe = SpeedProbe(load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-drift"]))
    shape = tuple(probe.mb.tokens_bt.shape)

    series = []
    start = time.monotonic()
    while True:
        s = probe(args.calls)
        series.append(s)
        at = time.monotonic() - start
        print(f"{at:7.1f} s  Ref forward {shape}: {s * 1e3:.2f} ms "
              f"(median of {args.calls})", flush=True)
        if at + args.every > args.minutes * 60:
            break
        time.sleep(args.every)
    probe.close()
    q = sorted(series)
    med = statistics.median(q)
    figures = {"samples": len(q), "calls_per_sample": args.calls, "every_s": args.every,
               "min_ms": q[0] * 1e3, "median_ms": med * 1e3, "max_ms": q[-1] * 1e3,
               "spread": (q[-1] - q[0]) / med,
               "p90_over_p10": q[(9 * (len(q) - 1)) // 10] / q[(len(q) - 1) // 10]}
    print(f"over {len(q)} samples: {figures['min_ms']:.2f} to {figures['max_ms']:.2f} ms, "
          f"median {figures['median_ms']:.2f}; spread {figures['spread']:.1%}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
