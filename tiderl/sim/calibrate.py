"""`python -m tiderl.sim.calibrate`: micro-benchmarks of the real engine and trainer on this
machine, fitted into the `cpu-fitted` profile.

The job calibrated is the one `python -m tiderl.sim.validate` runs (the embedded default model
and rollout/trainer settings, see `VALIDATION_OVERRIDES`). Measured on a grid of shapes, each
point a median over repeats after a warm-up (the machine is shared, so single timings are
noisy; the spread of the repeats is reported as the noise):

- engine `prefill_many` over (rows, new tokens, cached prefix) and `generate` over (rows,
  context): the rank's own calls, with their bucketing and padding;
- trainer Ref forward, Actor forward, Actor backward over micro-batch sizes, and the update;
- a weight sync (export, copy to the rollout device, `update_weights`);
- the host work of an environment call, in situ: the event loop's CPU seconds per call of the
  rollout manager, scheduler and rank playing groups with the env over HTTP, less the same
  groups with the adapter called in-process (`tiderl.sim.hostcost`; one call timed alone, the
  old measure, costs less and is kept in the notes). `--host-only` measures just this one
  (no JAX) and updates the profile in place.

Each operation's `c0 + max(work_flops / r_flops, work_hbm / r_hbm)` is fitted by least squares
on relative error, with the work computed by `tiderl.sim.costs` exactly as the simulator
computes it (so the fit also absorbs what the work formulas miss). The per-operation MAPE and
noise are printed and stored in the profile's notes; the last stdout line is one JSON object.

This module imports JAX inside `main` only (the package stays JAX-free).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiderl.sim.costs import PROFILES, OpCost, Profile, SimCostModel, model_shape, profile_from_dict
from tiderl.sim.hostcost import env_call_note, host_only, write_profile

VALIDATION_OVERRIDES = [
    "controller.groups_per_step=4", "controller.groups_per_microbatch=1",
    "controller.eval_every=0", "controller.console=false", "controller.checkpoint_every=0",
    # The paper's pipeline has a Ref phase (a KL term); the embedded default has none.
    "trainer.kl_coef=0.001",
    # A heavy-tailed environment (Pareto, scale 20 ms, alpha 1.5, capped at 5 s).
    "env.latency.dist=pareto", "env.latency.scale_s=0.02", "env.latency.alpha=1.5",
    "env.latency.cap_s=5.0",
    # Seed order, which the JAX-free twin replays without grain's shuffle.
    "env.shuffle=false",
]


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median seconds, relative spread (IQR / median)) of `fn` over `repeats` calls."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    med = statistics.median(ts)
    q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
    return med, (q3 - q1) / med if med else 0.0


# -- fitting ----------------------------------------------------------------------------------
def predict(theta: Sequence[float], works: Sequence[dict[str, float]]) -> float:
    c0, rf, rh = theta
    return sum(c0 + max(w.get("flops", 0.0) / rf, w.get("hbm", 0.0) / rh) for w in works)


def fit_op(samples: Sequence[tuple[Sequence[dict[str, float]], float]]) -> tuple[OpCost, float]:
    """Fits `c0 + max(flops/r_f, hbm/r_h)` (summed over a call's rounds) to (works, seconds);
    returns the cost and its MAPE over the samples."""
    from scipy.optimize import least_squares

    ys = [y for _, y in samples]
    nrounds = [len(w) for w, _ in samples]
    c0_init = min(y / n for y, n in zip(ys, nrounds, strict=True)) * 0.5
    fl = [sum(x.get("flops", 0.0) for x in w) for w, _ in samples]
    hb = [sum(x.get("hbm", 0.0) for x in w) for w, _ in samples]
    rf0 = max(fl) / max(max(ys) - c0_init, 1e-9)
    rh0 = max(hb) / max(max(ys) - c0_init, 1e-9)

    def resid(log_theta):
        th = [math.exp(v) for v in log_theta]
        return [(predict(th, w) - y) / y for w, y in samples]

    best = None
    for scale in (0.3, 1.0, 3.0):  # a few starts: the max() makes the loss piecewise
        x0 = [math.log(max(c0_init, 1e-7)), math.log(rf0 * scale), math.log(rh0 * scale)]
        r = least_squares(resid, x0, loss="soft_l1", f_scale=0.2)
        if best is None or r.cost < best.cost:
            best = r
    c0, rf, rh = (math.exp(v) for v in best.x)
    mape = statistics.fmean(abs(e) for e in resid(best.x))
    return OpCost(c0, (("flops", rf), ("hbm", rh))), mape


def fit_constant(ys: Sequence[float]) -> tuple[OpCost, float]:
    c0 = statistics.median(ys)
    return OpCost(c0), statistics.fmean(abs(y - c0) / y for y in ys)


# -- measurements -----------------------------------------------------------------------------
def _engine_samples(cfg: Any, graphdef: Any, params: Any, device: Any, costs: SimCostModel,
                    repeats: int, quick: bool) -> dict[str, list]:
    import jax

    from tiderl.serving.engine import Engine
    from tiderl.serving.pages import PrefillRequest

    rcfg = cfg.rollout
    eng = Engine(graphdef, jax.device_put(params, device), cfg.model, rcfg, seed=0)
    eng.init_decode_state()
    out: dict[str, list] = {"prefill": [], "decode": []}
    noise: dict[str, list] = {"prefill": [], "decode": []}
    tid = iter(range(1 << 30))
    rows_grid = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    max_ctx = rcfg.max_context

    def fresh(n_rows: int, ctx: int) -> list:
        hs = eng.prefill_many(None, [PrefillRequest(None, [7] * ctx, ctx, task_id=next(tid))
                                     for _ in range(n_rows)])
        for h in hs:
            eng.insert(h, eng.state)
        return hs

    for b in rows_grid:
        for new in ((4, 40) if quick else (3, 10, 24, 40, 64)):
            for cached in ((0, 40) if quick else (0, 16, 48)):
                if cached + new + 2 * repeats + 4 > max_ctx:
                    continue
                if cached:  # each repeat appends: measure on fresh handles every time
                    ts = []
                    for _ in range(repeats + 1):
                        hs = fresh(b, cached)
                        t0 = time.perf_counter()
                        eng.prefill_many(None, [PrefillRequest(h, [5] * new, new) for h in hs])
                        ts.append(time.perf_counter() - t0)
                        for h in hs:
                            eng.free(h)
                    ts = sorted(ts[1:])
                    med = statistics.median(ts)
                    spread = (ts[(3 * len(ts)) // 4] - ts[len(ts) // 4]) / med
                else:
                    def call(b=b, new=new):
                        reqs = [PrefillRequest(None, [5] * new, new, task_id=next(tid))
                                for _ in range(b)]
                        for h in eng.prefill_many(None, reqs):
                            eng.free(h)

                    call()  # warm-up (compiles the bucket)
                    med, spread = _median_time(call, repeats)
                rows = [(cached, new)] * b
                out["prefill"].append((costs.prefill_work(rows), med, {"rows": b, "new": new,
                                                                        "cached": cached}))
                noise["prefill"].append(spread)
    for b in ((1, 8, 64) if quick else (1, 2, 4, 8, 16, 32, 64)):
        for ctx in ((8, 80) if quick else (8, 40, 90)):
            if ctx + repeats + 4 > max_ctx:
                continue
            hs = fresh(b, ctx)
            eng.generate(None, eng.state)  # warm-up
            for h in hs:
                if h.done:
                    h.stop_reason = type(h.stop_reason).NONE  # keep decoding (timing only)
                    h.decoding = True
            med, spread = _median_time(lambda: _decode_keep(eng), repeats)
            for h in hs:
                eng.free(h)
            w = costs.decode_work(batch=b, context_sum=b * ctx)
            out["decode"].append(([w], med, {"rows": b, "context": ctx}))
            noise["decode"].append(spread)
    return {"samples": out, "noise": noise}


def _decode_keep(eng: Any) -> None:
    """One decode step; rows that stopped are put back, so every step decodes the same rows."""
    eng.generate(None, eng.state)
    for h in eng.state.slots:
        if h is not None and h.slot is not None and not h.decoding:
            h.stop_reason = type(h.stop_reason).NONE
            h.action_start = len(h.tokens) - 1
            h.decoding = True


def _trainer_samples(cfg: Any, graphdef: Any, params: Any, meshes: dict, costs: SimCostModel,
                     repeats: int, quick: bool) -> dict[str, list]:
    import jax

    from tiderl.train.backend import TrainerBackend
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    t = cfg.trainer
    be = TrainerBackend(t, cfg.model, actor_mesh=meshes["actor"], policy=(graphdef, params),
                        temperature=cfg.rollout.temperature)
    out: dict[str, list] = {k: [] for k in ("ref_forward", "actor_forward", "actor_backward")}
    noise: dict[str, list] = {k: [] for k in out}
    applies = []
    for n_seqs, max_len in (((4, 24), (32, 60)) if quick else
                            ((2, 20), (8, 24), (16, 40), (32, 40), (32, 100), (64, 100))):
        trajs = synthetic_trajectories(n_seqs, vocab=cfg.model.vocab_size, min_len=max_len // 2,
                                       max_len=max_len, seed=n_seqs)
        mbs, _ = microbatches(trajs, n_ranks=1, row_len=t.row_len, rows_per_rank=t.rows_per_rank)
        mb = mbs[0]
        batch = be.put(mb, "actor")
        lens = [len(x.tokens) for x in trajs if x.uid in set(mb.uids)]
        ref = jax.block_until_ready(be.ref_forward(batch))
        outs, vjp = be.actor_forward(batch)
        jax.block_until_ready(outs)
        be.actor_backward(vjp, outs, ref, batch, mb)
        jax.block_until_ready(be._grads)
        be.apply()  # warm-up of every kernel

        def ref_f(batch=batch):
            jax.block_until_ready(be.ref_forward(batch))

        def act_f(batch=batch):
            jax.block_until_ready(be.actor_forward(batch)[0])

        def act_b(batch=batch, ref=ref, mb=mb):
            o, v = be.actor_forward(batch)
            jax.block_until_ready(o)
            t0 = time.perf_counter()
            be.actor_backward(v, o, ref, batch, mb)
            jax.block_until_ready(be._grads)
            return time.perf_counter() - t0

        for name, fn in (("ref_forward", ref_f), ("actor_forward", act_f)):
            med, spread = _median_time(fn, repeats)
            w = costs.train_work([lens], row_len=t.row_len, backward=False)
            out[name].append(([w], med, {"seqs": len(lens), "tokens": sum(lens),
                                         "rows": mb.tokens_bt.shape[0]}))
            noise[name].append(spread)
        ts = sorted(act_b() for _ in range(repeats))
        med = statistics.median(ts)
        w = costs.train_work([lens], row_len=t.row_len, backward=True)
        out["actor_backward"].append(([w], med, {"seqs": len(lens), "tokens": sum(lens),
                                                 "rows": mb.tokens_bt.shape[0]}))
        noise["actor_backward"].append((ts[(3 * len(ts)) // 4] - ts[len(ts) // 4]) / med)
        for _ in range(repeats):
            t0 = time.perf_counter()
            be.apply()
            jax.block_until_ready(be.state)
            applies.append(time.perf_counter() - t0)
            o, v = be.actor_forward(batch)
            be.actor_backward(v, o, ref, batch, mb)
            jax.block_until_ready(be._grads)
    be.apply()
    return {"samples": out, "noise": noise, "apply": applies, "backend": be}


def _sync_times(be: Any, engine_device: Any, cfg: Any, graphdef: Any, params: Any,
                repeats: int) -> list[float]:
    import jax

    from tiderl.serving.engine import Engine

    eng = Engine(graphdef, jax.device_put(params, engine_device), cfg.model, cfg.rollout)
    eng.init_decode_state()
    ts = []
    for v in range(repeats + 1):
        t0 = time.perf_counter()
        w = jax.device_put(be.export_weights(), engine_device)
        eng.update_weights(w, version=v + 1)
        jax.block_until_ready(eng.params)
        ts.append(time.perf_counter() - t0)
    return ts[1:]


def _env_times(cfg: Any, repeats: int) -> list[float]:
    """Seconds per env call (start, observation, end) through the in-process HTTP server."""
    import dataclasses

    from tiderl.envs.client import EnvClient
    from tiderl.envs.server import endpoint
    from tiderl.envs.tasks import TaskSource

    env_cfg = dataclasses.replace(cfg.env, latency=dataclasses.replace(cfg.env.latency,
                                                                       dist="none"))
    src = TaskSource.from_config(env_cfg, "train")

    async def go() -> list[float]:
        ts = []
        async with endpoint(env_cfg) as url, EnvClient(url, env_cfg) as env:
            for k in range(repeats + 2):
                task = src.element(k)["tasks"][0]
                t0 = time.perf_counter()
                s = await env.start(task)
                t1 = time.perf_counter()
                await env.step(s.session, "1")
                t2 = time.perf_counter()
                await env.end(s.session)
                t3 = time.perf_counter()
                if k >= 2:
                    ts += [t1 - t0, t2 - t1, t3 - t2]
        return ts

    return asyncio.run(go())


def _contention(cfg: Any, graphdef: Any, params: Any, device: Any, be: Any,
                repeats: int) -> dict[str, float]:
    """How much rollout and trainer work slow each other down on this host: each measured
    alone and then while the other side runs in background threads (the engine's worker and
    an event loop making env calls, as in a real run; or the trainer's worker)."""
    import threading

    import jax

    from tiderl.serving.engine import Engine
    from tiderl.serving.pages import PrefillRequest
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    t = cfg.trainer
    trajs = synthetic_trajectories(32, vocab=cfg.model.vocab_size, min_len=20, max_len=40,
                                   seed=3)
    mb = microbatches(trajs, n_ranks=1, row_len=t.row_len, rows_per_rank=t.rows_per_rank)[0][0]
    batch = be.put(mb, "actor")

    def train_op() -> None:
        ref = be.ref_forward(batch)
        o, v = be.actor_forward(batch)
        be.actor_backward(v, o, ref, batch, mb)
        jax.block_until_ready(be._grads)

    def engine(seed: int) -> Callable[[], None]:
        eng = Engine(graphdef, jax.device_put(params, device), cfg.model, cfg.rollout,
                     seed=seed)
        eng.init_decode_state()
        ids = iter(range(1 << 30))

        def op() -> None:
            hs = eng.prefill_many(None, [PrefillRequest(None, [5] * 20, 20, task_id=next(ids))
                                         for _ in range(8)])
            for h in hs:
                eng.free(h)
        return op

    fg_engine, bg_engine = engine(1), engine(2)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        return _median_time(fn, repeats)[0]

    def busy(targets: list[Callable[[], None]], fn: Callable[[], None]) -> float:
        stop = threading.Event()

        def loop(target: Callable[[], None]) -> None:
            while not stop.is_set():
                target()

        threads = [threading.Thread(target=loop, args=(x,), daemon=True) for x in targets]
        for th in threads:
            th.start()
        time.sleep(0.2)
        try:
            return timed(fn)
        finally:
            stop.set()
            for th in threads:
                th.join()

    env_loop = _env_load(cfg)
    try:
        out = {}
        for _ in range(2):  # alone, busy, alone again: drift in the machine's load shows
            alone_t, alone_e = timed(train_op), timed(fg_engine)
            out.setdefault("trainer", []).append(busy([bg_engine, env_loop], train_op) / alone_t)
            out.setdefault("rollout", []).append(busy([train_op], fg_engine) / alone_e)
    finally:
        env_loop.close()  # type: ignore[attr-defined]
    s_t, s_r = statistics.median(out["trainer"]), statistics.median(out["rollout"])
    # Processor sharing: n streams at capacity C each run at C / n, i.e. n / C times slower.
    # The trainer ran beside two streams (engine, env loop), the engine beside one (trainer).
    return {"slowdown_trainer": s_t, "slowdown_rollout": s_r,
            "capacity": statistics.fmean([3 / s_t, 2 / s_r])}


def _env_load(cfg: Any) -> Callable[[], None]:
    """A callable that makes env calls through an in-process server on its own event loop
    thread (the controller's side of a rollout); `.close()` stops it."""
    import dataclasses
    import threading

    from tiderl.envs.client import EnvClient
    from tiderl.envs.server import endpoint
    from tiderl.envs.tasks import TaskSource

    env_cfg = dataclasses.replace(cfg.env, latency=dataclasses.replace(cfg.env.latency,
                                                                       dist="none"))
    src = TaskSource.from_config(env_cfg, "train")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def setup() -> None:
        state["cm"] = endpoint(env_cfg)
        url = await state["cm"].__aenter__()
        state["client"] = EnvClient(url, env_cfg)
        await state["client"].open()
        ready.set()

    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(setup(), loop).result()
    ready.wait()
    k = iter(range(1 << 30))

    async def episode() -> None:
        env = state["client"]
        s = await env.start(src.element(next(k))["tasks"][0])
        await env.step(s.session, "1")
        await env.end(s.session)

    def call() -> None:
        asyncio.run_coroutine_threadsafe(episode(), loop).result()

    def close() -> None:
        async def down() -> None:
            await state["client"].close()
            await state["cm"].__aexit__(None, None, None)

        asyncio.run_coroutine_threadsafe(down(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        th.join()

    call.close = close  # type: ignore[attr-defined]
    return call


def calibrate(*, repeats: int, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measures and fits; returns (the profile as a dict, a report)."""
    import jax

    from tiderl.config import load_config
    from tiderl.runtime.build import build

    cfg = load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-calibrate"])
    devices, plan, meshes, graphdef, params = build(cfg)
    r = cfg.rollout
    engine_rules = {"padded": True, "prefill_buckets": list(r.prefill_buckets),
                    "decode_buckets": list(r.decode_buckets), "max_context": r.max_context,
                    "decode_steps_per_call": 1}
    tiny = model_shape("tiny")
    if (tiny.d_model, tiny.n_layers, tiny.vocab) != (cfg.model.d_model, cfg.model.n_layers,
                                                     cfg.model.vocab_size):
        raise RuntimeError("the 'tiny' sim model no longer matches the embedded default model; "
                           "update tiderl/sim/costs.py MODELS['tiny']")
    # Work formulas only need the engine rules; rates are what we fit.
    shell = Profile("shell", "fitted", {"prefill": OpCost(), "decode": OpCost()}, None,
                    profile_from_dict({"kind": "fitted", "engine": engine_rules}).engine, {})
    costs = SimCostModel(shell, tiny)
    t0 = time.perf_counter()
    eng = _engine_samples(cfg, graphdef, params, devices[plan.rollout[0][0]], costs, repeats,
                          quick)
    tr = _trainer_samples(cfg, graphdef, params, meshes, costs, repeats, quick)
    sync = _sync_times(tr["backend"], devices[plan.rollout[0][0]], cfg, graphdef, params,
                       repeats)
    host = _contention(cfg, graphdef, params, devices[plan.rollout[0][0]], tr["backend"],
                       repeats)
    tr["backend"].close()
    alone = _env_times(cfg, repeats)
    ops: dict[str, dict[str, float]] = {}
    report: dict[str, Any] = {"mape": {}, "noise": {}, "samples": {}}
    for group in (eng, tr):
        for name, samples in group["samples"].items():
            cost, mape = fit_op([(w, y) for w, y, _ in samples])
            ops[name] = {"c0": cost.c0, **dict(cost.rates)}
            report["mape"][name] = mape
            report["noise"][name] = statistics.median(group["noise"][name])
            report["samples"][name] = [{**meta, "seconds": y,
                                        "fit": predict((cost.c0, cost.rate("flops"),
                                                        cost.rate("hbm")), w)}
                                       for w, y, meta in samples]
    for name, ys in (("apply", tr["apply"]), ("weight_sync", sync)):
        cost, mape = fit_constant(ys)
        ops[name] = {"c0": cost.c0}
        report["mape"][name] = mape
        q = sorted(ys)
        report["noise"][name] = (q[(3 * len(q)) // 4] - q[len(q) // 4]) / cost.c0
    env = env_call_note(cfg, ops, engine_rules, groups=8 if quick else 16,
                        repeats=min(repeats, 3))
    env["alone_ms"] = round(statistics.median(alone) * 1e3, 4)
    ops["env_call"] = {"c0": env["seconds"]}
    # No offload on the CPU (host memory is the device memory) and no separate Ref devices.
    ops.update({"swap": {"c0": 0.0}, "role_change": {"c0": 0.0}, "context_switch": {"c0": 0.0}})
    profile = {
        "name": "cpu-fitted", "kind": "fitted",
        "engine": engine_rules, "ops": ops, "host": {"capacity": host["capacity"]},
        "notes": {
            "fitted_by": "python -m tiderl.sim.calibrate" + (" --quick" if quick else ""),
            "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": repeats,
            "jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].platform}",
            "seconds": round(time.perf_counter() - t0, 1),
            "mape": {k: round(v, 4) for k, v in report["mape"].items()},
            "noise_iqr_over_median": {k: round(v, 4) for k, v in report["noise"].items()},
            "slowdown_trainer_beside_rollout": round(host["slowdown_trainer"], 3),
            "slowdown_rollout_beside_trainer": round(host["slowdown_rollout"], 3),
            "env_call": env,
        },
    }
    return profile, report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiderl.sim.calibrate", description=__doc__
                                .split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="a small grid, 3 repeats")
    p.add_argument("--out", default=str(PROFILES / "cpu-fitted.yaml"))
    p.add_argument("--host-only", action="store_true",
                   help="re-measure only the host costs (the env call, no JAX) and update --out "
                        "in place")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 3
    if args.host_only:
        from tiderl.config import load_config

        cfg = load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-calibrate"])
        env = host_only(Path(args.out), cfg, groups=8 if args.quick else 16,
                        repeats=min(args.repeats, 5))
        print(f"env call: {env['seconds'] * 1e3:.3f} ms of event-loop CPU per call in situ "
              f"(spread {env['spread']:.0%}); wrote {args.out}")
        print(json.dumps({"profile": args.out, "env_call_s": env["seconds"],
                          "spread": env["spread"]}))
        return 0

    profile, report = calibrate(repeats=args.repeats, quick=args.quick)
    print(f"{'operation':16s} {'samples':>7s} {'MAPE':>7s} {'noise':>7s}   c0 (ms)   "
          "flops/s      bytes/s")
    for name, spec in profile["ops"].items():
        if name not in report["mape"]:
            continue
        n = len(report["samples"].get(name, [])) or "-"
        print(f"{name:16s} {n!s:>7s} {report['mape'][name]:7.1%} {report['noise'][name]:7.1%}"
              f"   {spec['c0'] * 1e3:7.3f}   {spec.get('flops', 0):10.3g}   "
              f"{spec.get('hbm', 0):10.3g}")
    write_profile(Path(args.out), profile)
    n = profile["notes"]
    print(f"shared host: trainer work {n['slowdown_trainer_beside_rollout']:.2f}x slower beside "
          f"rollout (engine + env loop), engine work {n['slowdown_rollout_beside_trainer']:.2f}x"
          f" slower beside the trainer: {profile['host']['capacity']:.2f} effective cores")
    samples = Path(args.out).with_suffix(".samples.json")
    samples.write_text(json.dumps(report["samples"], indent=1))
    print(f"wrote {args.out} (measurements and fits: {samples})")
    print(json.dumps({"profile": args.out, "host": profile["host"],
                      "mape": {k: round(v, 4) for k, v in report["mape"].items()},
                      "noise": {k: round(v, 4) for k, v in report["noise"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
