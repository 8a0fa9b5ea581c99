"""CTB against request-level continuous batching: same engine, same KV pool, same task stream.

    python benchmarks/ctb.py [--repeats 3] [--groups 4] [--group-size 8] [--workloads textworld,default]

One rollout rank (one engine, one fixed KV pool of `num_pages`) plays one step of N groups x G
tasks against a real env server on loopback (aiohttp, in-process, injected lognormal latency):
  ctb            Algorithm 1 (token budgets from the pool, probe, pause/resume by priority)
  vanilla@hi/lo  request-level batching with a fixed concurrency cap (the paper's F10/F9 setting:
                 caps at ~78% and ~39% of the step's tasks, like 1024 and 512 of 1,312); a waiting
                 task's KV is evicted (LRU) when pages run short and re-prefilled when it returns.
Every contender plays exactly the same tokens: sampling keys come from (task id, position) and
the envs are deterministic, so trajectories match token for token (checked, printed).
Per contender (median over repeats, contenders interleaved, one untimed warm-up each):
KV hit rate (prompt tokens served from resident KV / prompt tokens needed), prefill tokens
computed and recomputed after eviction, decode tokens/s over the step, step duration.
The last stdout line is one JSON object with the headline figures (over the workloads: hit rates
pooled over tokens, step time ratio as the geometric mean).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import jax  # noqa: E402

from tiderl.envs.client import EnvClient  # noqa: E402
from tiderl.envs.config import EnvConfig, LatencyConfig  # noqa: E402
from tiderl.envs.server import EnvServer  # noqa: E402
from tiderl.envs.suites import adapter_class  # noqa: E402
from tiderl.envs.tasks import TaskSource  # noqa: E402
from tiderl.envs.templates import template_for  # noqa: E402
from tiderl.models.config import ModelConfig  # noqa: E402
from tiderl.models.policy import init_policy  # noqa: E402
from tiderl.models.tokenizer import ByteTokenizer  # noqa: E402
from tiderl.serving.config import RolloutConfig  # noqa: E402
from tiderl.serving.ctb import CTBConfig, make_scheduler  # noqa: E402
from tiderl.serving.engine import Engine  # noqa: E402
from tiderl.serving.rank import RolloutRank  # noqa: E402
from tiderl.serving.rollout import RolloutManager  # noqa: E402

CTB_OVERRIDES: dict = {}
VERBOSE = bool(os.environ.get("CTB_BENCH_VERBOSE"))
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    suite: str
    options: tuple[str, ...]
    max_turns: int
    max_context: int
    num_pages: int
    """The KV pool: the same for every contender of this workload."""
    latency_s: float
    """Median injected env latency per step (lognormal, sigma 0.5; /start x2)."""


WORKLOADS = {
    # TextWorld: ~650-token first observation (quest + room), ~40 tokens per turn after.
    "textworld": Workload("textworld", "textworld", ("rooms=3", "objects=4", "quest_length=3"),
                          max_turns=6, max_context=1024, num_pages=360, latency_s=0.2),
    # Guess-the-number with a long guess budget: tiny prompt, many short turns.
    "default": Workload("default", "default", ("n=8", "guesses=16"),
                        max_turns=16, max_context=512, num_pages=96, latency_s=0.1),
}


def printable(action: str) -> str:
    """Printable ASCII only: a NUL byte in a command segfaults TextWorld's frotz (and with it
    the env server), and control bytes trigger its hot keys. An untrained byte policy emits both."""
    return "".join(c if " " <= c <= "~" and c != "\\" else " " for c in action)


def adapter_for(suite: str):
    cls = adapter_class(suite)
    if suite != "textworld":
        return cls

    class PrintableTextWorld(cls):  # type: ignore[misc, valid-type]
        def step(self, action: str):
            return super().step(printable(action))

    return PrintableTextWorld


def rollout_cfg(wl: Workload, stop_ids) -> RolloutConfig:
    return RolloutConfig(num_pages=wl.num_pages, page_size=16, max_slots=32,
                         max_context=wl.max_context, max_action_tokens=8, temperature=1.0,
                         decode_buckets=(4, 8, 16, 32), prefill_buckets=(16, 64, 256),
                         stop_tokens=tuple(sorted(stop_ids)))


async def run_step(engine: Engine, rcfg: RolloutConfig, wl: Workload, url: str, groups: list,
                   kind: str, cap: int) -> dict:
    """One step (every group to its end) under one scheduler; returns its figures."""
    tmpl = template_for(ByteTokenizer(), "byte")
    rank = RolloutRank(0, engine, max_prefills_per_step=16)
    await rank.start()
    ctb = CTBConfig(**{"action_reserve": rcfg.max_action_tokens, "vanilla_concurrency": cap,
                       "env_concurrency": rcfg.max_slots, **CTB_OVERRIDES})
    sched = make_scheduler(kind, ctb, [rcfg.num_pages * rcfg.page_size],
                           max_context=rcfg.max_context)
    active_samples: list[int] = []

    async def sample_active():
        while True:
            active_samples.append(sched.n_active())
            await asyncio.sleep(0.05)
            if VERBOSE and len(active_samples) % 40 == 0:
                print(f"    {kind} t={len(active_samples) * 0.05:.0f}s active {sched.n_active()} "
                      f"pending {sched.pending()} turns {rank.stats.turns} "
                      f"decode {rank.stats.decode_steps} {mgr.decisions} "
                      f"{mgr.end_reasons}", file=sys.stderr, flush=True)

    async with EnvClient(url, EnvConfig(concurrency=256)) as env:
        mgr = RolloutManager([rank], sched, env, tmpl, max_turns=wl.max_turns)
        sampler = asyncio.create_task(sample_active())
        t0 = time.perf_counter()
        trajs = await asyncio.gather(*(mgr.run_group(g) for g in groups))
        dt = time.perf_counter() - t0
        sampler.cancel()
    await rank.close()
    trajs = [t for g in trajs for t in g]
    st, rs = mgr.stats(), rank.stats
    return {
        "step_s": dt,
        "hit_rate": st["kv_hit_rate"],
        "prompt_tokens": st["prompt_tokens"],
        "cached_tokens": st["cached_tokens"],
        "computed_tokens": st["computed_tokens"],
        "recomputed_evicted": rs.recomputed_evicted,
        "decode_tokens": st["decode_tokens"],
        "decode_tok_s": st["decode_tokens"] / dt,
        "forced_evictions": st["forced_evictions"],
        "pauses": st["decisions"]["pause"],
        "mean_active": statistics.fmean(active_samples) if active_samples else 0.0,
        "busy_frac": rs.busy_s / dt,
        "end_reasons": st["end_reasons"],
        "tasks": len(trajs),
        "signature": hash(tuple(tuple(t.tokens) for t in sorted(trajs, key=lambda t: t.task_id))),
    }


def warm_up(engine: Engine, rcfg: RolloutConfig) -> float:
    """Compiles every (rows, length) bucket the steps can hit, outside the timed steps."""
    t0 = time.perf_counter()
    engine.init_decode_state()
    many = getattr(engine, "prefill_many", None)
    rows = rcfg.decode_buckets if many is not None else rcfg.decode_buckets[:1]
    prev_b = 0
    for b in rows:
        n_rows = min(b, prev_b + 1)  # the smallest batch that lands in bucket b
        prev_b = b
        for t in rcfg.prefill_buckets:
            if n_rows * t > rcfg.num_pages * rcfg.page_size // 2:
                t = rcfg.prefill_buckets[0]
            state = engine.state
            if many is not None:
                from tiderl.serving.engine import PrefillRequest

                hs = many(None, [PrefillRequest(None, [65] * t, t, task_id=10**6 + i)
                                 for i in range(n_rows)])
            else:
                hs = [engine.prefill(None, None, [65] * t, t, task_id=10**6)]
            for h in hs:
                state = engine.insert(h, state)
            engine.generate(None, state)
            for h in hs:
                engine.free(h)
    return time.perf_counter() - t0


def prepare(wl: Workload, n_groups: int, group_size: int) -> list:
    src = TaskSource(wl.suite, "train", groups=max(n_groups, 2), group_size=group_size,
                     options=dict(o.split("=", 1) for o in wl.options))
    groups = [src.element(k) for k in range(n_groups)]
    if wl.suite == "textworld":  # compile the games outside the timed steps (~2.5 s each)
        from tiderl.envs.adapters.textworld import compile_game, default_cache_dir, game_shape

        for g in groups:
            compile_game(game_shape(g["tasks"][0], {}), default_cache_dir())
    return groups


async def bench_workload(wl: Workload, args) -> dict:
    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    rcfg = rollout_cfg(wl, tmpl.stop_ids)
    graphdef, params = init_policy(MODEL, seed=0)
    engine = Engine(graphdef, jax.device_put(params, jax.devices()[0]), MODEL, rcfg, seed=123)
    n_tasks = args.groups * args.group_size
    caps = {"ctb": None, f"vanilla@{round(0.78 * n_tasks)}": round(0.78 * n_tasks),
            f"vanilla@{round(0.39 * n_tasks)}": round(0.39 * n_tasks)}
    groups = prepare(wl, args.groups, args.group_size)
    print(f"  [{wl.name}] compiled in {warm_up(engine, rcfg):.1f}s", file=sys.stderr, flush=True)
    env_cfg = EnvConfig(suite=wl.suite, options=wl.options, max_sessions=4096,
                        latency=LatencyConfig(dist="lognormal", median_s=wl.latency_s,
                                              sigma=0.5, start_factor=2.0, seed=1))
    runs: dict[str, list[dict]] = {k: [] for k in caps}
    # One env worker thread: TextWorld's z-machine is not thread-safe (concurrent sessions in
    # threads crash it), so adapter calls are serialised; injected latency still overlaps.
    async with EnvServer(adapter_for(wl.suite), env_cfg, workers=1).serve() as url:
        for rep in range(args.repeats):
            for name, cap in caps.items():
                kind = "ctb" if cap is None else "vanilla"
                r = await run_step(engine, rcfg, wl, url, groups, kind, cap or 1)
                runs[name].append(r)
                print(f"  [{wl.name}] rep {rep} {name:12s} step {r['step_s']:6.2f}s "
                      f"hit {r['hit_rate']:.3f} recomputed {r['recomputed_evicted']:6d} "
                      f"evictions {r['forced_evictions']:4d} pauses {r['pauses']:3d} "
                      f"active {r['mean_active']:.1f}", file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in
                  ("step_s", "hit_rate", "prompt_tokens", "cached_tokens", "computed_tokens",
                   "recomputed_evicted", "decode_tokens", "decode_tok_s", "forced_evictions",
                   "pauses", "mean_active", "busy_frac")}
           for name, rs in runs.items()}
    sigs = {r["signature"] for rs in runs.values() for r in rs}
    reasons = {name: rs[0]["end_reasons"] for name, rs in runs.items()}
    return {"workload": wl, "caps": caps, "median": med, "identical_tokens": len(sigs) == 1,
            "end_reasons": reasons, "tasks": n_tasks, "capacity_tokens": rcfg.num_pages * 16}


def report(res: dict) -> dict:
    wl, med = res["workload"], res["median"]
    vanillas = [n for n in med if n != "ctb"]
    best = min(vanillas, key=lambda n: med[n]["step_s"])
    print(f"\n== {wl.name}: {res['tasks']} tasks ({wl.suite} {' '.join(wl.options)}), "
          f"max_turns {wl.max_turns}, KV pool {wl.num_pages} pages = {res['capacity_tokens']} "
          f"tokens, env latency lognormal median {wl.latency_s}s")
    cols = ["ctb"] + vanillas
    rows = [("KV hit rate", "hit_rate", "{:.3f}"), ("prompt tokens needed", "prompt_tokens", "{:.0f}"),
            ("prefill tokens computed", "computed_tokens", "{:.0f}"),
            ("  recomputed after eviction", "recomputed_evicted", "{:.0f}"),
            ("forced evictions", "forced_evictions", "{:.0f}"), ("CTB pauses", "pauses", "{:.0f}"),
            ("mean tasks in flight", "mean_active", "{:.1f}"),
            ("decode tokens", "decode_tokens", "{:.0f}"),
            ("decode tokens/s", "decode_tok_s", "{:.1f}"),
            ("engine busy fraction", "busy_frac", "{:.2f}"), ("step duration s", "step_s", "{:.2f}")]
    print(f"{'':30s}" + "".join(f"{c:>14s}" for c in cols))
    for label, key, fmt in rows:
        print(f"{label:30s}" + "".join(f"{fmt.format(med[c][key]):>14s}" for c in cols))
    print(f"same tokens in every run: {res['identical_tokens']}; end reasons: "
          f"{res['end_reasons']['ctb']}")
    hv = max(med[n]["hit_rate"] for n in vanillas)
    out = {
        "hit_rate_ctb": med["ctb"]["hit_rate"], "hit_rate_vanilla": hv,
        "hit_rate_ratio": med["ctb"]["hit_rate"] / max(hv, 1e-9),
        "step_time_ratio": med["ctb"]["step_s"] / med[best]["step_s"],
        "throughput_ratio": med["ctb"]["decode_tok_s"] / med[best]["decode_tok_s"],
        "recompute_ratio": med["ctb"]["computed_tokens"] / med[best]["computed_tokens"],
        "best_vanilla": best,
    }
    print(f"CTB / best vanilla ({best}): hit rate x{out['hit_rate_ratio']:.2f} (vs the better "
          f"vanilla hit rate), step time x{out['step_time_ratio']:.3f}, decode throughput "
          f"x{out['throughput_ratio']:.2f}, prefill computed x{out['recompute_ratio']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--workloads", default="textworld,default")
    ap.add_argument("--ctb", default="", help="CTBConfig overrides, e.g. growth_horizon=0.25")
    args = ap.parse_args()
    for kv in filter(None, args.ctb.split(",")):
        k, v = kv.split("=", 1)
        default = getattr(CTBConfig(), k)
        CTB_OVERRIDES[k] = (v.lower() in ("1", "true")) if isinstance(default, bool) else \
            type(default)(v)
    t0 = time.perf_counter()
    summary: dict = {}
    for name in args.workloads.split(","):
        res = asyncio.run(bench_workload(WORKLOADS[name], args))
        summary[name] = report(res)
    ws = list(summary.values())
    head = {
        "hit_rate_ctb": statistics.fmean(w["hit_rate_ctb"] for w in ws),
        "hit_rate_vanilla": statistics.fmean(w["hit_rate_vanilla"] for w in ws),
        "hit_rate_ratio": math.exp(statistics.fmean(math.log(w["hit_rate_ratio"]) for w in ws)),
        "step_time_ratio": math.exp(statistics.fmean(math.log(w["step_time_ratio"])
                                                     for w in ws)),
        "throughput_ratio": math.exp(statistics.fmean(math.log(w["throughput_ratio"])
                                                      for w in ws)),
        "repeats": args.repeats, "groups": args.groups, "group_size": args.group_size,
        "wall_s": round(time.perf_counter() - t0, 1),
        "per_workload": {k: {kk: (round(v, 4) if isinstance(v, float) else v)
                             for kk, v in w.items()} for k, w in summary.items()},
    }
    print(json.dumps(head))


if __name__ == "__main__":
    main()
