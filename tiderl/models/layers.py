"""Building blocks of the decoder family: RMSNorm, RoPE, dense attention with packed masks.

Shape legend: B batch, T query time, S key time, D model, H query heads,
K kv heads, G queries per kv head (H = K·G), Dh head dim, F mlp, V vocab, P pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

NEG_INF = -1e30  # finite: an all-masked row must stay NaN-free under softmax


def rms_norm(x_btd: Float[Array, "B T D"], scale_d: Float[Array, "D"], eps: float) -> Array:
    """RMSNorm in fp32, cast back to the input dtype (as the HF reference does)."""
    x32 = x_btd.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale_d.astype(jnp.float32) * x32).astype(x_btd.dtype)


def rope_inv_freq(dh: int, theta: float,
                  llama3: tuple[float, float, float, int] | None = None) -> Array:
    """RoPE inverse frequencies [Dh/2] in fp32; `llama3` = (factor, low_freq_factor,
    high_freq_factor, original_max_len) applies Llama 3.1's scaling as transformers'
    `_compute_llama3_parameters`:
    wavelengths shorter than original/high are kept, longer than original/low divided by factor,
    and a linear ramp in original/wavelength blends the two in between."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * jnp.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope(x_bthd: Float[Array, "B T H Dh"], positions_bt: Int[Array, "B T"], theta: float, *,
         llama3: tuple[float, float, float, int] | None = None) -> Array:
    """Rotary embedding, half-split layout (HF `rotate_half`), angles in fp32 (`llama3`: see
    `rope_inv_freq`)."""
    dh = x_bthd.shape[-1]
    inv_freq = rope_inv_freq(dh, theta, llama3)
    ang_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(ang_btf)[:, :, None, :]
    sin = jnp.sin(ang_btf)[:, :, None, :]
    x32 = x_bthd.astype(jnp.float32)
    x1, x2 = x32[..., : dh // 2], x32[..., dh // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def packed_causal_mask(segment_ids_bt: Int[Array, "B T"]) -> Bool[Array, "B T T"]:
    """Causal within a segment, never across. Tokens of segment 0 (padding) see only themselves."""
    t = segment_ids_bt.shape[1]
    causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
    same_btt = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    real_bt = segment_ids_bt != 0
    eye_tt = jnp.eye(t, dtype=bool)
    return (causal_tt & same_btt & real_bt[:, None, :]) | eye_tt


def attend(
    q_bthd: Float[Array, "B T H Dh"],
    k_bskd: Float[Array, "B S K Dh"],
    v_bskd: Float[Array, "B S K Dh"],
    mask_bts: Bool[Array, "B T S"],
) -> Float[Array, "B T H Dh"]:
    """Grouped-query attention with an explicit mask; scores and softmax in fp32.

    This is the reference path (training, and the paged cache's gather path). The mask is always
    explicit because appended prefill needs bottom-right causal alignment.
    """
    b, t, h, dh = q_bthd.shape
    k = k_bskd.shape[2]
    q_btkgd = q_bthd.reshape(b, t, k, h // k, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
    return out.reshape(b, t, h, dh)
