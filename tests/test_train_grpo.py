"""GRPO numerics: advantages, KL estimators, the loss cotangent, and the deferred-backward
gradient against `jax.grad` of the fused loss (fp32, relative L2 error ≤ 1e-6)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.models.sharding import make_mesh
from tiderl.train.advantages import group_advantages
from tiderl.train.backend import TrainerBackend
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.grpo import LossSpec, cotangent, kl_estimate, token_logprobs, token_outputs
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
REL_TOL = 1e-6  # acceptance: fp32 gradients, relative L2 error of the whole gradient tree


def rel_err(a, b) -> float:
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False))
    den = sum(float(jnp.sum(y ** 2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def test_group_advantages_and_zero_variance_policy():
    out = group_advantages([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0], [3.0]], eps=0.0, zero_var="drop")
    std = np.std([1, 0, 1, 0], ddof=1)
    np.testing.assert_allclose(out.advantages[0], np.array([0.5, -0.5, 0.5, -0.5]) / std,
                               rtol=1e-6)
    assert out.keep.tolist() == [True, False, False] and out.n_zero_var == 2
    kept = group_advantages([[2.0, 2.0]], zero_var="keep")
    assert kept.keep.tolist() == [True] and kept.n_zero_var == 1
    np.testing.assert_array_equal(kept.advantages[0], [0.0, 0.0])
    with pytest.raises(ValueError, match="NaN"):
        group_advantages([[1.0, float("nan")]])


def test_kl_estimators():
    logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    d = logp - ref
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), d, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), 0.5 * d * d, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), np.exp(-d) + d - 1, rtol=1e-6)
    assert float(kl_estimate(logp, logp, "k3").sum()) == 0.0


def test_cotangent_by_hand():
    """Inside the clip range the PG cotangent is −ρA·w; clipped tokens get only the KL term."""
    logp = jnp.array([[0.0, -1.0, -1.0, -1.0, -1.0]])
    behav = jnp.array([[0.0, -1.0, -1.5, -1.0, -1.0]])  # ρ = 1, e^0.5, 1, 1
    ref = jnp.array([[0.0, -1.0, -1.0, -1.2, -1.0]])
    batch = {"loss_mask_bt": jnp.array([[0.0, 1, 1, 1, 1]]),
             "advantages_bt": jnp.array([[0.0, 2, 2, -1, 1]]),
             "behaviour_logprobs_bt": behav, "segment_ids_bt": jnp.ones((1, 5), jnp.int32),
             "versions_bt": jnp.array([[0, 1, 1, 1, 0]])}
    spec = LossSpec(kl_coef=0.5, kl_estimator="k1", is_cap=2.0, stale_loss="is")
    cot, m = cotangent(logp, ref, batch, jnp.int32(1), spec)
    # t=1: ρ=1, A=2 → −2 + 0.5; t=2: ρ=e^.5 > 1.2, A>0 → clipped, 0 + 0.5;
    # t=3: ρ=1, A=−1 → +1 + 0.5; t=4: stale (version 0 < 1): −min(ρ=1, 2)·A = −1, + 0.5.
    np.testing.assert_allclose(cot, [[0.0, -1.5, 0.5, 1.5, -0.5]], rtol=1e-6)
    assert int(m["clipped_tokens"]) == 1 and int(m["stale_tokens"]) == 1
    # seq_mean: two sequences (segments 1 and 2), weights 1/their action-token counts
    b2 = dict(batch, segment_ids_bt=jnp.array([[1, 1, 1, 2, 2]]))
    b2["loss_mask_bt"] = jnp.array([[0.0, 1, 1, 0, 1]])
    cot2, _ = cotangent(logp, ref, b2, jnp.int32(1), dataclasses.replace(spec, loss_agg="seq_mean"))
    np.testing.assert_allclose(cot2, [[0.0, -0.75, 0.25, 0.0, -0.5]], rtol=1e-6)
    # dual clip caps a negative-advantage token's loss at −c·A (gradient 0 beyond it)
    big = dict(batch, behaviour_logprobs_bt=logp - 3.0)  # ρ = e³ ≈ 20 ≫ c = 3
    cot3, _ = cotangent(logp, ref, big, jnp.int32(0),
                        LossSpec(kl_coef=0.0, dual_clip=3.0, use_versions=False))
    assert float(cot3[0, 3]) == 0.0
    # the entropy bonus −c·H_t: cotangent −c on each action token's entropy, logprobs' unchanged
    ent = jnp.array([[9.0, 1.0, 2.0, 0.5, 1.5]])
    (cot4, cot4_ent), m4 = cotangent((logp, ent), ref, batch, jnp.int32(1),
                                     dataclasses.replace(spec, entropy_coef=0.1))
    np.testing.assert_allclose(cot4, cot, rtol=1e-6)
    np.testing.assert_allclose(cot4_ent, -0.1 * batch["loss_mask_bt"], rtol=1e-6)
    assert float(m4["entropy_sum"]) == 5.0
    # capped bonus −c·min(H_t, 1.2): no push on the tokens already spread past the cap
    (_, cot5_ent), _ = cotangent((logp, ent), ref, batch, jnp.int32(1),
                                 dataclasses.replace(spec, entropy_coef=0.1, entropy_max=1.2))
    np.testing.assert_allclose(cot5_ent, -0.1 * batch["loss_mask_bt"] * (ent < 1.2), rtol=1e-6)


def test_clip_fraction_counts_only_clips_that_decide_the_loss():
    """verl's pg_clipfrac: a token counts when the clipped term is the larger loss — ratio
    above 1 + ε_high with A > 0, below 1 − ε_low with A < 0; a ratio out of range on the
    other side (the min picks the unclipped term) or a stale token does not count."""
    ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.0, 1.5, 1.5])
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, 0.0, 1.0])
    versions = np.array([1, 1, 1, 1, 1, 1, 0])  # the last token is stale (version 0 < 1)
    behav = np.full((1, 7), -1.0, np.float32)
    logp = (behav + np.log(ratio)).astype(np.float32)
    batch = {"loss_mask_bt": jnp.ones((1, 7)), "advantages_bt": jnp.asarray(adv[None]),
             "behaviour_logprobs_bt": jnp.asarray(behav),
             "segment_ids_bt": jnp.ones((1, 7), jnp.int32),
             "versions_bt": jnp.asarray(versions[None])}
    _, m = cotangent(jnp.asarray(logp), jnp.zeros((1, 7)), batch, jnp.int32(1),
                     LossSpec(kl_coef=0.0, clip_low=0.2, clip_high=0.28, stale_loss="is"))
    # The reference: verl's torch.gt(pg_losses2, pg_losses) on the fresh tokens, in numpy.
    clipped = np.clip(ratio, 0.8, 1.28)
    ref = ((-adv * clipped > -adv * ratio) & (versions == 1)).sum()
    assert ref == 2 and int(m["clipped_tokens"]) == ref  # tokens 0 (A>0, high), 3 (A<0, low)
    # stale_loss="clip": the stale token gets the same clip, so it counts too (ρ=1.5, A>0)
    _, mc = cotangent(jnp.asarray(logp), jnp.zeros((1, 7)), batch, jnp.int32(1),
                      LossSpec(kl_coef=0.0, clip_low=0.2, clip_high=0.28, stale_loss="clip"))
    assert int(mc["clipped_tokens"]) == 3 and int(mc["stale_tokens"]) == 1


def test_stale_loss_clip_gives_stale_tokens_the_fresh_tokens_clip():
    """A stale token whose ratio moved past the clip in its advantage's direction gets no
    policy gradient under 'clip'; under 'is' its cotangent is −min(ρ, is_cap)·A."""
    logp = jnp.array([[0.0, -1.0, -1.0, -1.0]])
    behav = jnp.array([[0.0, -1.5, -0.5, -1.0]])  # ρ = e^0.5 ≈ 1.65, e^-0.5 ≈ 0.61, 1
    batch = {"loss_mask_bt": jnp.array([[0.0, 1, 1, 1]]),
             "advantages_bt": jnp.array([[0.0, 1.0, -1.0, -1.0]]),
             "behaviour_logprobs_bt": behav, "segment_ids_bt": jnp.ones((1, 4), jnp.int32),
             "versions_bt": jnp.array([[0, 0, 0, 0]])}  # all stale at trainer version 1
    spec = LossSpec(kl_coef=0.0, is_cap=2.0, stale_loss="is")
    cot_is, _ = cotangent(logp, jnp.zeros((1, 4)), batch, jnp.int32(1), spec)
    cot_clip, _ = cotangent(logp, jnp.zeros((1, 4)), batch, jnp.int32(1),
                            dataclasses.replace(spec, stale_loss="clip"))
    r = np.exp(np.array([0.5, -0.5, 0.0]))
    # is: −min(ρ, 2)·A; clip: token 1 (ρ > 1.2, A > 0) and token 2 (ρ < 0.8, A < 0) clipped
    # to 0, token 3 (ρ = 1) −ρA.
    np.testing.assert_allclose(cot_is[0, 1:], -np.minimum(r, 2.0) * np.array([1, -1, -1]),
                               rtol=1e-6)
    np.testing.assert_allclose(cot_clip[0, 1:], [0.0, 0.0, 1.0], rtol=1e-6)


def test_token_logprobs_shift_and_temperature():
    logits = jax.random.normal(jax.random.key(0), (1, 4, 7))
    tokens = jnp.array([[3, 1, 6, 2]])
    lp = token_logprobs(logits, tokens, 0.7)
    want = jax.nn.log_softmax(logits[0, :-1] / 0.7)[jnp.arange(3), tokens[0, 1:]]
    np.testing.assert_allclose(lp[0, 1:], want, rtol=1e-6)
    assert float(lp[0, 0]) == 0.0
    lp2, ent = token_outputs(logits, tokens, 0.7)
    np.testing.assert_allclose(lp2, lp, rtol=1e-6)
    p = jax.nn.softmax(logits[0, :-1] / 0.7)
    np.testing.assert_allclose(ent[0, 1:], -(p * jnp.log(p)).sum(-1), rtol=1e-5)
    assert float(ent[0, 0]) == 0.0


@pytest.fixture(scope="module")
def policy():
    return init_policy(TINY, seed=0)


def _setup(policy, cfg, n_traj, seed):
    devs = jax.devices()
    mesh = make_mesh(devs[:4], data=2, fsdp=2)
    graphdef, params = policy
    # A Ref that differs from the Actor, so the KL term and its gradient are not zero.
    ref = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(7), x.shape), params)
    be = TrainerBackend(cfg, TINY, actor_mesh=mesh, temperature=0.8, policy=policy,
                        ref_params=ref)
    be.version = 1  # version-0 tokens are stale: truncated-IS weights on
    trajs = synthetic_trajectories(n_traj, vocab=64, min_len=6, max_len=30, seed=seed,
                                   versions=(0, 1))
    mbs, _ = microbatches(trajs, n_ranks=4, row_len=64, rows_per_rank=1)
    rng = np.random.default_rng(seed)
    out = []
    for mb in mbs:  # behaviour logprobs near the actor's, so some tokens clip and some do not
        lp = be.logprobs(mb)
        noisy = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32) * mb.loss_mask_bt
        out.append(dataclasses.replace(mb, behaviour_logprobs_bt=noisy))
    return be, out


def test_deferred_gradient_equals_fused_jax_grad(policy):
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.2, dual_clip=3.0, clip_low=0.1, clip_high=0.1,
                        entropy_coef=0.05, entropy_max=4.1)
    be, mbs = _setup(policy, cfg, 10, seed=3)
    b = be.put(mbs[0], "actor")
    assert b["segment_ids_bt"].max() > 1  # packed: several sequences per row
    ref = be.ref_forward(b)
    lp, vjp = be.actor_forward(b)
    cot, m = cotangent(lp, ref, b, jnp.int32(be.version), be.spec)
    grads = be.k.actor_backward(vjp, cot)
    fused = be.k.fused_grads(be.state["params"], [b], [ref], jnp.int32(be.version))
    n = float(m["action_tokens"])
    assert 0 < int(m["clipped_tokens"]) < n and 0 < int(m["stale_tokens"]) < n
    assert float(m["kl_sum"]) > 0
    err = rel_err(grads, fused)
    print(f"deferred vs fused gradient: relative L2 error {err:.2e}")
    assert err <= REL_TOL


def test_accumulated_microbatches_equal_full_batch_gradient(policy):
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.1, loss_agg="seq_mean", kl_estimator="k2")
    be, mbs = _setup(policy, cfg, 40, seed=4)
    assert len(mbs) >= 3
    batches = [be.put(mb, "actor") for mb in mbs]
    refs = []
    for mb, b in zip(mbs, batches, strict=False):
        ref = be.ref_forward(b)
        refs.append(ref)
        lp, vjp = be.actor_forward(b)
        be.actor_backward(vjp, lp, ref, b, mb)
    fused = be.k.fused_grads(be.state["params"], batches, refs, jnp.int32(be.version))
    err = rel_err(be._grads, fused)
    print(f"accumulated over {len(mbs)} micro-batches vs full batch: relative L2 error {err:.2e}")
    assert err <= REL_TOL


def test_padding_with_extreme_logprobs_gives_finite_cotangent():
    logp = jnp.array([[0.0, -2.0, -900.0]])  # position 2 is padding with an absurd logprob
    ref = jnp.array([[0.0, -2.1, -1.0]])
    batch = {"loss_mask_bt": jnp.array([[0.0, 1, 0]]), "advantages_bt": jnp.array([[0.0, 1, 0]]),
             "behaviour_logprobs_bt": jnp.array([[0.0, -2.0, 0]]),
             "segment_ids_bt": jnp.array([[1, 1, 0]]), "versions_bt": jnp.zeros((1, 3), jnp.int32)}
    cot, _ = cotangent(logp, ref, batch, jnp.int32(0), LossSpec(kl_coef=1.0))
    assert bool(jnp.all(jnp.isfinite(cot))) and float(cot[0, 2]) == 0.0
