"""Per-token logprobs and entropies from hidden states, the vocab head applied in token chunks.

`token_outputs(logits_btv, ...)` (grpo.py) needs the B×T×V logits, and autodiff through its fp32
`log_softmax` keeps a B×T×V fp32 residual for the backward: 2.5 GB for 4 × 1,024 tokens of a
151,936-token vocabulary. `chunked_token_outputs` computes the same values from the final hidden
states and the head matrix, `chunk` tokens at a time, with a custom VJP that saves only the
hidden states, the head, the tokens and two fp32 numbers per token (log-normaliser, entropy) and
recomputes each chunk's logits in the backward. At most one chunk×V block lives at a time in
the forward, and one chunk × vocab-tile block in the backward, whose head gradient is written
tile by tile into the one [V, D] gradient buffer.

With z = logits / T, p = softmax(z), logp_y = z_y − lse, H = lse − Σ_v p_v z_v:
    ∂logp_y/∂z = onehot(y) − p,       ∂H/∂z = −p ⊙ (log p + H).
The head matmuls run in the hidden states' (compute) dtype with fp32 accumulation, as the
decoder's own head does; the head's gradient is accumulated over chunks in fp32 and returned in
the head's (param) dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["chunked_token_outputs"]


def _logits(h_cd: Array, w_vd: Array, temperature: float) -> Array:
    z = jnp.einsum("cd,vd->cv", h_cd, w_vd, preferred_element_type=jnp.float32)
    return z / jnp.float32(temperature)


def _chunk_fwd(h_cd, y_c, w_vd, temperature):
    z_cv = _logits(h_cd, w_vd, temperature)
    lse_c = jax.nn.logsumexp(z_cv, axis=-1)
    p_cv = jnp.exp(z_cv - lse_c[:, None])
    ent_c = lse_c - jnp.sum(p_cv * z_cv, axis=-1)
    logp_c = jnp.take_along_axis(z_cv, y_c[:, None], axis=-1)[:, 0] - lse_c
    return logp_c, ent_c, lse_c


BLOCK_ELEMS = 1 << 21
"""Logit elements per block of the backward (token chunk × vocab tile): 8 MB in fp32."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(h_ncd: Array, y_nc: Array, w_vd: Array, temperature: float,
          vocab_tile: int) -> tuple[Array, Array]:
    w_cd = w_vd.astype(h_ncd.dtype)
    logp, ent, _ = jax.lax.map(lambda xs: _chunk_fwd(xs[0], xs[1], w_cd, temperature),
                               (h_ncd, y_nc))
    return logp, ent


def _head_fwd(h_ncd, y_nc, w_vd, temperature, vocab_tile):
    w_cd = w_vd.astype(h_ncd.dtype)
    logp, ent, lse = jax.lax.map(lambda xs: _chunk_fwd(xs[0], xs[1], w_cd, temperature),
                                 (h_ncd, y_nc))
    return (logp, ent), (h_ncd, y_nc, w_vd, lse, ent)


def _head_bwd(temperature, vocab_tile, res, cts):
    """Vocabulary tiles (outer) × token chunks (inner): each tile's head gradient is summed in
    fp32 over the token chunks and written once into the [V, D] gradient (in place), so no
    V×D partial sum exists beside it (a token-chunk-only loop adds a V×D product per chunk:
    two head-sized buffers). Each logit block is recomputed from the saved log-normaliser."""
    h_ncd, y_nc, w_vd, lse_nc, ent_nc = res
    g_logp_nc, g_ent_nc = cts
    cd = h_ncd.dtype
    v, d = w_vd.shape
    c = h_ncd.shape[1]
    xs = (h_ncd, y_nc, lse_nc, ent_nc, g_logp_nc.astype(jnp.float32),
          g_ent_nc.astype(jnp.float32))

    def tile(carry, start, size: int):
        dw_vd, dh_ncd = carry
        w_td = jax.lax.dynamic_slice_in_dim(w_vd, start, size, 0).astype(cd)

        def body(dw_td, x):
            h_cd, y_c, lse_c, ent_c, g_lp_c, g_h_c = x
            z_ct = _logits(h_cd, w_td, temperature)
            logp_ct = z_ct - lse_c[:, None]
            p_ct = jnp.exp(logp_ct)
            dz_ct = -p_ct * (g_lp_c[:, None] + g_h_c[:, None] * (logp_ct + ent_c[:, None]))
            col_c = y_c - start
            inside = (col_c >= 0) & (col_c < size)
            dz_ct = dz_ct.at[jnp.arange(c), jnp.where(inside, col_c, size)].add(
                jnp.where(inside, g_lp_c, 0.0), mode="drop")
            dlogits_ct = (dz_ct / jnp.float32(temperature)).astype(cd)
            dh_cd = jnp.einsum("ct,td->cd", dlogits_ct, w_td, preferred_element_type=jnp.float32)
            dw_td = dw_td + jnp.einsum("ct,cd->td", dlogits_ct, h_cd,
                                       preferred_element_type=jnp.float32)
            return dw_td, dh_cd

        dw_td, dh_part = jax.lax.scan(body, jnp.zeros((size, d), jnp.float32), xs)
        dw_vd = jax.lax.dynamic_update_slice_in_dim(dw_vd, dw_td.astype(w_vd.dtype), start, 0)
        return dw_vd, dh_ncd + dh_part

    t = max(1, min(v, vocab_tile))
    n_full, rest = divmod(v, t)
    carry = (jnp.zeros(w_vd.shape, w_vd.dtype), jnp.zeros(h_ncd.shape, jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, lambda i, cr: tile(cr, i * t, t), carry)
    if rest:
        carry = tile(carry, n_full * t, rest)
    dw_vd, dh_ncd = carry
    return dh_ncd.astype(cd), None, dw_vd


_head.defvjp(_head_fwd, _head_bwd)


def chunked_token_outputs(
    h_btd: Float[Array, "B T D"], w_vd: Float[Array, "V D"], tokens_bt: Int[Array, "B T"],
    temperature: float, chunk: int, vocab_tile: int | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(logprob of tokens[t] under the head at t − 1, entropy there) at temperature T; 0 at t = 0.

    The values of `grpo.token_outputs(h @ w.T, tokens, T)`, `chunk` tokens (of the flattened
    B × (T − 1) predictions) at a time, without a B×T×V array in the forward or the backward.
    The backward also tiles the vocabulary (`vocab_tile` rows of the head at a time; default
    `BLOCK_ELEMS // chunk`).
    """
    if chunk <= 0:
        raise ValueError(f"chunk={chunk}: the head chunk (trainer.head_chunk) must be positive")
    b, t, d = h_btd.shape
    n = b * (t - 1)
    c = min(chunk, max(n, 1))
    n_chunks = -(-n // c)
    pad = n_chunks * c - n
    h_nd = jnp.pad(h_btd[:, :-1].reshape(n, d), ((0, pad), (0, 0)))
    y_n = jnp.pad(tokens_bt[:, 1:].reshape(n), (0, pad))
    tile = vocab_tile if vocab_tile is not None else max(BLOCK_ELEMS // c, 1)
    logp, ent = _head(h_nd.reshape(n_chunks, c, d), y_n.reshape(n_chunks, c), w_vd,
                      float(temperature), int(tile))
    logp_bt = jnp.pad(logp.reshape(-1)[:n].reshape(b, t - 1), ((0, 0), (1, 0)))
    ent_bt = jnp.pad(ent.reshape(-1)[:n].reshape(b, t - 1), ((0, 0), (1, 0)))
    return logp_bt, ent_bt
