"""The built-in Llama/Qwen2/Qwen3-family decoder as a Flax NNX module.

`__call__(tokens, positions, segment_ids, *, cache=None) -> (logits, cache)`:
- `cache=None` is the training path: packed rows, attention causal within a segment only.
- otherwise `cache` is an `AttentionCache` (the serving path's paged KV view); each layer hands
  its fresh q/k/v to `cache.attend(layer, ...)`, which stores k/v and attends over the resident
  context, and returns the updated cache. That is the one seam the engine plugs into.

Parameters carry logical axis names (`sharding=` metadata, see `sharding.py`); they are created
without eager sharding so a model can be built anywhere and placed by `init_policy`.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from tiderl.models.attention import resolve_impl, train_attention, training_mask
from tiderl.models.config import ModelConfig
from tiderl.models.layers import rms_norm, rope

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class AttentionCache(Protocol):
    """What the decoder needs of a KV cache on the serving path (implemented in serving/kv.py)."""

    def attend(
        self,
        layer: int,
        q_bthd: Float[Array, "B T H Dh"],
        k_btkd: Float[Array, "B T K Dh"],
        v_btkd: Float[Array, "B T K Dh"],
    ) -> tuple[Float[Array, "B T H Dh"], AttentionCache]: ...


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], std: float,
           dtype: Any) -> nnx.Param:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _ones(shape: tuple[int, ...], names: tuple[str | None, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=names, eager_sharding=False)


def _zeros(shape: tuple[int, ...], names: tuple[str | None, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


def _train_impl(cfg: ModelConfig, seq_len: int) -> str:
    """The training-path attention kernel for `model.attention_impl` (models/attention.py)."""
    return resolve_impl(cfg.attention_impl, backend=jax.default_backend(),
                        compute_dtype=cfg.compute_dtype, head_dim=cfg.head_dim, seq_len=seq_len)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.wq_dhk = _param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, pd)
        self.wk_dkh = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv_dkh = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo_hkd = _param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), std, pd)
        if cfg.qkv_bias:
            self.bq_hk = _zeros((h, dh), ("heads", "head_dim"), pd)
            self.bk_kh = _zeros((k, dh), ("kv_heads", "head_dim"), pd)
            self.bv_kh = _zeros((k, dh), ("kv_heads", "head_dim"), pd)
        if cfg.qk_norm:
            self.q_norm_dh = _ones((dh,), ("head_dim",), pd)
            self.k_norm_dh = _ones((dh,), ("head_dim",), pd)

    def __call__(self, x_btd, positions_bt, mask_btt, *, cache, layer: int):
        cd = x_btd.dtype
        q = jnp.einsum("btd,dhk->bthk", x_btd, self.wq_dhk[...].astype(cd))
        k = jnp.einsum("btd,dhk->bthk", x_btd, self.wk_dkh[...].astype(cd))
        v = jnp.einsum("btd,dhk->bthk", x_btd, self.wv_dkh[...].astype(cd))
        if self.cfg.qkv_bias:
            q = q + self.bq_hk[...].astype(cd)
            k = k + self.bk_kh[...].astype(cd)
            v = v + self.bv_kh[...].astype(cd)
        if self.cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q = rms_norm(q, self.q_norm_dh[...], self.cfg.norm_eps)
            k = rms_norm(k, self.k_norm_dh[...], self.cfg.norm_eps)
        q = rope(q, positions_bt, self.cfg.rope_theta, llama3=self.cfg.llama3_rope)
        k = rope(k, positions_bt, self.cfg.rope_theta, llama3=self.cfg.llama3_rope)
        if cache is None:  # mask_btt: what training_mask gave for this kernel
            out = train_attention(q, k, v, mask_btt, _train_impl(self.cfg, q.shape[1]))
        else:
            out, cache = cache.attend(layer, q, k, v)
        return jnp.einsum("bthk,hkd->btd", out, self.wo_hkd[...].astype(cd)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        self.w_gate_df = _param(rngs, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), std, pd)
        self.w_up_df = _param(rngs, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), std, pd)
        self.w_down_fd = _param(rngs, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"), std, pd)

    def __call__(self, x_btd):
        cd = x_btd.dtype
        gate = x_btd @ self.w_gate_df[...].astype(cd)
        up = x_btd @ self.w_up_df[...].astype(cd)
        return (jax.nn.silu(gate) * up) @ self.w_down_fd[...].astype(cd)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.eps = cfg.norm_eps
        self.attn_norm_d = _ones((cfg.d_model,), ("norm",), pd)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm_d = _ones((cfg.d_model,), ("norm",), pd)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_btd, positions_bt, mask_btt, *, cache, layer: int):
        h, cache = self.attn(rms_norm(x_btd, self.attn_norm_d[...], self.eps), positions_bt,
                             mask_btt, cache=cache, layer=layer)
        x_btd = x_btd + h
        x_btd = x_btd + self.mlp(rms_norm(x_btd, self.mlp_norm_d[...], self.eps))
        return x_btd, cache


class Decoder(nnx.Module):
    """Llama/Qwen-style decoder: RMSNorm, RoPE (optionally llama3-scaled), GQA, SwiGLU, optional
    qkv bias and q/k norm, tied or untied embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                               cfg.init_std, pd)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm_d = _ones((cfg.d_model,), ("norm",), pd)
        if not cfg.tie_embeddings:
            self.lm_head_dv = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                     cfg.init_std, pd)

    def __call__(
        self,
        tokens_bt: Int[Array, "B T"],
        positions_bt: Int[Array, "B T"],
        segment_ids_bt: Int[Array, "B T"],
        *,
        cache: AttentionCache | None = None,
    ) -> tuple[Float[Array, "B T V"], AttentionCache | None]:
        h_btd, cache = self.hidden_states(tokens_bt, positions_bt, segment_ids_bt, cache=cache)
        return self.logits(h_btd), cache

    def hidden_states(
        self,
        tokens_bt: Int[Array, "B T"],
        positions_bt: Int[Array, "B T"],
        segment_ids_bt: Int[Array, "B T"],
        *,
        cache: AttentionCache | None = None,
        remat: bool = False,
    ) -> tuple[Float[Array, "B T D"], AttentionCache | None]:
        """Final hidden states (after the final norm, compute dtype), without the vocab head.

        The trainer applies the head in chunks (train/head.py) and the engine only at sampled
        positions, so neither holds a B×T×V array. `remat` (training path only) recomputes each
        block in the backward: only block inputs are kept between forward and backward.
        """
        cd = DTYPES[self.cfg.compute_dtype]
        x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(cd)
        mask_btt = (training_mask(segment_ids_bt, _train_impl(self.cfg, tokens_bt.shape[1]))
                    if cache is None else None)
        if remat and cache is None:
            step = nnx.remat(lambda blk, x, pos, mask: blk(x, pos, mask, cache=None, layer=0)[0])
            for block in self.layers:
                x_btd = step(block, x_btd, positions_bt, mask_btt)
        else:
            for i, block in enumerate(self.layers):
                x_btd, cache = block(x_btd, positions_bt, mask_btt, cache=cache, layer=i)
        return rms_norm(x_btd, self.final_norm_d[...], self.cfg.norm_eps), cache

    def head_vd(self) -> Float[Array, "V D"]:
        """The vocab head as a V×D matrix in the param dtype (the tied embedding or lm_head^T)."""
        return self.embed_vd[...] if self.cfg.tie_embeddings else self.lm_head_dv[...].T

    def logits(self, h_btd: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The head on hidden states; fp32 logits (fp32 accumulation in any compute dtype)."""
        return jnp.einsum("btd,vd->btv", h_btd, self.head_vd().astype(h_btd.dtype),
                          preferred_element_type=jnp.float32)
