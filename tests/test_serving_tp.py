"""A tensor-parallel rollout rank (rollout.devices_per_rank=2): the engine runs SPMD over its
two-device cell (heads, MLP and vocabulary on the 'model' axis, KV pools on kv heads) and
samples the same tokens with the same logprobs as on one device.

Tolerance (fp32): logprobs 1e-5; tokens equal.
"""

import dataclasses

import jax
import numpy as np
import pytest

from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.models.sharding import make_mesh, state_shardings
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine

MODEL = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, qkv_bias=True, tie_embeddings=False)
# One decode and one prefill bucket: each costs a compile per engine on a 2-core box.
ROLLOUT = RolloutConfig(page_size=4, num_pages=96, max_slots=4, max_context=96,
                        max_action_tokens=6, decode_buckets=(4,), prefill_buckets=(16,))


def _play(eng: Engine, prompts: list[list[int]], observations: list[list[int]]):
    """Three tasks, two turns each (the second appends an observation to resident KV; with a
    host KV tier, to KV evicted after the first turn and copied back)."""
    state = eng.init_decode_state()
    hs = [eng.prefill(None, None, np.asarray(p), len(p), task_id=10 + i)
          for i, p in enumerate(prompts)]
    for h in hs:
        state = eng.insert(h, state)
    while any(h.decoding for h in hs):
        state, _ = eng.generate(None, state)
    turn1 = [(list(h.action_tokens), list(h.logprobs)) for h in hs]
    if eng.host_kv is not None:
        for h in hs:
            eng.evict(h)
    for h, obs in zip(hs, observations, strict=True):
        eng.prefill(None, h, np.asarray(obs), len(obs))
        state = eng.insert(h, state)
    while any(h.decoding for h in hs):
        state, _ = eng.generate(None, state)
    return turn1, [(list(h.action_tokens), list(h.logprobs)) for h in hs], hs


def test_two_device_rank_samples_what_one_device_samples():
    graphdef, params = init_policy(MODEL, seed=0)
    rng = np.random.default_rng(0)
    # Larger weights than the init: a peaked model whose samples depend on every parameter.
    params = jax.tree.map(lambda x: x + (0.2 * rng.standard_normal(x.shape)).astype(np.float32),
                          params)
    prompts = [rng.integers(1, 96, n).tolist() for n in (5, 11, 3)]
    obs = [rng.integers(1, 96, n).tolist() for n in (4, 2, 9)]

    one = Engine(graphdef, jax.device_put(params, jax.devices()[0]), MODEL, ROLLOUT, seed=1)
    cell = make_mesh(jax.devices()[2:4], model=2)
    sharded = jax.device_put(params, state_shardings(jax.eval_shape(lambda: params), cell))
    tp = Engine(graphdef, sharded, MODEL, ROLLOUT, seed=1)
    assert tp.mesh is cell and tp.device is None
    # Heads really are split: a q projection and the KV pools live half on each device.
    q = next(x for p, x in jax.tree_util.tree_leaves_with_path(sharded)
             if "q_proj" in jax.tree_util.keystr(p) or "wq" in jax.tree_util.keystr(p))
    assert len({s.data.shape for s in q.addressable_shards}) == 1
    assert q.addressable_shards[0].data.size == q.size // 2

    a1, a2, _ = _play(one, prompts, obs)
    b1, b2, hs = _play(tp, prompts, obs)
    pools = tp.state.pools.k[0]
    assert {s.device for s in pools.addressable_shards} == set(cell.devices.flat)
    assert pools.addressable_shards[0].data.shape[0] == MODEL.n_kv_heads // 2
    for (ta, la), (tb, lb) in zip(a1 + a2, b1 + b2, strict=True):
        assert ta == tb
        np.testing.assert_allclose(lb, la, atol=1e-5, rtol=0)
    assert all(len(t) for t, _ in b2)
    # Kernels compiled once per bucket on the cell, as on one device.
    assert max(tp.trace_counts.values()) == 1

    # A host KV tier on the cell: the evicted pages go to pinned host memory laid out as the
    # pools (kv heads split over the cell) and come back; the same tokens and logprobs.
    tier = Engine(graphdef, sharded, MODEL, dataclasses.replace(ROLLOUT, host_kv_pages=64),
                  seed=1)
    c1, c2, hs = _play(tier, prompts, obs)
    for (ta, la), (tc, lc) in zip(a1 + a2, c1 + c2, strict=True):
        assert ta == tc
        np.testing.assert_allclose(lc, la, atol=1e-5, rtol=0)
    assert tier.counters.host_restores == 3 and tier.counters.recomputed_evicted == 0
    tier.evict(hs[0])
    kv = tier.host_kv.lookup(hs[0], tier.version, hs[0].tokens).kv
    assert kv.sharding.memory_kind == "pinned_host"
    assert {s.device for s in kv.addressable_shards} == set(cell.devices.flat)
    assert kv.addressable_shards[0].data.shape[2] == MODEL.n_kv_heads // 2

    # A weight sync keeps the cell's layout; another layout is refused (it would recompile).
    tp.update_weights(jax.device_put(params, state_shardings(jax.eval_shape(lambda: params),
                                                            cell)), version=1)
    assert tp.version == 1
    with pytest.raises(ValueError, match="sharding"):
        tp.update_weights(jax.device_put(params, jax.devices()[2]), version=2)
