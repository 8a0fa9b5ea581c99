"""End to end: the same job in every mode, side by side in one process, on the default task with
heavy-tailed injected env latency; and (`--learn`) whether learning is traded for speed.

Throughput (default): contenders `sync`, `async` and `stream` (fixed splits, the split swept
and the best taken), `tiderl` with ERS off (fixed split, swept) and `tiderl` with ERS on
(starting from the first split). First one untimed warm-up job per contender compiles
everything it needs (engines on every device, each trainer mesh, both RA2P modes); then every
contender runs `--repeats` times, the order rotated each repeat; medians over repeats. Prints
goodput (action tokens consumed by updates per second), RWT, TWT, wall time, generation
throughput, KV hit rate, role changes and held-out success per contender, and ratios.

    python benchmarks/e2e.py [--steps 20] [--repeats 3] [--quick]

`--learn`: sync and tiderl (ERS on) for the same number of updates (>= 300) on the default task,
three seeds; held-out greedy success at equal updates and at equal wall time.

    python benchmarks/e2e.py --learn [--updates 400] [--seeds 0 1 2]

What a 2-core CPU can show: every fake device shares the same two cores, so a cell moved to the
trainer adds no compute (and more rollout ranks add no decode throughput); the modes can only
change how long each side sits idle (RWT/TWT), how much KV is recomputed and how often models
alternate. The benefit of moving devices at cluster scale belongs to the simulator. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

DEVICES = 4
# Fixed splits of the 4 devices for the asynchronous modes (rollout ranks, actor, Ref).
SPLITS = {"r2a1f1": (2, 1, 1), "r3a1": (3, 1, 0)}


def contenders() -> dict[str, list[str]]:
    """name → the overrides that make it (on top of `job_overrides`)."""
    def split(name: str) -> list[str]:
        r, a, f = SPLITS[name]
        return [f"rollout.ranks={r}", f"trainer.actor_devices={a}", f"trainer.ref_devices={f}"]

    out = {"sync": ["controller.mode=sync", *split("r2a1f1")]}
    for mode in ("async", "stream"):
        for s in SPLITS:
            out[f"{mode}:{s}"] = [f"controller.mode={mode}", *split(s)]
    for s in SPLITS:
        out[f"tiderl-ers-off:{s}"] = ["controller.mode=tiderl", "controller.ers=off", *split(s)]
    out["tiderl-ers-on"] = ["controller.mode=tiderl", "controller.ers=on", *split("r2a1f1")]
    return out


def job_overrides(steps: int) -> list[str]:
    return [
        f"controller.steps={steps}", f"cluster.fake_cpu_devices={DEVICES}",
        "controller.groups_per_step=4", "controller.groups_per_microbatch=1",
        "controller.eval_every=100000", "env.eval_groups=32", "controller.console=false",
        "controller.checkpoint_every=0", "controller.time_limit_s=0",
        # The paper's GRPO pipeline has a Reference phase (KL to the initial policy); the
        # embedded default has no KL term and therefore no Ref forward at all.
        "trainer.kl_coef=0.001",
        # Heavy-tailed environment: Pareto delays (scale 20 ms, alpha 1.5: a long tail of
        # multi-second steps), as slow web/household environments show.
        "env.latency.dist=pareto", "env.latency.scale_s=0.02", "env.latency.alpha=1.5",
        "env.latency.cap_s=5.0",
    ]


async def one(overrides: list[str], keep: str | None = None) -> dict:
    """Runs one job; its summary with its metrics records (and the compilations its steps
    saw). `keep`: copy the run's metrics.jsonl to this path."""
    from tiderl.config import load_config
    from tiderl.control.metrics import read_metrics
    from tiderl.runtime.job import run_job

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*overrides, f"run_dir={tmp}"])
        s = await run_job(cfg)
        s["records"] = read_metrics(tmp)
        if keep:
            Path(keep).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(tmp) / "metrics.jsonl", keep)
    steps = [r for r in s["records"] if r.get("kind") == "step"]
    s["compiles"] = sum(r.get("compiles_step", 0) for r in steps)
    s["compile_s"] = sum(r.get("compile_s_step", 0.0) for r in steps)
    return s


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else float("nan")


def throughput(args: argparse.Namespace) -> dict:
    jobs = contenders()
    names = list(jobs)
    t0 = time.time()
    for name in names:  # untimed warm-up: every contender compiles what it uses
        asyncio.run(one([*job_overrides(args.warmup_steps), *jobs[name], "seed=99"],
                        keep=f"{args.out}/warmup/{name}.jsonl" if args.out else None))
        print(f"warm-up {name:22s} done ({time.time() - t0:.0f}s)", flush=True)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotated
        for name in order:
            s = asyncio.run(one([*job_overrides(args.steps), *jobs[name], f"seed={rep}"],
                                keep=f"{args.out}/rep{rep}/{name}.jsonl" if args.out else None))
            s["rwt_s"], s["twt_s"] = s.get("rwt_s", 0.0), s.get("twt_s", 0.0)
            results[name].append(s)
            print(f"rep {rep} {name:22s} goodput {s['goodput']:7.1f} tok/s  "
                  f"RWT {s['rwt_s']:6.1f}s  TWT {s['twt_s']:6.1f}s  wall {s['wall_s']:6.1f}s  "
                  f"changes {s.get('role_changes', 0)}  compiles {s['compiles']} "
                  f"({s['compile_s']:.1f}s)  "
                  f"eval {s.get('eval_success_last', float('nan')):.3f}", flush=True)
    keys = ("goodput", "gen_throughput", "kv_hit_rate", "rwt_s", "twt_s", "wall_s",
            "role_changes", "compiles", "eval_success_last")
    print(f"\n{'contender':22s}" + "".join(f"{k:>18s}" for k in keys) + f"{'goodput/sync':>14s}")
    g = {n: med(results[n], "goodput") for n in names}
    for n in names:
        print(f"{n:22s}" + "".join(f"{med(results[n], k):18.3f}" for k in keys)
              + f"{g[n] / g['sync']:14.2f}")

    def best(prefix: str) -> str:  # the swept knob: each fixed-split mode at its best split
        return max((n for n in names if n.split(":")[0] == prefix), key=lambda n: g[n])

    b = {m: best(m) for m in ("sync", "async", "stream", "tiderl-ers-off", "tiderl-ers-on")}
    gb = {m: g[n] for m, n in b.items()}
    changes = [c for s in results["tiderl-ers-on"] for c in s["records"]
               if c.get("kind") == "role_change"]
    out = {
        "best_split": {m: n for m, n in b.items()},
        **{f"goodput_{m}": v for m, v in gb.items()},
        "goodput_ers_on_over_off": gb["tiderl-ers-on"] / gb["tiderl-ers-off"],
        "goodput_ers_on_over_sync": gb["tiderl-ers-on"] / gb["sync"],
        "goodput_ers_on_over_async": gb["tiderl-ers-on"] / gb["async"],
        "goodput_ers_on_over_stream": gb["tiderl-ers-on"] / gb["stream"],
        "goodput_ers_off_over_async": gb["tiderl-ers-off"] / gb["async"],
        **{f"rwt_plus_twt_{m}": med(results[n], "rwt_s") + med(results[n], "twt_s")
           for m, n in b.items()},
        "role_changes_per_run": med(results["tiderl-ers-on"], "role_changes"),
        "compiles_in_timed_runs": {m: med(results[n], "compiles") for m, n in b.items()},
        "role_change_median_s": statistics.median([c.get("change_s", 0.0) for c in changes])
        if changes else None,
        "steps": args.steps, "repeats": args.repeats, "devices": DEVICES,
        "bench_s": time.time() - t0,
    }
    return out


# -- learning: sync vs tiderl (ERS on) ---------------------------------------------------------
def learn_overrides(mode: str, updates: int, seed: int) -> list[str]:
    # The embedded default task and trainer (no KL term), on 4 devices so ERS has cells to
    # move (three rollout ranks and one trainer device to start); the cosine decay ends at the
    # last update for both modes. Evaluation every 50 updates, all 64 held-out groups.
    return [f"controller.mode={mode}", f"controller.steps={updates}", f"seed={seed}",
            f"trainer.decay_steps={updates}", "controller.time_limit_s=0",
            "controller.eval_every=50", "controller.console=false",
            "controller.checkpoint_every=0", f"cluster.fake_cpu_devices={DEVICES}",
            "rollout.ranks=3", "trainer.actor_devices=1",
            *(["controller.ers=on"] if mode == "tiderl" else [])]


def at_wall(evals: list[dict], t: float) -> float:
    """Held-out success of the newest evaluation finished by wall time `t`."""
    done = [e for e in evals if e["wall_s"] <= t]
    return done[-1]["eval_success"] if done else float("nan")


def learn(args: argparse.Namespace) -> dict:
    runs: dict[str, dict[int, dict]] = {"sync": {}, "tiderl": {}}
    t0 = time.time()
    for seed in args.seeds:
        for mode in (("sync", "tiderl") if seed % 2 == 0 else ("tiderl", "sync")):
            s = asyncio.run(one(learn_overrides(mode, args.updates, seed),
                                keep=f"{args.out}/learn/{mode}-{seed}.jsonl" if args.out
                                else None))
            runs[mode][seed] = s
            print(f"seed {seed} {mode:6s} final held-out {s.get('eval_success_last'):.3f} "
                  f"(best {s.get('eval_success_best'):.3f})  wall {s['wall_s']:.0f}s  "
                  f"changes {s.get('role_changes', 0)}  ({time.time() - t0:.0f}s)", flush=True)
    rows = {}
    for seed in args.seeds:
        ev = {m: [r for r in runs[m][seed]["records"] if r.get("kind") == "eval"]
              for m in runs}
        t_eq = min(runs[m][seed]["wall_s"] for m in runs)  # the faster run's end
        rows[seed] = {
            "updates": {m: runs[m][seed]["eval_success_last"] for m in runs},
            "wall_s": {m: runs[m][seed]["wall_s"] for m in runs},
            "equal_wall_s": t_eq,
            "at_equal_wall": {m: at_wall(ev[m], t_eq) for m in runs},
        }
    fin = {m: [rows[s]["updates"][m] for s in args.seeds] for m in runs}
    wall = {m: [rows[s]["at_equal_wall"][m] for s in args.seeds] for m in runs}
    spread = (min(fin["sync"]), max(fin["sync"]))
    tide = statistics.median(fin["tiderl"])
    print(f"\n{'seed':>5s} {'sync@N':>8s} {'tiderl@N':>9s} {'T_eq(s)':>8s} {'sync@T':>7s} "
          f"{'tiderl@T':>9s} {'wall sync':>10s} {'wall tiderl':>12s}")
    for s, r in rows.items():
        print(f"{s:5d} {r['updates']['sync']:8.3f} {r['updates']['tiderl']:9.3f} "
              f"{r['equal_wall_s']:8.0f} {r['at_equal_wall']['sync']:7.3f} "
              f"{r['at_equal_wall']['tiderl']:9.3f} {r['wall_s']['sync']:10.0f} "
              f"{r['wall_s']['tiderl']:12.0f}")
    return {
        "updates": args.updates, "seeds": list(args.seeds),
        "success_at_equal_updates": fin, "success_at_equal_wall": wall,
        "median_at_equal_updates": {m: statistics.median(v) for m, v in fin.items()},
        "median_at_equal_wall": {m: statistics.median(v) for m, v in wall.items()},
        "sync_spread_at_equal_updates": spread,
        "tiderl_median_within_sync_spread": spread[0] <= tide <= spread[1],
        "tiderl_median_at_least_sync_min": tide >= spread[0],
        "wall_ratio_sync_over_tiderl": statistics.median(
            [rows[s]["wall_s"]["sync"] / rows[s]["wall_s"]["tiderl"] for s in args.seeds]),
        "bench_s": time.time() - t0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="4 steps, 1 repeat (smoke run)")
    p.add_argument("--learn", action="store_true", help="learning: sync vs tiderl (ERS on)")
    p.add_argument("--updates", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", help="keep every run's metrics.jsonl under this folder")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.warmup_steps = 4, 1, 2
    if args.learn and args.updates < 300 and not args.quick:
        p.error("--learn needs --updates >= 300 (the default task learns between ~250 and "
                "~550 updates)")
    out = learn(args) if args.learn else throughput(args)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
