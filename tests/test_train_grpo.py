"""GRPO numerics: advantages, KL estimators, the loss and its cotangent by hand, the clip
fraction (dual clip included), seq_mean weights in O(B·T), the step normaliser against a hand
count, and the deferred-backward gradient against `jax.grad` of the fused loss and of a loss
written out here (fp32, relative L2 error ≤ 1e-6)."""

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
from tiderl.train.dispatch import TrainSequence, microbatches, pack_microbatch, seqs_with_actions
from tiderl.train.grpo import (
    LossSpec,
    _token_weights,
    cotangent,
    kl_estimate,
    loss_sum,
    normalizer,
    token_logprobs,
    token_outputs,
)
from tiderl.train.ref_actor import make_outputs
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
REL_TOL = 1e-6  # acceptance: fp32 gradients, relative L2 error of the whole gradient tree


def rel_err(a, b) -> float:
    num = sum(float(jnp.sum((x - y) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False))
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
    # The KL term k2: cotangent kl_coef·(logp − ref) = 0.5·[0, 0, 0, 0.2, 0]; the logged `kl`
    # is trainer.kl_estimator's (k1 here: Σ(logp − ref) over the mask = 0.2), a value only.
    spec = LossSpec(kl_coef=0.5, kl_loss="k2", kl_estimator="k1", is_cap=2.0, stale_loss="is")
    cot, m = cotangent(logp, ref, batch, jnp.int32(1), spec)
    # t=1: ρ=1, A=2 → −2 + 0; t=2: ρ=e^.5 > 1.2, A>0 → clipped, 0 + 0;
    # t=3: ρ=1, A=−1 → +1 + 0.1; t=4: stale (version 0 < 1): −min(ρ=1, 2)·A = −1, + 0.
    np.testing.assert_allclose(cot, [[0.0, -2.0, 0.0, 1.1, -1.0]], rtol=1e-6)
    assert int(m["clipped_tokens"]) == 1 and int(m["stale_tokens"]) == 1
    np.testing.assert_allclose(float(m["kl_sum"]), 0.2, rtol=1e-5)
    # seq_mean: two sequences (segments 1 and 2), weights 1/their action-token counts
    b2 = dict(batch, segment_ids_bt=jnp.array([[1, 1, 1, 2, 2]]))
    b2["loss_mask_bt"] = jnp.array([[0.0, 1, 1, 0, 1]])
    ref2 = ref.at[0, 2].set(-1.4)  # a KL gradient 0.5·0.4 on t=2 (weight 1/2)
    cot2, _ = cotangent(logp, ref2, b2, jnp.int32(1),
                        dataclasses.replace(spec, loss_agg="seq_mean"))
    np.testing.assert_allclose(cot2, [[0.0, -1.0, 0.1, 0.0, -1.0]], rtol=1e-6)
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


def test_clip_fraction_counts_dual_clipped_tokens():
    """A negative-advantage token whose ratio passed the dual-clip bound c has its loss capped
    at −c·A (gradient 0): the clip decides its loss, so it counts (verl's pg_clipfrac plus
    pg_clipfrac_lower); a ratio between 1 + ε_high and c with A < 0 does not (the unclipped
    term decides). Each counted fresh token is exactly one whose policy gradient is 0."""
    ratio = np.array([1.5, 0.5, 2.0, 5.0, 5.0, 1.0, 4.0, 3.5])
    adv = np.array([1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -2.0, -0.5])
    versions = np.array([1, 1, 1, 1, 1, 1, 0, 1])  # token 6 is stale (dual-clipped too)
    behav = np.full((1, 8), -1.0, np.float32)
    logp = (behav + np.log(ratio)).astype(np.float32)
    batch = {"loss_mask_bt": jnp.ones((1, 8)), "advantages_bt": jnp.asarray(adv[None]),
             "behaviour_logprobs_bt": jnp.asarray(behav),
             "segment_ids_bt": jnp.ones((1, 8), jnp.int32),
             "versions_bt": jnp.asarray(versions[None])}
    spec = LossSpec(kl_coef=0.0, clip_low=0.2, clip_high=0.28, dual_clip=3.0, stale_loss="is")
    cot, m = cotangent(jnp.asarray(logp), jnp.zeros((1, 8)), batch, jnp.int32(1), spec)
    # The reference in numpy, verl's two counts: pg_losses2 > pg_losses1 (the clip) and,
    # for A < 0, clip_pg_losses1 > pg_losses3 (the dual clip).
    pg1, pg2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.28)
    dual = (adv < 0) & (np.maximum(pg1, pg2) > -3.0 * adv)
    fresh = versions == 1
    want = ((pg2 > pg1) | dual) & fresh
    assert want.tolist() == [True, True, False, True, True, False, False, True]
    assert int(m["clipped_tokens"]) == want.sum() == 5  # the old count left out tokens 3, 7
    np.testing.assert_array_equal(np.asarray(cot[0]) == 0.0, want)  # stale 6: −min(ρ, 2)·A
    # stale_loss="clip": the stale token 6 gets the same clips, so it counts too
    _, mc = cotangent(jnp.asarray(logp), jnp.zeros((1, 8)), batch, jnp.int32(1),
                      LossSpec(kl_coef=0.0, clip_low=0.2, clip_high=0.28, dual_clip=3.0))
    assert int(mc["clipped_tokens"]) == 6


def _token_weights_quadratic(batch: dict) -> jax.Array:
    """The seq_mean weights as first written: a B×T×T same-segment mask (the reference)."""
    mask, seg = batch["loss_mask_bt"], batch["segment_ids_bt"]
    same_btt = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    count_bt = jnp.einsum("bts,bs->bt", same_btt.astype(jnp.float32), mask)
    return mask / jnp.maximum(count_bt, 1.0)


def _largest_intermediate(jaxpr) -> int:
    """Elements of the largest array any equation of `jaxpr` (and its sub-jaxprs) makes."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            best = max(best, int(np.prod(v.aval.shape)))
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if hasattr(sub, "eqns"):
                best = max(best, _largest_intermediate(sub))
    return best


def test_seq_mean_weights_are_linear_in_T_and_equal_the_quadratic_form():
    rng = np.random.default_rng(5)
    for b, t in ((1, 5), (3, 17), (4, 64)):
        seg = np.zeros((b, t), np.int32)
        for r in range(b):  # packed rows: segments 1..n of random lengths, then padding
            pos, sid = 0, 1
            while pos < t - 2 and rng.random() < 0.85:
                n = int(rng.integers(1, max(2, t // 3)))
                seg[r, pos:pos + n] = sid
                pos, sid = pos + n, sid + 1
        mask = ((rng.random((b, t)) < 0.6) & (seg > 0)).astype(np.float32)
        mask[0, seg[0] == 1] = 0.0  # a sequence with no action token
        batch = {"loss_mask_bt": jnp.asarray(mask), "segment_ids_bt": jnp.asarray(seg)}
        got = _token_weights(batch, "seq_mean")
        np.testing.assert_array_equal(got, _token_weights_quadratic(batch))  # exact counts
        # each sequence with an action token sums to 1: Σ w = sequences with actions
        rows, cols = np.nonzero(mask)
        n_seqs = len(set(zip(rows.tolist(), seg[rows, cols].tolist(), strict=True)))
        np.testing.assert_allclose(float(got.sum()), n_seqs, rtol=1e-6)
    # O(B·T): no intermediate of the B×T×T size the quadratic form builds (B = 4, T = 64)
    jaxpr = jax.make_jaxpr(lambda x: _token_weights(x, "seq_mean"))(batch).jaxpr
    assert _largest_intermediate(jaxpr) <= 2 * b * (t + 1)
    assert _largest_intermediate(jax.make_jaxpr(_token_weights_quadratic)(batch).jaxpr) == b * t * t


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


def test_loss_and_cotangent_by_hand_b2_t3():
    """The GRPO + KL loss of a 2×3 batch written out token by token (numpy, float64) against
    the deferred path (`cotangent`: the loss sum, its metrics and ∂L/∂logp). ε = 0.2, dual
    clip c = 3, kl_coef = 0.1 with the default trainer.kl_loss (k3's value, k2's gradient).
    fp32 against float64: rtol 1e-6."""
    logp = np.array([[0.0, -1.0, -0.5], [0.0, -2.0, -0.2]])
    behav = np.array([[0.0, -1.1, -0.9], [0.0, -3.5, -0.3]])  # ρ = e^.1, e^.4; e^1.5, e^.1
    ref = np.array([[0.0, -1.2, -0.4], [0.0, -1.5, -0.6]])
    adv = np.array([[0.0, 1.0, 1.0], [0.0, -2.0, -2.0]])
    mask = np.array([[0.0, 1, 1], [0.0, 1, 1]])
    e = np.exp
    # (0,1): ρ = e^.1 inside [0.8, 1.2]: −ρA.        (0,2): ρ = e^.4 > 1.2, A > 0: −1.2·A.
    # (1,1): ρ = e^1.5 > c, A < 0: capped at −c·A = 6. (1,2): ρ = e^.1 inside: −ρA = 2e^.1.
    pg = np.array([[0.0, -e(0.1), -1.2], [0.0, 6.0, 2 * e(0.1)]])
    d_pg = np.array([[0.0, -e(0.1), 0.0], [0.0, 0.0, 2 * e(0.1)]])  # clipped tokens: 0
    d = ref - logp  # k3 = e^d − d − 1; its k2-form gradient is logp − ref = −d
    per_tok = pg + 0.1 * (e(d) - d - 1)
    loss_sum_hand = float((mask * per_tok).sum())
    cot_hand = mask * (d_pg + 0.1 * -d)
    batch = {"loss_mask_bt": mask, "advantages_bt": adv, "behaviour_logprobs_bt": behav,
             "segment_ids_bt": np.ones((2, 3), np.int32), "versions_bt": np.ones((2, 3))}
    batch = {k: jnp.asarray(v, jnp.int32 if k.endswith("ids_bt") or k.startswith("versions")
                            else jnp.float32) for k, v in batch.items()}
    spec = LossSpec.from_config(TrainerConfig(kl_coef=0.1, dual_clip=3.0))
    cot, m = cotangent(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32), batch,
                       jnp.int32(1), spec)
    np.testing.assert_allclose(float(m["loss_sum"]), loss_sum_hand, rtol=1e-6)
    np.testing.assert_allclose(float(m["pg_sum"]), float((mask * pg).sum()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cot), cot_hand, rtol=1e-6, atol=1e-7)
    assert int(m["clipped_tokens"]) == 2 and int(m["action_tokens"]) == 4
    # the step loss: token_mean over the 4 action tokens; seq_mean over the 2 sequences
    assert normalizer(4, 2, "token_mean") == 4.0 and normalizer(4, 2, "seq_mean") == 2.0
    seq = dataclasses.replace(spec, loss_agg="seq_mean")
    cot_s, m_s = cotangent(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32),
                           batch, jnp.int32(1), seq)
    seq_loss_hand = np.mean((mask * per_tok).sum(axis=1) / mask.sum(axis=1))  # one seq a row
    np.testing.assert_allclose(float(m_s["loss_sum"]) / 2, seq_loss_hand, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cot_s), cot_hand / 2, rtol=1e-6, atol=1e-7)


def _hand_fused_loss(outs, ref, b, *, clip, dual_clip, kl_coef, entropy_coef):
    """Σ_t mask_t·ℓ_t written independently of grpo.loss_sum: PPO clip, dual clip, the KL
    term in its gradient form ½(logp − ref)² (k3_reverse's gradient is k2's) and the
    entropy bonus; stale tokens take the same clip (stale_loss='clip', the default)."""
    logp, ent = outs
    on = b["loss_mask_bt"] > 0
    lp, rf = jnp.where(on, logp, 0.0), jnp.where(on, ref, 0.0)
    ratio = jnp.exp(lp - jnp.where(on, b["behaviour_logprobs_bt"], 0.0))
    a = b["advantages_bt"]
    pg = jnp.maximum(-ratio * a, -jnp.clip(ratio, 1 - clip, 1 + clip) * a)
    pg = jnp.where(a < 0, jnp.minimum(pg, -dual_clip * a), pg)
    per_tok = pg + kl_coef * 0.5 * (lp - rf) ** 2 - entropy_coef * ent
    return jnp.sum(jnp.where(on, per_tok, 0.0))


def test_deferred_gradient_equals_jax_grad_of_a_hand_written_loss(policy):
    """The deferred backward (Actor vjp applied to grpo's cotangent) against `jax.grad` of a
    loss written out in this test (not grpo.loss_sum) through the same policy forward:
    fp32, relative L2 error of the whole gradient tree ≤ REL_TOL."""
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.2, dual_clip=3.0, clip_low=0.1,
                        clip_high=0.1, entropy_coef=0.05)
    be, mbs = _setup(policy, cfg, 10, seed=3)
    b = be.put(mbs[0], "actor")
    ref = be.ref_forward(b)
    lp, vjp = be.actor_forward(b)
    cot, m = cotangent(lp, ref, b, jnp.int32(be.version), be.spec)
    grads = be.k.actor_backward(vjp, cot)
    outputs = make_outputs(be.graphdef, be.temperature)
    hand = jax.jit(jax.grad(lambda p: _hand_fused_loss(
        outputs(p, b), ref, b, clip=0.1, dual_clip=3.0, kl_coef=0.2, entropy_coef=0.05)))
    want = hand(be.state["params"])
    assert 0 < int(m["clipped_tokens"]) and float(m["kl_sum"]) > 0
    err = rel_err(grads, want)
    print(f"deferred vs jax.grad of the hand-written loss: relative L2 error {err:.2e}")
    assert err <= REL_TOL


def _hand_microbatch() -> tuple[list, int, int]:
    """Four sequences packed by hand: rank 0 holds sequences 0, 1, 2 in one row (segments
    1-3), rank 1 sequence 3; ranks 2 and 3 are padding rows. Sequence 1 has no action token.
    Returns (micro-batches, action tokens, sequences with an action token) counted by hand."""
    def seq(uid, mask, adv):
        mask = np.asarray(mask, bool)
        return TrainSequence(uid, np.arange(1, len(mask) + 1, dtype=np.int32) + uid, mask,
                             np.full(len(mask), -1.5, np.float32), adv, 1)

    trajs = [seq(0, [0, 0, 1, 1, 1], 1.0), seq(1, [0, 0, 0, 0], -1.0),
             seq(2, [0, 1, 0, 1, 1, 1, 1], -0.5), seq(3, [0, 0, 1, 0], 2.0)]
    mb = pack_microbatch(trajs, [[0, 1, 2], [3], [], []], row_len=64)
    assert mb.segment_ids_bt[0].max() == 3 and mb.tokens_bt.shape == (4, 64)
    return [mb], 3 + 0 + 5 + 1, 3


def test_step_normaliser_against_a_hand_count(policy):
    """The divisor of the step, per agg mode, against a hand count: token_mean divides by the
    9 action tokens, seq_mean by the 3 sequences that have one (not the 4 sequences, not the
    rows). A per-token loss of exactly 1 (A = −1, ρ = 1, no KL) then averages to exactly 1."""
    mbs, n_tok, n_seq = _hand_microbatch()
    mb = mbs[0]
    assert (mb.n_action_tokens, seqs_with_actions(mb), mb.n_seqs) == (n_tok, n_seq, 4)
    ones = {k: jnp.asarray(v) for k, v in mb.arrays().items()}
    ones["advantages_bt"] = -jnp.asarray(mb.loss_mask_bt)
    for agg, want in (("token_mean", n_tok), ("seq_mean", n_seq)):
        assert normalizer(mb.n_action_tokens, seqs_with_actions(mb), agg) == want
        spec = LossSpec(kl_coef=0.0, loss_agg=agg)
        total, _ = loss_sum(ones["behaviour_logprobs_bt"], jnp.zeros((4, 64)), ones,
                            jnp.int32(1), spec)
        assert float(total) / want == pytest.approx(1.0, abs=1e-6)
        # ... and the backend divides its accumulated gradient by that same count
        cfg = TrainerConfig(actor_devices=4, kl_coef=0.1, loss_agg=agg)
        be = TrainerBackend(cfg, TINY, actor_mesh=make_mesh(jax.devices()[:4], data=2, fsdp=2),
                            temperature=0.8, policy=policy)
        be.version = 1
        b = be.put(mb, "actor")
        lp, vjp = be.actor_forward(b)
        be.actor_backward(vjp, lp, be.ref_forward(b), b, mb)
        assert be.apply()["denom"] == want
        be.close()


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
