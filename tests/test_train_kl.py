"""The KL term of the GRPO loss, checked by what its gradient optimises.

A softmax policy π_θ over 5 actions (logits θ) and a fixed reference π_ref: the expected
gradient of a per-token loss term ℓ(logπ(a), logπ_ref(a)) over tokens a ~ π, with the sample
held fixed (no score-function term: how the loss is used in training), is taken exactly by
enumeration, Σ_a π(a)·∇_θ ℓ(logπ_θ(a)), and compared with `jax.grad` of the exact
KL(π‖π_ref) (reverse) and KL(π_ref‖π) (forward). fp32 throughout: ABS_TOL bounds the max
absolute error of a 5-entry gradient whose largest entry is ~0.2; the two KL gradients differ
by 0.12 there, so a form matching the wrong one misses by four orders of magnitude.
"""

from typing import get_args, get_type_hints

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl.configlib import ConfigError, apply_overrides, from_dict
from tiderl.train.config import TrainerConfig
from tiderl.train.grpo import KL_LOSSES, LossSpec, cotangent, kl_estimate, kl_loss_term, loss_sum

ABS_TOL = 1e-5  # measured: ≤ 3e-8 for every form below (fp32)

THETA = jnp.array([0.3, -1.2, 0.8, 0.1, -0.4])
REF_LOGITS = jnp.array([-0.5, 0.2, 1.1, -1.0, 0.6])
REF_LOGP = jax.nn.log_softmax(REF_LOGITS)


def reverse_kl(theta):
    logp = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(logp) * (logp - REF_LOGP))


def forward_kl(theta):
    logp = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(REF_LOGP) * (REF_LOGP - logp))


def expected_grad(term):
    """Σ_a π(a)·∇_θ term(logπ_θ(a), logπ_ref(a)): the weights π(a) held fixed (the sample)."""

    def surrogate(theta):
        logp = jax.nn.log_softmax(theta)
        return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * term(logp, REF_LOGP))

    return jax.grad(surrogate)(THETA)


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)))


@pytest.fixture(scope="module")
def exact():
    g_rev, g_fwd = jax.grad(reverse_kl)(THETA), jax.grad(forward_kl)(THETA)
    assert max_err(g_rev, g_fwd) > 0.1  # the two directions are far apart at this θ
    return g_rev, g_fwd


def test_each_kl_loss_form_has_the_gradient_its_name_says(exact):
    g_rev, g_fwd = exact
    errs = {}
    for form, want in (("k2", g_rev), ("k3_reverse", g_rev), ("k3_forward", g_fwd)):
        errs[form] = max_err(expected_grad(lambda lp, r, f=form: kl_loss_term(lp, r, f)), want)
    # k1 as a loss: E[∇(logπ − logπ_ref)] = Σ π ∇logπ = 0, it regularises nothing
    errs["k1"] = max_err(expected_grad(lambda lp, r: kl_estimate(lp, r, "k1")), 0 * g_rev)
    # ... and the naive k3 descends the forward KL, not the reverse one
    naive = expected_grad(lambda lp, r: kl_estimate(lp, r, "k3"))
    print("max |E[∇ℓ] − target|:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(v <= ABS_TOL for v in errs.values()), errs
    assert max_err(naive, g_rev) > 0.1


def test_k3_reverse_keeps_k3s_value():
    logp, ref = jnp.array([-1.0, -2.0, -0.3]), jnp.array([-1.5, -1.0, -0.3])
    np.testing.assert_array_equal(kl_loss_term(logp, ref, "k3_reverse"),
                                  kl_estimate(logp, ref, "k3"))
    np.testing.assert_array_equal(kl_loss_term(logp, ref, "k2"), kl_estimate(logp, ref, "k2"))
    with pytest.raises(ValueError, match="trainer.kl_loss"):
        kl_loss_term(logp, ref, "k1")


def _enumerated_batch(theta):
    """One row: t = 0 a prompt token, t = 1..5 the five actions (logprobs under π_θ and π_ref),
    advantage 0 and behaviour = π_θ, so the loss is the KL term alone."""
    logp = jnp.pad(jax.nn.log_softmax(theta), (1, 0))[None]
    ref = jnp.pad(REF_LOGP, (1, 0))[None]
    batch = {"loss_mask_bt": jnp.array([[0.0, 1, 1, 1, 1, 1]]),
             "advantages_bt": jnp.zeros((1, 6)), "behaviour_logprobs_bt": logp,
             "segment_ids_bt": jnp.ones((1, 6), jnp.int32),
             "versions_bt": jnp.zeros((1, 6), jnp.int32)}
    return logp, ref, batch


def test_training_loss_kl_gradient_by_enumeration(exact):
    """The loss path itself (`cotangent`, what the deferred backward applies): with the
    cotangent c_a = ∂L/∂logπ(a), the expected gradient is Σ_a π(a)·c_a·∇_θ logπ(a). The
    default trainer.kl_loss regularises the reverse KL."""
    g_rev, g_fwd = exact
    logp, ref, batch = _enumerated_batch(THETA)
    pi = jnp.exp(logp[0, 1:])
    jac = jax.jacobian(jax.nn.log_softmax)(THETA)  # [a, θ]: ∇_θ logπ(a)
    default = LossSpec.from_config(TrainerConfig()).kl_loss
    assert default == "k3_reverse"
    errs = {}
    for form, want in (("k3_reverse", g_rev), ("k2", g_rev), ("k3_forward", g_fwd)):
        spec = LossSpec(kl_coef=1.0, kl_loss=form, use_versions=False)
        cot, _ = cotangent(logp, ref, batch, jnp.int32(0), spec)
        errs[form] = max_err((pi * cot[0, 1:]) @ jac, want)
    print("loss path, max |E[∇L] − target|:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(v <= ABS_TOL for v in errs.values()), errs


def test_kl_metric_is_the_estimators_value_and_the_loss_k3s():
    """`kl_sum` is trainer.kl_estimator's value; the loss value of k3_reverse is k3's."""
    logp, ref, batch = _enumerated_batch(THETA)
    on = batch["loss_mask_bt"] > 0
    for est in ("k1", "k2", "k3"):
        spec = LossSpec(kl_coef=0.5, kl_loss="k3_reverse", kl_estimator=est, use_versions=False)
        total, m = loss_sum(logp, ref, batch, jnp.int32(0), spec)
        want = float(jnp.sum(jnp.where(on, kl_estimate(logp, ref, est), 0.0)))
        np.testing.assert_allclose(float(m["kl_sum"]), want, rtol=1e-6)
        k3 = float(jnp.sum(jnp.where(on, kl_estimate(logp, ref, "k3"), 0.0)))
        np.testing.assert_allclose(float(total), 0.5 * k3, rtol=1e-6)
    # the k1 metric is the unbiased sample of the reverse KL: here its exact expectation
    pi = jnp.exp(logp[0, 1:])
    k1_mean = float(jnp.sum(pi * kl_estimate(logp, ref, "k1")[0, 1:]))
    np.testing.assert_allclose(k1_mean, float(reverse_kl(THETA)), rtol=1e-5)


def test_k1_is_rejected_as_a_loss_and_allowed_as_the_metric():
    assert set(KL_LOSSES) == {"k3_reverse", "k2", "k3_forward"}
    for cls in (TrainerConfig, LossSpec):  # the typed key lists the same values
        assert get_args(get_type_hints(cls)["kl_loss"]) == KL_LOSSES
    with pytest.raises(ConfigError, match=r"trainer\.kl_loss.*zero expected gradient"):
        TrainerConfig(kl_loss="k1")
    with pytest.raises(ConfigError, match=r"trainer\.kl_loss"):
        from_dict(TrainerConfig, apply_overrides(TrainerConfig, {}, ["kl_loss=k1"]),
                  prefix="trainer")
    cfg = from_dict(TrainerConfig, apply_overrides(
        TrainerConfig, {}, ["kl_estimator=k1", "kl_loss=k3_forward"]), prefix="trainer")
    assert (cfg.kl_estimator, cfg.kl_loss) == ("k1", "k3_forward")
