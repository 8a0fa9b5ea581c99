"""End to end: the same job in `sync`, `async`, `stream` and `tiderl` modes, one after another in
one process, against the default task with heavy-tailed injected env latency.

Prints goodput (action tokens consumed by updates per second), RWT, TWT, generation
throughput, KV hit rate and final held-out success per mode (medians over repeats), and the
ratios to the other modes. The last line is one JSON object.

    python benchmarks/e2e.py [--steps 30] [--repeats 2] [--quick]

On this 2-core CPU every fake device shares the same two cores, so overlapping rollout with
training cannot add compute the way separate GPUs do; what the modes can still change is how
much time each side spends idle waiting for the other (RWT/TWT) and how much KV is recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

MODES = ("sync", "async", "stream", "tiderl")


def job_overrides(mode: str, steps: int, run_dir: str) -> list[str]:
    return [
        f"controller.mode={mode}", f"controller.steps={steps}", f"run_dir={run_dir}",
        "controller.groups_per_step=4", "controller.groups_per_microbatch=1",
        "controller.eval_every=100000", "env.eval_groups=64", "controller.console=false",
        "controller.checkpoint_every=0",
        # The paper's GRPO pipeline has a Reference phase (KL to the initial policy); the
        # embedded default has no KL term and therefore no Ref forward at all.
        "trainer.kl_coef=0.001",
        # Heavy-tailed environment: Pareto delays (scale 20 ms, alpha 1.5: a long tail of
        # multi-second steps), as slow web/household environments show.
        "env.latency.dist=pareto", "env.latency.scale_s=0.02", "env.latency.alpha=1.5",
        "env.latency.cap_s=5.0",
    ]


async def one(mode: str, steps: int, seed: int) -> dict:
    from tiderl.config import load_config
    from tiderl.job import run_job

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, job_overrides(mode, steps, tmp) + [f"seed={seed}"])
        s = await run_job(cfg)
    return s


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="5 steps, 1 repeat (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 5, 1
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES:  # interleaved, so machine load drifts hit every mode alike
            s = asyncio.run(one(mode, args.steps, seed=rep))
            results[mode].append(s)
            print(f"rep {rep} {mode:7s} goodput {s['goodput']:7.1f} tok/s  "
                  f"RWT {s['rwt_s']:6.1f}s  TWT {s['twt_s']:6.1f}s  wall {s['wall_s']:6.1f}s  "
                  f"eval {s.get('eval_success_last', float('nan')):.3f}", flush=True)

    def med(mode: str, key: str) -> float:
        vals = [r.get(key) for r in results[mode] if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    keys = ("goodput", "gen_throughput", "kv_hit_rate", "rwt_s", "twt_s", "wall_s",
            "eval_success_last")
    print(f"\n{'mode':8s}" + "".join(f"{k:>18s}" for k in keys) + f"{'goodput/sync':>14s}")
    g_sync = med("sync", "goodput")
    for mode in MODES:
        row = "".join(f"{med(mode, k):18.3f}" for k in keys)
        print(f"{mode:8s}{row}{med(mode, 'goodput') / g_sync:14.2f}")
    g = {m: med(m, "goodput") for m in MODES}
    out = {
        "goodput_tiderl_over_sync": g["tiderl"] / g["sync"],
        "goodput_tiderl_over_async": g["tiderl"] / g["async"],
        "goodput_tiderl_over_stream": g["tiderl"] / g["stream"],
        **{f"goodput_{m}": g[m] for m in MODES},
        **{f"rwt_{m}": med(m, "rwt_s") for m in MODES},
        **{f"twt_{m}": med(m, "twt_s") for m in MODES},
        **{f"eval_{m}": med(m, "eval_success_last") for m in MODES},
        "steps": args.steps, "repeats": args.repeats,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
