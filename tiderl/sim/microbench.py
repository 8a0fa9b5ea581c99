"""Micro-benchmarks of the real engine and trainer on this machine: the timings that
`tiderl.sim.calibrate` fits into the `cpu-fitted` profile.

Each measurement is a median over repeats after a warm-up (the machine is shared, so single
timings are noisy; the spread of the repeats is returned as the noise), its work computed by
`tiderl.sim.costs` exactly as the simulator computes it:

- `engine_samples`: engine `prefill_many` over (rows, new tokens, cached prefix) and
  `generate` over (rows, context);
- `sample_samples`: siblings sampled from a sibling's logits (prefix sharing) over the number
  of siblings;
- `trainer_samples`: trainer Ref forward, Actor forward, Actor backward over micro-batch sizes,
  and the update;
- `sync_times`: a weight sync (export, copy to the rollout device, `update_weights`);
- `env_times`: one env call alone, through the in-process HTTP server;
- `contention`: how much rollout and trainer work slow each other down on this host.

This module imports JAX inside its functions only (the package stays JAX-free).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from tiderl.sim.costs import SimCostModel

Probe = Callable[[], float] | None
"""The machine's speed now (`tiderl.sim.speed.SpeedProbe`), timed right after each sample so
the calibration can put every sample at one speed; None: not probed."""


def _probed(probe: Probe) -> dict[str, float]:
    return {"probe_s": probe()} if probe is not None else {}


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


def engine_samples(cfg: Any, graphdef: Any, params: Any, device: Any, costs: SimCostModel,
                   repeats: int, quick: bool, probe: Probe = None) -> dict[str, list]:
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
                out["prefill"].append((costs.prefill_work(rows), med, {
                    "rows": b, "new": new, "cached": cached, **_probed(probe)}))
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
            out["decode"].append(([w], med, {"rows": b, "context": ctx, **_probed(probe)}))
            noise["decode"].append(spread)
    return {"samples": out, "noise": noise}


def sample_samples(cfg: Any, graphdef: Any, params: Any, device: Any,
                   repeats: int) -> list[tuple[int, float]]:
    """(siblings, seconds) of sampling siblings' first tokens from the logits of the one that
    computed: `prefill_many` of `n + 1` rows of one new prompt (GRPO siblings, `share` set:
    one row computes, `n` follow) less the same call of one row, medians over repeats."""
    import jax

    from tiderl.serving.engine import Engine
    from tiderl.serving.pages import PrefillRequest

    eng = Engine(graphdef, jax.device_put(params, device), cfg.model, cfg.rollout, seed=0)
    eng.init_decode_state()
    ids, prompts = iter(range(1 << 30)), iter(range(1 << 30))
    vocab = cfg.model.vocab_size

    def group(n: int) -> None:
        k = next(prompts)  # a new context every call: nothing is kept from an earlier one
        toks = [3 + (k * 7 + i) % (vocab - 3) for i in range(24)]
        reqs = [PrefillRequest(None, toks, len(toks), task_id=next(ids), share=[])
                for _ in range(n)]
        for h in eng.prefill_many(None, reqs):
            eng.free(h)

    out = []
    for n in (1, 3, 7, 15):
        if n + 1 > eng.cfg.max_slots:
            break
        group(1), group(n + 1)  # warm-up (compiles the buckets)
        one = _median_time(lambda: group(1), repeats)[0]
        many = _median_time(lambda n=n: group(n + 1), repeats)[0]
        out.append((n, max(0.0, many - one)))
    return out


def _decode_keep(eng: Any) -> None:
    """One decode step; rows that stopped are put back, so every step decodes the same rows."""
    eng.generate(None, eng.state)
    for h in eng.state.slots:
        if h is not None and h.slot is not None and not h.decoding:
            h.stop_reason = type(h.stop_reason).NONE
            h.action_start = len(h.tokens) - 1
            h.decoding = True


def trainer_samples(cfg: Any, graphdef: Any, params: Any, meshes: dict, costs: SimCostModel,
                    repeats: int, quick: bool, probe: Probe = None) -> dict[str, list]:
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
                                         "rows": mb.tokens_bt.shape[0], **_probed(probe)}))
            noise[name].append(spread)
        ts = sorted(act_b() for _ in range(repeats))
        med = statistics.median(ts)
        w = costs.train_work([lens], row_len=t.row_len, backward=True)
        out["actor_backward"].append(([w], med, {"seqs": len(lens), "tokens": sum(lens),
                                                 "rows": mb.tokens_bt.shape[0],
                                                 **_probed(probe)}))
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


def sync_times(be: Any, engine_device: Any, cfg: Any, graphdef: Any, params: Any,
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


def env_times(cfg: Any, repeats: int) -> list[float]:
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


def contention(cfg: Any, graphdef: Any, params: Any, device: Any, be: Any,
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
