"""Building blocks of the decoder family: RMSNorm, RoPE, dense attention with packed masks.

Shape legend: B batch, T query time, S key time, D model, H query heads,
K kv heads, G queries per kv head (H = K·G), Dh head dim, F mlp, V vocab, P pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

NEG_INF = -1e30  # finite: an all-masked row must stay NaN-free under softmax


def rms_norm(x_btd: Float[Array, "B T D"], scale_d: Float[Array, " D"], eps: float) -> Array:
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


def rotate(x_bthd: Float[Array, "B T H Dh"], ang_btf: Float[Array, "B T F"]) -> Array:
    """Rotates `x` by the angles `ang` (one per frequency), half-split layout (HF
    `rotate_half`), in fp32, cast back to the input dtype."""
    dh = x_bthd.shape[-1]
    cos = jnp.cos(ang_btf)[:, :, None, :]
    sin = jnp.sin(ang_btf)[:, :, None, :]
    x32 = x_bthd.astype(jnp.float32)
    x1, x2 = x32[..., : dh // 2], x32[..., dh // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def rope(x_bthd: Float[Array, "B T H Dh"], positions: Int[Array, "B T"] | Int[Array, "B T 3"],
         theta: float, *, llama3: tuple[float, float, float, int] | None = None,
         mrope: tuple[int, ...] | None = None) -> Array:
    """Rotary embedding, half-split layout (HF `rotate_half`), angles in fp32 (`llama3`: see
    `rope_inv_freq`). `positions` [B, T], or [B, T, 3] (t, h, w) multimodal positions with
    `mrope` = `config.mrope_axes(...)`: each frequency turns by its axis' position. Positions [B, T]
    under M-RoPE are all three axes at once (text tokens), i.e. plain RoPE."""
    dh = x_bthd.shape[-1]
    inv_freq = rope_inv_freq(dh, theta, llama3)
    pos = positions.astype(jnp.float32)
    if pos.ndim == 3:
        if mrope is None:
            raise ValueError(f"positions of shape {positions.shape} (multimodal t/h/w) need "
                             "M-RoPE (model.mrope_section); pass positions [batch, time]")
        pos_btf = jnp.take(pos, jnp.asarray(mrope, jnp.int32), axis=-1)
        return rotate(x_bthd, pos_btf * inv_freq)
    return rotate(x_bthd, pos[..., None] * inv_freq)


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


def attend_query_chunked(
    q_bthd: Float[Array, "B T H Dh"],
    k_btkd: Float[Array, "B T K Dh"],
    v_btkd: Float[Array, "B T K Dh"],
    segment_ids_bt: Int[Array, "B T"],
    chunk: int,
) -> Float[Array, "B T H Dh"]:
    """Packed causal self-attention `chunk` queries at a time (training path).

    The values of `attend(q, k, v, packed_causal_mask(segment_ids))`, row for row the same
    reductions, but each chunk's [B, K, G, chunk, T] scores are rematerialised in the backward
    (`jax.checkpoint` per chunk under a `lax.map`): no T×T score, probability or mask array per
    head is ever live, only one chunk's. The mask is built per chunk from the segment ids.
    """
    if chunk <= 0:
        raise ValueError(f"chunk={chunk}: the attention chunk (trainer.token_chunk) must be "
                         "positive")
    b, t, h, dh = q_bthd.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    # Padded queries (segment 0, positions past T) see no key; their rows are dropped below.
    q_nbchd = jnp.pad(q_bthd, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        b, n, c, h, dh).swapaxes(0, 1)
    seg_nbc = jnp.pad(segment_ids_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
    pos_nc = jnp.arange(n * c, dtype=jnp.int32).reshape(n, c)
    key_pos_t = jnp.arange(t, dtype=jnp.int32)
    real_b1t = (segment_ids_bt != 0)[:, None, :]

    @jax.checkpoint
    def one(xs):
        q_bchd, seg_bc, pos_c = xs
        causal_ct = pos_c[:, None] >= key_pos_t[None, :]
        same_bct = seg_bc[:, :, None] == segment_ids_bt[:, None, :]
        eye_ct = pos_c[:, None] == key_pos_t[None, :]
        mask_bct = (causal_ct[None] & same_bct & real_b1t) | eye_ct[None]
        return attend(q_bchd, k_btkd, v_btkd, mask_bct)

    out_nbchd = jax.lax.map(one, (q_nbchd, seg_nbc, pos_nc))
    return out_nbchd.swapaxes(0, 1).reshape(b, n * c, h, dh)[:, :t]


def map_time_chunks(fn, x_btd: Float[Array, "B T D"], chunk: int) -> Array:
    """`fn(x)` for a position-wise `fn` [B, c, D] -> [B, c, E], `chunk` positions at a time,
    each chunk rematerialised in the backward (only its input is kept)."""
    b, t, d = x_btd.shape
    c = min(chunk, t)
    n = -(-t // c)
    x_nbcd = jnp.pad(x_btd, ((0, 0), (0, n * c - t), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    out_nbce = jax.lax.map(jax.checkpoint(fn), x_nbcd)
    return out_nbce.swapaxes(0, 1).reshape(b, n * c, -1)[:, :t]
