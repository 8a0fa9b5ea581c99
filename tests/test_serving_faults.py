"""Rollout under pressure and faults: real engines on fake CPU devices, a real env server on
loopback. Tight KV pools with slow environments, engine failures mid-turn, moves across weight
syncs, and task ids whose sampling ids collide."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from test_serving_rollout import build, full_logprobs, rollout_cfg

from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig, LatencyConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.server import endpoint
from tiderl.envs.tasks import TaskSource
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.pages import StopReason
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager, numeric_id

pytestmark = pytest.mark.asyncio

SLOW_ENV = EnvConfig(latency=LatencyConfig(dist="pareto", scale_s=0.01, alpha=1.5, cap_s=0.3))


async def run_groups(engines, rcfg, groups, *, scheduler="ctb", env_cfg=None,
                     ctb=None, max_turns=4):
    tmpl = template_for(ByteTokenizer(), "byte")
    env_cfg = env_cfg or EnvConfig()
    ranks = [RolloutRank(i, e) for i, e in enumerate(engines)]
    for r in ranks:
        await r.start()
    cap = rcfg.num_pages * rcfg.page_size
    sched = make_scheduler(scheduler, ctb or CTBConfig(action_reserve=rcfg.max_action_tokens),
                           [cap] * len(ranks), max_context=rcfg.max_context,
                           max_tasks_per_rank=rcfg.max_slots)
    try:
        async with endpoint(env_cfg) as url, EnvClient(url, env_cfg) as env:
            mgr = RolloutManager(ranks, sched, env, tmpl, max_turns=max_turns)
            out = await asyncio.gather(*(mgr.run_group(g) for g in groups))
    finally:
        for r in ranks:
            await r.close()
    return [t for g in out for t in g], mgr


def assert_engine_logprobs(graphdef, params, trajs):
    """Token in, token out: a trainer-side forward over each trajectory's ids reproduces its
    behaviour logprobs on every action token (fp32 whole-model tolerance 1e-4)."""
    for t in trajs:
        ref = full_logprobs(graphdef, params, t.tokens)
        mask = np.asarray(t.loss_mask[1:], bool)
        assert np.max(np.abs(np.asarray(t.logprobs[1:])[mask] - ref[mask])) < 1e-4, t.task_id


def groups_of(n: int, size: int, split: str = "train"):
    src = TaskSource("default", split, groups=n, group_size=size)
    return [src.element(k) for k in range(n)]


@pytest.mark.parametrize("n_ranks,scheduler", [(2, "ctb"), (4, "ctb"), (2, "vanilla")])
async def test_tight_kv_slow_env_multi_rank_every_task_finishes(n_ranks, scheduler):
    # A pool of 12 pages × 8 tokens holds about two contexts of the default task: CTB pauses
    # and resumes tasks across ranks all the time while their env calls are slow and uneven.
    rcfg = rollout_cfg(num_pages=12, max_slots=4, decode_buckets=(4,), max_action_tokens=4)
    graphdef, params, engines = build(n_ranks, rcfg)
    ctb = CTBConfig(action_reserve=4, vanilla_concurrency=6)
    trajs, mgr = await run_groups(engines, rcfg, groups_of(6, 4), scheduler=scheduler,
                                  env_cfg=SLOW_ENV, ctb=ctb)
    assert len(trajs) == 24 and all(t.ok for t in trajs), [(t.end_reason, t.error)
                                                           for t in trajs if not t.ok]
    assert_engine_logprobs(graphdef, params, trajs)
    s = mgr.stats()
    assert s["tasks_submitted"] == s["tasks_ended"] == 24 and s["tasks_live"] == 0
    assert not mgr.episodes
    if scheduler == "ctb":
        assert s["decisions"]["pause"] > 0  # the pool really was tight


class PrefillFault(Engine):
    """The device call of a prefill on a task's second turn (or later) raises, once."""

    armed = False

    def _run(self, fn, rows, *a, **k):
        if self.armed and fn is self._prefill_fn and any(h.computed_max > 0 for h in rows):
            self.armed = False
            raise RuntimeError("injected device failure in prefill")
        return super()._run(fn, rows, *a, **k)


async def test_prefill_failure_on_a_later_turn_migrates_the_task_intact():
    rcfg = rollout_cfg(max_action_tokens=4)
    groups = groups_of(2, 4)
    graphdef, params, engines = build(2, rcfg)
    clean, _ = await run_groups(engines, rcfg, groups)
    _, _, engines = build(2, rcfg, engine_cls=PrefillFault)
    engines[1].armed = True
    faulty, mgr = await run_groups(engines, rcfg, groups)
    assert not engines[1].armed and 1 in mgr.sched.dead  # the fault fired and was handled
    assert all(t.ok for t in faulty)
    # Sampling is keyed by (task, position) and the env is deterministic: the trajectories
    # equal a fault-free run's, token for token (the observation is not appended twice).
    by_id = {t.task_id: t for t in clean}
    for t in faulty:
        assert t.tokens == by_id[t.task_id].tokens, t.task_id
        assert t.loss_mask == by_id[t.task_id].loss_mask
    assert_engine_logprobs(graphdef, params, faulty)


async def test_a_move_across_a_weight_sync_keeps_each_tokens_version():
    rcfg = rollout_cfg(max_action_tokens=8, stop_tokens=())
    graphdef, params, engines = build(2, rcfg)
    a, b = engines
    a.init_decode_state()
    prompt = ByteTokenizer().encode("guess a number")
    h = a.prefill(None, None, prompt, len(prompt), task_id=5)
    state = a.insert(h, a.state)
    for _ in range(2):
        state, _ = a.generate(None, state)
    assert len(h.action_tokens) == 3 and not h.done and h.versions == [0, 0, 0]
    moved = dataclasses.replace(h, tokens=list(h.tokens), logprobs=list(h.logprobs),
                                versions=list(h.versions), slot=None, kv_length=0,
                                decoding=False)
    rank = RolloutRank(1, b)
    await rank.start()
    await rank.update_weights(jax.device_put(params, jax.devices()[1]), 1)
    r = await rank.turn(9, [], moved)  # continue the action on the new weights
    await rank.close()
    assert r.action_tokens[:3] == h.action_tokens and len(r.action_tokens) == 8
    assert r.versions == [0, 0, 0] + [1] * 5


class DecodeFaultWith(Engine):
    """`generate` raises while the handle of task `target` sits resident in a slot."""

    target = -1

    def generate(self, params, decode_state):
        if any(s is not None and s.task_id == self.target for s in self.state.slots):
            raise RuntimeError("injected device failure in decode")
        return super().generate(params, decode_state)


async def test_a_turn_that_finished_before_its_rank_failed_is_handed_over():
    # Task 1 fills its context at prefill (its action ends there, CONTEXT_LIMIT); task 2 is
    # decoding, and the decode of that same engine step fails: task 1's finished turn was never
    # delivered and must come back with the task, not be replayed as an empty turn.
    rcfg = rollout_cfg(max_context=64, max_action_tokens=32, stop_tokens=())
    _, _, engines = build(1, rcfg, engine_cls=DecodeFaultWith)
    eng = engines[0]
    eng.target = 101
    rank = RolloutRank(0, eng)
    await rank.start()
    second = rank.turn(2, [65] * 8, sample_id=102)
    await asyncio.sleep(0)
    first = rank.turn(1, [66] * 63, sample_id=101)
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert rank.failed is not None and all(isinstance(r, Exception) for r in results)
    h = await rank.release(1)
    assert h.result is not None and h.unfed is None
    assert h.result.stop_reason == StopReason.CONTEXT_LIMIT and len(h.result.action_tokens) == 1
    assert h.prefix.tokens[-1] == h.result.action_tokens[0]
    h2 = await rank.release(2)  # mid-action: continues elsewhere with nothing unfed
    assert h2.result is None and h2.prefix is not None and not h2.prefix.done
    await rank.close()


async def test_task_ids_whose_sampling_ids_collide_stay_separate():
    assert numeric_id("collide-989") == numeric_id("collide-2116060")
    rcfg = rollout_cfg()
    graphdef, params, engines = build(1, rcfg)
    groups = groups_of(2, 2)
    for g, new in zip(groups, ("collide-989", "collide-2116060"), strict=True):
        g["tasks"][0] = {**g["tasks"][0], "task_id": new}
    trajs, mgr = await run_groups(engines, rcfg, groups)
    assert len(trajs) == 4 and all(t.ok for t in trajs)
    assert {t.task_id for t in trajs} >= {"collide-989", "collide-2116060"}
    assert_engine_logprobs(graphdef, params, trajs)
    assert not mgr.episodes and not mgr.ranks[0].tasks


async def test_an_episode_cut_by_the_servers_turn_cap_ends_at_its_turn_limit():
    rcfg = rollout_cfg()
    _, _, engines = build(1, rcfg)
    trajs, _ = await run_groups(engines, rcfg, groups_of(2, 4), env_cfg=EnvConfig(max_turns=2),
                                max_turns=4)
    assert all(t.turns <= 2 for t in trajs)
    cut = [t for t in trajs if t.turns == 2 and t.reward < 1.0]
    assert cut and all(t.end_reason == EndReason.turn_limit for t in cut), \
        [(t.turns, t.reward, t.end_reason) for t in cut]


class DeadOnArrival(Engine):
    """Every engine call raises, from the allocation of its pools on."""

    def init_decode_state(self):
        raise RuntimeError("injected: device lost")


async def test_a_rank_that_fails_to_start_is_quarantined_and_the_rest_carry_on():
    rcfg = rollout_cfg()
    graphdef, params, engines = build(2, rcfg)
    engines[1].__class__ = DeadOnArrival
    trajs, mgr = await run_groups(engines, rcfg, groups_of(2, 4))
    assert all(t.ok for t in trajs) and 1 in mgr.sched.dead
    assert_engine_logprobs(graphdef, params, trajs)


async def test_a_weight_sync_never_waits_on_a_failed_rank():
    rcfg = rollout_cfg()
    graphdef, params, engines = build(1, rcfg, engine_cls=DecodeFaultWith)
    engines[0].target = 7
    rank = RolloutRank(0, engines[0])
    await rank.start()
    with pytest.raises(RuntimeError):  # the injected failure, or the quarantine it causes
        await rank.turn(1, [65] * 8, sample_id=7)
    assert rank.failed is not None
    # The sync after a quarantine: the rank's loop is gone, nothing would ever answer.
    await asyncio.wait_for(rank.update_weights(params, 1), timeout=30)
    await rank.close()
