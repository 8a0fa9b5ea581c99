"""The RA2P backend on 8 fake CPU devices: decoupled (separate Ref and Actor meshes) and
colocated (aggregation, offload to pinned_host) steps equal the fused `jax.grad` step; swap
counts; the async entry point; compile-once; a learning smoke test."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.models.sharding import make_mesh
from tiderl.train.backend import TrainerBackend
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import TrainSequence, microbatches
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
PARAM_ATOL = 1e-6  # fp32 params after one AdamW step (lr 1e-3) from gradients equal to ~1e-7
MOMENT_RTOL = 1e-5  # AdamW mu / nu after one step: relative L2 error of the whole tree (fp32)


@pytest.fixture(scope="module")
def policy():
    return init_policy(TINY, seed=0)


@pytest.fixture(scope="module")
def meshes():
    devs = jax.devices()
    assert len(devs) == 8
    return make_mesh(devs[:4], data=2, fsdp=2), make_mesh(devs[4:], data=4)


def _mbs(n=24, seed=0):
    trajs = synthetic_trajectories(n, vocab=64, min_len=6, max_len=30, seed=seed,
                                   versions=(0, 1))
    return microbatches(trajs, n_ranks=4, row_len=64, rows_per_rank=1)[0]


def _rel_err(a, b) -> float:
    num = sum(float(np.sum((np.asarray(x) - np.asarray(y)) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    den = sum(float(np.sum(np.asarray(y) ** 2)) for y in jax.tree.leaves(b))
    assert den > 0
    return (num / den) ** 0.5


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False))


CFG = TrainerConfig(actor_devices=4, kl_coef=0.1, dual_clip=3.0)


def test_decoupled_and_colocated_equal_fused_step(policy, meshes):
    actor, ref = meshes
    mbs = _mbs()
    assert len(mbs) >= 2
    fused = TrainerBackend(CFG, TINY, actor_mesh=actor, ref_mesh=ref, policy=policy)
    fused.version = 1
    fused.fused_step(mbs)
    dec = TrainerBackend(CFG, TINY, actor_mesh=actor, ref_mesh=ref, policy=policy)
    dec.version = 1
    m_dec = dec.train_step(mbs)
    col_cfg = dataclasses.replace(CFG, offload="always", aggregate=True)
    col = TrainerBackend(col_cfg, TINY, actor_mesh=actor, policy=policy)
    col.version = 1
    m_col = col.train_step(mbs)
    assert m_dec["mode"] == "decoupled" and m_col["mode"] == "colocated"
    assert m_col["offload"] and not m_dec["offload"]
    assert m_dec["stale_frac"] > 0 and m_dec["microbatches"] == len(mbs)
    d_dec = _max_diff(dec.state["params"], fused.state["params"])
    d_col = _max_diff(col.state["params"], fused.state["params"])
    print(f"max |Δparam| vs fused: decoupled {d_dec:.1e}, colocated {d_col:.1e}")
    assert d_dec <= PARAM_ATOL and d_col <= PARAM_ATOL
    assert _max_diff(dec.state["opt"], fused.state["opt"]) <= PARAM_ATOL
    assert _max_diff(col.state["opt"], fused.state["opt"]) <= PARAM_ATOL
    # The AdamW moments, each relative to its own size. After one step the params moved by
    # ≈ lr·sign(g) whatever g's scale, so a gradient off by a constant factor (a wrong step
    # normaliser, a micro-batch counted twice) leaves them equal; μ = (1 − b1)·g and
    # ν = (1 − b2)·g² are not (and ν's entries, ~g²/1000, sit far below PARAM_ATOL).
    adam = {name: be.state["opt"][1][0] for name, be in
            (("fused", fused), ("decoupled", dec), ("colocated", col))}
    errs = {f"{a} vs {b}": (_rel_err(adam[a].mu, adam[b].mu), _rel_err(adam[a].nu, adam[b].nu))
            for a, b in (("decoupled", "fused"), ("colocated", "fused"),
                         ("decoupled", "colocated"))}
    print("AdamW moments, relative L2 error (mu, nu):",
          {k: f"{m:.1e}, {n:.1e}" for k, (m, n) in errs.items()})
    assert all(m <= MOMENT_RTOL and n <= MOMENT_RTOL for m, n in errs.values()), errs
    assert all(int(a.count) == 1 for a in adam.values())
    assert m_dec["grad_norm"] < CFG.grad_clip  # unclipped: the moments see the normaliser
    # Ref really lives on its own devices; the Actor state (moments too) is sharded as pinned.
    ref_devs = {d for x in jax.tree.leaves(dec.ref_params) for d in x.sharding.device_set}
    act_devs = {d for x in jax.tree.leaves(dec.state) for d in x.sharding.device_set}
    assert ref_devs == set(ref.devices.flat) and act_devs == set(actor.devices.flat)
    emb = dec.state["params"]["embed_vd"][...]
    mu = dec.state["opt"][1][0].mu["embed_vd"][...]
    assert emb.sharding.spec == mu.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    # colocated with offload: after the step the idle Ref sits in pinned host memory
    assert col.where == {"actor": "device", "ref": "host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(col.ref_params)} == {"pinned_host"}
    for be in (fused, dec, col):
        be.close()


def test_alternation_vs_aggregation_swaps(policy, meshes):
    actor, _ = meshes
    mbs = _mbs(seed=1)
    k = len(mbs)
    out = {}
    for name, agg, off in (("VS", False, "never"), ("VSO", False, "always"),
                           ("CM", True, "always")):
        be = TrainerBackend(dataclasses.replace(CFG, aggregate=agg, offload=off), TINY,
                            actor_mesh=actor, policy=policy)
        out[name] = (be.train_step(mbs), be.state["params"])
        be.close()
    assert out["VS"][0]["swaps"] == 0 and out["VS"][0]["alternations"] == 2 * k
    assert out["VSO"][0]["swaps"] == 4 * k - 1  # every phase change moves both models
    assert out["CM"][0]["swaps"] == 3 and out["CM"][0]["alternations"] == 2
    assert _max_diff(out["VSO"][1], out["CM"][1]) <= PARAM_ATOL


def test_no_kl_term_skips_the_ref(policy, meshes):
    """kl_coef = 0: no Ref forward runs (none traced, no Ref phase or swap) and the update equals
    the fused step's, whose loss has no KL term either."""
    actor, ref = meshes
    mbs = _mbs()
    cfg = dataclasses.replace(CFG, kl_coef=0.0, offload="always")
    fused = TrainerBackend(cfg, TINY, actor_mesh=actor, policy=policy)
    fused.version = 1
    fused.fused_step(mbs)
    for ref_mesh in (None, ref):
        be = TrainerBackend(cfg, TINY, actor_mesh=actor, ref_mesh=ref_mesh, policy=policy)
        be.version = 1
        traced = be.k.traces.get("ref_forward", 0)
        m = be.train_step(mbs)
        assert be.k.traces.get("ref_forward", 0) == traced == 0
        # offload: the idle Ref moves to host once and stays there (with a KL term: 3 swaps)
        assert m["kl"] == 0.0 and m["swaps"] <= 1 and m["alternations"] <= 1
        assert _max_diff(be.state["params"], fused.state["params"]) <= PARAM_ATOL
        be.close()
    fused.close()


def test_async_submit_and_compile_once(policy, meshes):
    actor, ref = meshes
    be = TrainerBackend(CFG, TINY, actor_mesh=actor, ref_mesh=ref, policy=policy)
    mbs = _mbs(seed=2)

    async def run():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        for mb in mbs:
            be.submit(mb)  # returns at once: device work is on the worker thread
        metrics = await be.finish_step_async()
        done.set()
        await t
        return metrics, ticks

    m1, ticks = asyncio.run(run())
    assert ticks > 1 and m1["version"] == 1  # the loop kept running while the step trained
    traces = dict(be.k.traces)
    exported = be.export_weights()  # for the rollout sync: must outlive the donated state
    before = np.asarray(exported["embed_vd"][...])
    m2 = be.train_step(mbs)
    np.testing.assert_array_equal(np.asarray(exported["embed_vd"][...]), before)
    assert not np.array_equal(np.asarray(be.state["params"]["embed_vd"][...]), before)
    assert be.k.traces == traces  # same shape buckets: nothing retraced
    assert m2["version"] == 2 and set(m2) >= {"time_wait", "time_ref", "time_actor_fwd",
                                              "time_actor_bwd", "time_swap", "step_time"}
    be.close()


def test_errors_surface_from_finish_step(policy, meshes):
    actor, _ = meshes
    be = TrainerBackend(CFG, TINY, actor_mesh=actor, policy=policy)
    with pytest.raises(RuntimeError, match="no submitted micro-batch"):
        be.finish_step()
    bad = _mbs(seed=3)[0]
    bad = dataclasses.replace(bad, **{k: v[:3] for k, v in bad.arrays().items()})
    be.submit(bad)
    with pytest.raises(ValueError, match="not divisible"):
        be.finish_step()
    be.close()


def test_learning_raises_positive_lowers_negative(policy, meshes):
    """Fixed synthetic batch, on-policy behaviour logprobs, repeated steps."""
    actor, _ = meshes
    be = TrainerBackend(CFG, TINY, actor_mesh=actor, policy=policy)
    adv = np.array([1.0, -1.0] * 4)
    trajs = synthetic_trajectories(8, vocab=64, min_len=10, max_len=20, seed=5, advantages=adv)
    (mb,), _ = microbatches(trajs, n_ranks=4, row_len=64, rows_per_rank=1)
    pos = (mb.advantages_bt > 0) & (mb.loss_mask_bt > 0)
    neg = (mb.advantages_bt < 0) & (mb.loss_mask_bt > 0)
    lp0 = be.logprobs(mb)
    lp = lp0
    for _ in range(8):
        be.train_step([dataclasses.replace(mb, behaviour_logprobs_bt=lp * mb.loss_mask_bt)])
        lp = be.logprobs(mb)
    d_pos, d_neg = float((lp - lp0)[pos].mean()), float((lp - lp0)[neg].mean())
    print(f"mean token logprob change: positive {d_pos:+.3f}, negative {d_neg:+.3f}")
    assert d_pos > 0.05 and d_neg < -0.05
    be.close()


def test_advise_mode_and_switch_modes(policy, meshes):
    actor, ref = meshes
    be = TrainerBackend(CFG, TINY, actor_mesh=actor, ref_mesh=ref, policy=policy)
    be._cost_ema = {"ref": 1.0, "actor_fwd": 1.0, "actor_bwd": 2.0, "swap": 1.0}
    assert be.advise_mode([0.0] * 8).mode == "decoupled"
    assert be.advise_mode([20.0, 60.0, 100.0]).mode == "colocated"
    be.set_ref_mesh(None)  # follow the advice between steps: the Ref joins the Actor's devices
    assert be.mode == "colocated"
    assert {d for x in jax.tree.leaves(be.ref_params) for d in x.sharding.device_set} == \
        set(actor.devices.flat)
    assert be.train_step(_mbs(seed=6))["mode"] == "colocated"
    be.set_ref_mesh(ref)
    assert be.train_step(_mbs(seed=6))["mode"] == "decoupled"
    be.close()


def test_trajectory_type_is_host_only():
    t = TrainSequence(0, np.arange(1, 5, dtype=np.int32), np.array([0, 1, 1, 1], bool),
                   np.zeros(4, np.float32), 1.0)
    assert t.length == 4


def test_nonfinite_gradient_skips_the_update(policy, meshes):
    backend = TrainerBackend(CFG, TINY, actor_mesh=meshes[0], policy=policy)
    before = jax.device_get(backend.state)
    mbs = _mbs(n=8, seed=3)
    poisoned = dataclasses.replace(mbs[0], advantages_bt=np.full_like(mbs[0].advantages_bt,
                                                                      np.nan))
    m = backend.train_step([poisoned])
    assert m["skipped"] is True and not np.isfinite(m["grad_norm"])
    after = jax.device_get(backend.state)
    assert _max_diff(before["params"], after["params"]) == 0.0
    assert _max_diff(before["opt"], after["opt"]) == 0.0
    m = backend.train_step(mbs[:1])  # and the next finite step updates as usual
    assert m["skipped"] is False and _max_diff(before["params"], jax.device_get(
        backend.state)["params"]) > 0
    backend.close()
