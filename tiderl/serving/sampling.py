"""Temperature-first sampling with logprobs; per-token keys from (run, task id, position).

Logprob contract: sample from softmax(logits_f32 / T) and return
log_softmax(logits_f32 / T)[token] over the full vocabulary — the quantity the trainer
recomputes at the same T.
- T = 0 is greedy (argmax). The tempered limit would be 0.0 for every token, which carries no
  information, so at T = 0 we return the untempered log_softmax(logits_f32)[token] (T = 1).
- top-k / top-p (off by default) truncate the sampling distribution only; the returned logprob
  stays the full-vocabulary one above, and the engine flags such results (`filtered`).
- `banned` ids are never sampled, greedy included (a vision-language policy's image
  placeholders: in an action they would read as an image that is not there); the returned
  logprob stays the full-vocabulary one, as the trainer recomputes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def token_keys(run_key: Array, task_ids_b: Int[Array, " B"], positions_b: Int[Array, " B"]) -> Array:
    """fold_in(fold_in(run_key, task_id), position): independent of batch, slot and padding."""
    return jax.vmap(lambda t, p: jax.random.fold_in(jax.random.fold_in(run_key, t), p))(
        task_ids_b, positions_b)


def _truncate(scaled_bv: Array, top_k: int, top_p: float) -> Array:
    neg = jnp.finfo(jnp.float32).min
    if top_k > 0:
        kth_b = jax.lax.top_k(scaled_bv, top_k)[0][:, -1:]
        scaled_bv = jnp.where(scaled_bv < kth_b, neg, scaled_bv)
    if top_p < 1.0:
        sorted_bv = jnp.sort(scaled_bv, axis=-1)[:, ::-1]
        cum_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the argmax).
        n_keep_b = jnp.sum(cum_bv - jax.nn.softmax(sorted_bv, axis=-1) < top_p, axis=-1)
        cutoff_b = jnp.take_along_axis(sorted_bv, n_keep_b[:, None] - 1, axis=-1)
        scaled_bv = jnp.where(scaled_bv < cutoff_b, neg, scaled_bv)
    return scaled_bv


def _gumbel_argmax(sampling_bv: Array, keys_b: Array) -> Array:
    """A draw from softmax(sampling_bv) per row (Gumbel-max with the row's key)."""
    gumbel_bv = jax.vmap(lambda k: jax.random.gumbel(k, sampling_bv.shape[-1:], jnp.float32))(
        keys_b)
    return jnp.argmax(sampling_bv + gumbel_bv, axis=-1).astype(jnp.int32)


def sample(
    logits_bv: Float[Array, "B V"],
    keys_b: Array,
    temperature_b: Float[Array, " B"],
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    banned: tuple[int, ...] = (),
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """(tokens, logprobs): temperature first, full vocabulary; greedy where T == 0."""
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = temperature_b <= 0
    scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
    logprobs_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    sampling_bv = _truncate(scaled_bv, top_k, top_p)
    if banned:
        ids = jnp.asarray(banned, jnp.int32)
        sampling_bv = sampling_bv.at[:, ids].set(jnp.finfo(jnp.float32).min)
        logits_bv = logits_bv.at[:, ids].set(jnp.finfo(jnp.float32).min)
    # The Gumbel noise (threefry bits for every row and token) is most of a sampling call's
    # cost on a CPU (B=32, V=49,152: ~4x the rest); an all-greedy batch skips it.
    sampled_b = jax.lax.cond(
        jnp.all(greedy_b), lambda: jnp.zeros(logits_bv.shape[:1], jnp.int32),
        lambda: _gumbel_argmax(sampling_bv, keys_b))
    tokens_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), sampled_b).astype(jnp.int32)
    logprob_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b, logprob_b
