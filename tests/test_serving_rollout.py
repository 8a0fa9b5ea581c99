"""Rollout ranks + episode runner end to end: real engines, a real env server on loopback."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.server import endpoint
from tiderl.envs.tasks import TaskSource
from tiderl.envs.templates import template_for
from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.config import RolloutConfig, kv_budget_tokens
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager

pytestmark = pytest.mark.asyncio

MODEL = ModelConfig(vocab_size=272, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    mlp_dim=64)
TEMPERATURE = 1.0


def rollout_cfg(**kw) -> RolloutConfig:
    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    base = dict(num_pages=64, page_size=8, max_slots=8, max_context=256, max_action_tokens=4,
                temperature=TEMPERATURE, decode_buckets=(8,), prefill_buckets=(16, 64),
                stop_tokens=tuple(sorted(tmpl.stop_ids)))
    return RolloutConfig(**{**base, **kw})


class FlakyEngine(Engine):
    """Raises on its `fail_at`-th decode step: a device failure mid-step."""

    fail_at = 10**9

    def generate(self, params, decode_state):
        self.fail_at -= 1
        if self.fail_at <= 0:
            raise RuntimeError("injected device failure")
        return super().generate(params, decode_state)


def build(n_ranks: int, rcfg: RolloutConfig, engine_cls=Engine):
    graphdef, params = init_policy(MODEL, seed=0)
    engines = [engine_cls(graphdef, jax.device_put(params, jax.devices()[i]), MODEL, rcfg,
                          seed=123) for i in range(n_ranks)]
    return graphdef, params, engines


async def play(engines, rcfg, *, scheduler="ctb", groups=3, group_size=4, ctb=None):
    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    ranks = [RolloutRank(i, e) for i, e in enumerate(engines)]
    for r in ranks:
        await r.start()
    cap = kv_budget_tokens(rcfg)  # as a job budgets a rank: its pool and its host tier
    sched = make_scheduler(scheduler, ctb or CTBConfig(action_reserve=rcfg.max_action_tokens),
                           [cap] * len(ranks), max_context=rcfg.max_context)
    src = TaskSource("default", "train", groups=groups, group_size=group_size)
    try:
        async with endpoint(EnvConfig()) as url, EnvClient(url) as env:
            mgr = RolloutManager(ranks, sched, env, tmpl, max_turns=4)
            trajs = await asyncio.gather(*(mgr.run_group(src.element(k))
                                           for k in range(groups)))
    finally:
        for r in ranks:
            await r.close()
    return [t for g in trajs for t in g], mgr


def full_logprobs(graphdef, params, tokens):
    from flax import nnx

    model = nnx.merge(graphdef, params)
    t = jnp.asarray(tokens)[None]
    logits, _ = model(t, jnp.arange(t.shape[1])[None], jnp.ones_like(t))
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32) / TEMPERATURE, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, t[0, 1:, None], -1)[:, 0])


async def test_every_task_ends_and_trajectories_are_what_the_engine_produced():
    rcfg = rollout_cfg()
    graphdef, params, engines = build(2, rcfg)
    trajs, mgr = await play(engines, rcfg)
    assert len(trajs) == 12 and len({t.task_id for t in trajs}) == 12
    for t in trajs:
        assert t.end_reason in (EndReason.done, EndReason.turn_limit, EndReason.context_limit)
        assert t.reward in (0.0, 1.0)
        assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert sum(t.loss_mask) >= t.turns
        # Token in, token out: a trainer-side forward over the trajectory's ids reproduces the
        # engine's behaviour logprobs on every action token (fp32, 1e-4 whole-model tolerance).
        ref = full_logprobs(graphdef, params, t.tokens)
        mask = np.asarray(t.loss_mask[1:], bool)
        got = np.asarray(t.logprobs[1:])[mask]
        assert np.max(np.abs(got - ref[mask])) < 1e-4
        assert all(v == 0 for v, m in zip(t.versions, t.loss_mask, strict=True) if m)
    stats = mgr.stats()
    assert stats["prompt_tokens"] > 0 and stats["cached_tokens"] > 0
    assert stats["decisions"]["admit"] == 12
    # Every decode is one device round at least; the rounds' seconds are the engines' busy time.
    assert stats["engine_steps"] >= sum(r.stats.decode_steps for r in mgr.ranks) > 0
    assert stats["engine_busy_s"] == pytest.approx(sum(r.stats.busy_s for r in mgr.ranks))


@pytest.mark.parametrize("scheduler", ["ctb", "vanilla"])
async def test_a_burst_of_events_gets_one_scheduling_round(monkeypatch, scheduler):
    # Every turn's end and every env answer asks for a round (`kick`); those that need no
    # decision at once share one round per event-loop iteration.
    from tiderl.serving.ctb import CTBScheduler, VanillaScheduler

    cls = CTBScheduler if scheduler == "ctb" else VanillaScheduler
    counts = {"kicks": 0, "rounds": 0}
    kick, schedule = RolloutManager.kick, cls.schedule

    def counted_kick(self, **kw):
        counts["kicks"] += 1
        kick(self, **kw)

    def counted_schedule(self):
        counts["rounds"] += 1
        return schedule(self)

    monkeypatch.setattr(RolloutManager, "kick", counted_kick)
    monkeypatch.setattr(cls, "schedule", counted_schedule)
    rcfg = rollout_cfg()
    _, _, engines = build(1, rcfg)
    trajs, mgr = await play(engines, rcfg, scheduler=scheduler, groups=2, group_size=4)
    assert len(trajs) == 8 and all(t.ok for t in trajs)
    assert mgr.stats()["decisions"]["admit"] == 8
    # Four tasks a turn end in one decode batch, and the env answers of tasks whose rank is
    # within budget need no round before their turn: at most half as many rounds as kicks
    # (measured: 20 of 58 with CTB, 9 of 58 with vanilla; one round per kick before).
    assert 0 < counts["rounds"] <= counts["kicks"] / 2, counts


async def test_a_scheduler_that_raises_fails_the_rollout_with_its_error(monkeypatch):
    # A scheduling round runs on its own (not inside the episode that asked for it): a
    # scheduler bug must still end the rollout with its error, not leave tasks waiting.
    from tiderl.serving.ctb import CTBScheduler
    from tiderl.serving.rollout import RolloutFailedError

    schedule, calls = CTBScheduler.schedule, [0]

    def broken(self):
        calls[0] += 1
        if calls[0] > 3:
            raise KeyError("injected scheduler bug")
        return schedule(self)

    monkeypatch.setattr(CTBScheduler, "schedule", broken)
    rcfg = rollout_cfg()
    _, _, engines = build(1, rcfg)
    with pytest.raises(RolloutFailedError, match="CTBScheduler.*injected scheduler bug"):
        await asyncio.wait_for(play(engines, rcfg, groups=2, group_size=4), timeout=120)


async def test_vanilla_under_memory_pressure_evicts_and_still_finishes():
    rcfg = rollout_cfg(num_pages=12, max_slots=4, decode_buckets=(4,))
    _, _, engines = build(1, rcfg)
    trajs, mgr = await play(engines, rcfg, scheduler="vanilla", groups=2, group_size=4,
                            ctb=CTBConfig(vanilla_concurrency=8))
    assert len(trajs) == 8
    assert all(t.ok for t in trajs)
    assert mgr.stats()["forced_evictions"] > 0


async def test_failed_rank_is_quarantined_and_its_tasks_finish_elsewhere():
    rcfg = rollout_cfg()
    graphdef, params, engines = build(2, rcfg, engine_cls=FlakyEngine)
    engines[1].fail_at = 3
    trajs, mgr = await play(engines, rcfg, groups=2, group_size=4)
    assert 1 in mgr.sched.dead
    assert len(trajs) == 8 and all(t.ok for t in trajs), [t.end_reason for t in trajs]
    assert mgr.stats()["decisions"]["migrate"] > 0
    for t in trajs:  # migrated tasks re-prefilled elsewhere: still the engine's own logprobs
        ref = full_logprobs(graphdef, params, t.tokens)
        mask = np.asarray(t.loss_mask[1:], bool)
        assert np.max(np.abs(np.asarray(t.logprobs[1:])[mask] - ref[mask])) < 1e-4


async def test_pause_keeps_kv_and_resume_on_same_rank_hits():
    rcfg = rollout_cfg()
    _, _, engines = build(1, rcfg)
    rank = RolloutRank(0, engines[0])
    await rank.start()
    tok = ByteTokenizer()
    r1 = await rank.turn(7, tok.encode("hello there"))
    rank.pause(7)
    r2 = await rank.turn(7, tok.encode(" again"))
    assert r1.cached_tokens == 0 and r2.cached_tokens >= len("hello there")
    h = await rank.release(7)
    moved = h.prefix
    assert moved is not None and moved.slot is None and h.unfed is None and h.result is None
    with pytest.raises(ValueError, match="has ended"):
        rank.turn(7, [], moved)  # a finished action needs the next observation
    n = len(moved.tokens)
    r3 = await rank.turn(7, tok.encode(" ok"), moved)
    # Everything is recomputed on adoption: the whole old context plus the new tokens.
    assert r3.cached_tokens == 0 and r3.computed_tokens == r3.prompt_tokens == n + 3
    assert rank.failed is None
    await rank.close()


async def test_weight_sync_of_the_same_version_mid_action_keeps_decoding():
    """A sync that flushes nothing (the version the KV already has, as a rank rejoining with
    the weights it holds) arrives while actions decode and another task's prefill runs in the
    same engine step: the decoding actions continue where they are (they were once marked for
    a fresh prefill while the engine kept decoding them, and the step's decode found slots it
    did not know: KeyError, the rank quarantined). The tokens equal a run without the sync."""
    rcfg = rollout_cfg(max_action_tokens=12, stop_tokens=())
    tok = ByteTokenizer()

    async def play(sync: bool) -> dict[int, list[int]]:
        _, _, engines = build(1, rcfg)
        eng = engines[0]
        rank = RolloutRank(0, eng)
        rank._state = eng.init_decode_state()  # driven step by step here, no loop
        futs = {tid: rank.turn(tid, tok.encode(f"task {tid} says hi")) for tid in (1, 2)}
        done = dict(rank._device_step([], [1, 2], dict(rank.tasks))[0])
        assert not done and all(rank.tasks[t].decoding for t in (1, 2))
        futs[3] = rank.turn(3, tok.encode("task 3 starts"))
        ops = [("weights", (eng.params, eng.version, None))] if sync else []
        done.update(rank._device_step(ops, [3], dict(rank.tasks))[0])
        while len(done) < 3:
            done.update(rank._device_step([], [], dict(rank.tasks))[0])
        for f in futs.values():
            f.cancel()
        return {tid: r.action_tokens for tid, r in done.items()}

    assert await play(True) == await play(False)


async def test_sibling_prefix_sharing_prefills_a_groups_prompt_once():
    # A step of groups of G=8 on two ranks, with room for every context (no eviction): with
    # sharing on, the prompt of each group is computed once; the other G-1 siblings take
    # its pages and sample their first token from its logits. Everything after the prompt is
    # computed alike, and sampling is keyed by (task, position), so the saving is exactly
    # (G-1) prompts per group and the trajectories are the same.
    g = 8
    rcfg = rollout_cfg(max_action_tokens=4)
    tmpl = template_for(ByteTokenizer(), "byte")
    src = TaskSource("default", "train", groups=2, group_size=g)
    groups = [src.element(k) for k in range(2)]
    runs = {}
    for share in (False, True):
        graphdef, params, engines = build(2, rcfg)
        ranks = [RolloutRank(i, e, share_prefixes=share) for i, e in enumerate(engines)]
        for r in ranks:
            await r.start()
        ctb = CTBConfig(action_reserve=4, vanilla_concurrency=2 * g, shared_prompts=share,
                        budget_fraction=1.0)
        sched = make_scheduler("ctb", ctb, [rcfg.num_pages * rcfg.page_size] * 2,
                               max_context=rcfg.max_context, max_tasks_per_rank=rcfg.max_slots,
                               page_size=rcfg.page_size)
        async with endpoint(EnvConfig()) as url, EnvClient(url) as env:
            mgr = RolloutManager(ranks, sched, env, tmpl, max_turns=2)
            out = await asyncio.gather(*(mgr.run_group(gr) for gr in groups))
        for r in ranks:
            await r.close()
        runs[share] = ([t for gr in out for t in gr], mgr.stats())
    (off, s_off), (on, s_on) = runs[False], runs[True]
    assert s_off["forced_evictions"] == s_on["forced_evictions"] == 0
    prompt = off[0].loss_mask.index(1)  # the first prefill: everything before the action
    assert all(t.loss_mask.index(1) == prompt for t in off)
    first = len(groups) * g * prompt  # prompt tokens the step's first turns needed
    saved = s_off["computed_tokens"] - s_on["computed_tokens"]
    assert saved >= (g - 1) / g * first
    assert saved == len(groups) * (g - 1) * prompt  # exact: one prompt per group computed
    assert s_on["shared_tokens"] == saved
    by_id = {t.task_id: t for t in off}
    for t in on:
        assert t.tokens == by_id[t.task_id].tokens, t.task_id
        np.testing.assert_allclose(t.logprobs, by_id[t.task_id].logprobs, atol=1e-5, rtol=0)
    ref = full_logprobs(graphdef, params, on[0].tokens)  # and they are the model's (1e-4)
    mask = np.asarray(on[0].loss_mask[1:], bool)
    assert np.max(np.abs(np.asarray(on[0].logprobs[1:])[mask] - ref[mask])) < 1e-4


@pytest.mark.parametrize("scheduler", ["vanilla", "ctb"])
async def test_host_kv_tier_under_memory_pressure_restores_instead_of_recomputing(scheduler):
    """Two ranks with a tight pool and a host KV tier (`rollout.host_kv_pages`): evicted
    contexts come back from the host, nothing evicted is computed again, and every task plays
    exactly the tokens it plays without the tier (sampling keys are (task, position))."""
    kw = dict(num_pages=12, max_slots=4, decode_buckets=(4,))
    ctb = CTBConfig(vanilla_concurrency=8, action_reserve=4)
    plain_cfg, tier_cfg = rollout_cfg(**kw), rollout_cfg(**kw, host_kv_pages=256)
    graphdef, params, plain = build(2, plain_cfg)
    plain_trajs, plain_mgr = await play(plain, plain_cfg, scheduler=scheduler, groups=2,
                                        group_size=4, ctb=ctb)
    _, _, tier = build(2, tier_cfg)
    trajs, mgr = await play(tier, tier_cfg, scheduler=scheduler, groups=2, group_size=4,
                            ctb=ctb)
    assert len(trajs) == 8 and all(t.ok for t in trajs)
    assert {t.task_id: t.tokens for t in trajs} == {t.task_id: t.tokens for t in plain_trajs}
    stats = mgr.stats()
    assert plain_mgr.stats()["restored_tokens"] == 0
    assert stats["restored_tokens"] > 0
    assert sum(r.stats.recomputed_evicted for r in mgr.ranks) == 0
    assert stats["computed_tokens"] < plain_mgr.stats()["computed_tokens"]
    for t in trajs:
        ref = full_logprobs(graphdef, params, t.tokens)
        mask = np.asarray(t.loss_mask[1:], bool)
        assert np.max(np.abs(np.asarray(t.logprobs[1:])[mask] - ref[mask])) < 1e-4
    for e in tier:
        e.pages.check()
