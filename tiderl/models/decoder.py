"""The built-in Llama/Qwen2/Qwen3-family decoder as a Flax NNX module.

`__call__(tokens, positions, segment_ids, *, cache=None) -> (logits, cache)`:
- `cache=None` is the training path: packed rows, attention causal within a segment only.
  With `model.scan_layers` the blocks' parameters are stacked (a leading layer axis) and the
  training path is one `lax.scan` over them (one compiled block; under remat the backward
  recomputes one block at a time, where XLA:CPU overlaps several blocks' recomputations of an
  unrolled stack).
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
from tiderl.models.layers import attend_query_chunked, map_time_chunks, rms_norm, rope
from tiderl.models.lora import LoraSpec, adapter, lora_delta, make_adapters

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


def _add_lora(module: nnx.Module, cfg: ModelConfig, lora: LoraSpec | None, part: str,
              rngs: nnx.Rngs) -> None:
    """`module.lora`: the part's LoRA adapters (models/lora.py), or None."""
    module.lora_scale = lora.scale if lora is not None else 0.0
    module.lora = (make_adapters(cfg, lora, part, rngs, DTYPES[cfg.param_dtype])
                   if lora is not None else None)


def _plus_lora(y: Array, ab: tuple[Array, Array] | None, scale: float, x: Array,
               n_in_axes: int = 1) -> Array:
    """y + scale·(x·A)·B (reshaped to y) when the projection has an adapter, else y."""
    dy = lora_delta(ab, scale, x, n_in_axes)
    return y if dy is None else y + dy.reshape(y.shape)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        _add_lora(self, cfg, lora, "attn", rngs)
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

    def __call__(self, x_btd, positions_bt, mask_btt, *, cache, layer: int,
                 token_chunk: int = 0):
        """`mask_btt`: the packed causal mask, or the segment ids [B, T] with
        `token_chunk` > 0 (query-chunked attention builds its mask per chunk)."""
        cd = x_btd.dtype
        q = jnp.einsum("btd,dhk->bthk", x_btd, self.wq_dhk[...].astype(cd))
        k = jnp.einsum("btd,dhk->bthk", x_btd, self.wk_dkh[...].astype(cd))
        v = jnp.einsum("btd,dhk->bthk", x_btd, self.wv_dkh[...].astype(cd))
        if self.lora is not None:  # unmerged LoRA: + scale·(x·A)·B (models/lora.py)
            q = _plus_lora(q, adapter(self.lora, "q_proj"), self.lora_scale, x_btd)
            k = _plus_lora(k, adapter(self.lora, "k_proj"), self.lora_scale, x_btd)
            v = _plus_lora(v, adapter(self.lora, "v_proj"), self.lora_scale, x_btd)
        if self.cfg.qkv_bias:
            q = q + self.bq_hk[...].astype(cd)
            k = k + self.bk_kh[...].astype(cd)
            v = v + self.bv_kh[...].astype(cd)
        if self.cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q = rms_norm(q, self.q_norm_dh[...], self.cfg.norm_eps)
            k = rms_norm(k, self.k_norm_dh[...], self.cfg.norm_eps)
        rot = dict(llama3=self.cfg.llama3_rope, mrope=self.cfg.mrope)
        q = rope(q, positions_bt, self.cfg.rope_theta, **rot)
        k = rope(k, positions_bt, self.cfg.rope_theta, **rot)
        if cache is None:
            impl = _train_impl(self.cfg, q.shape[1])
            if token_chunk and impl == "xla":  # mask_btt: the segment ids (see above)
                out = attend_query_chunked(q, k, v, mask_btt, token_chunk)
            else:  # the fused kernels keep no T×T scores anyway: no query chunks
                out = train_attention(q, k, v, mask_btt, impl)
        else:
            out, cache = cache.attend(layer, q, k, v)
        y = jnp.einsum("bthk,hkd->btd", out, self.wo_hkd[...].astype(cd))
        return _plus_lora(y, adapter(self.lora, "o_proj"), self.lora_scale, out, 2), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        _add_lora(self, cfg, lora, "mlp", rngs)
        self.w_gate_df = _param(rngs, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), std, pd)
        self.w_up_df = _param(rngs, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), std, pd)
        self.w_down_fd = _param(rngs, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"), std, pd)

    def __call__(self, x_btd, *, chunk: int = 0):
        """`chunk` > 0: that many positions at a time, recomputed in the backward (training)."""
        cd = x_btd.dtype
        w_gate, w_up = self.w_gate_df[...].astype(cd), self.w_up_df[...].astype(cd)
        w_down = self.w_down_fd[...].astype(cd)

        ab = {n: adapter(self.lora, n) for n in ("gate_proj", "up_proj", "down_proj")}

        def lin(x, w, name):  # read outside the chunk map: plain arrays in the closure
            return _plus_lora(x @ w, ab[name], self.lora_scale, x)

        def mlp(x):
            if self.lora is None:
                return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
            return lin(jax.nn.silu(lin(x, w_gate, "gate_proj")) * lin(x, w_up, "up_proj"),
                       w_down, "down_proj")

        return map_time_chunks(mlp, x_btd, chunk) if chunk else mlp(x_btd)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        pd = DTYPES[cfg.param_dtype]
        self.eps = cfg.norm_eps
        self.attn_norm_d = _ones((cfg.d_model,), ("norm",), pd)
        self.attn = Attention(cfg, rngs=rngs, lora=lora)
        self.mlp_norm_d = _ones((cfg.d_model,), ("norm",), pd)
        self.mlp = MLP(cfg, rngs=rngs, lora=lora)

    def __call__(self, x_btd, positions_bt, mask_btt, *, cache, layer: int,
                 token_chunk: int = 0):
        h, cache = self.attn(rms_norm(x_btd, self.attn_norm_d[...], self.eps), positions_bt,
                             mask_btt, cache=cache, layer=layer, token_chunk=token_chunk)
        x_btd = x_btd + h
        x_btd = x_btd + self.mlp(rms_norm(x_btd, self.mlp_norm_d[...], self.eps),
                                 chunk=token_chunk if cache is None else 0)
        return x_btd, cache


def _store(x: Array) -> Array:
    # bf16 is kept as its bits: XLA:CPU upcasts a bf16 dynamic-slice to fp32, and hoists the
    # upcast of the whole stacked array out of the backward loop (an fp32 copy of every saved
    # layer input at once). Integers slice as they are.
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _load(x: Array, dtype: Any) -> Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def scan_remat(apply: Any, stacked: Any, x_btd: Array, consts: tuple, group: int = 1) -> Array:
    """`x ← apply(layer_state, x, consts)` over the stacked layers, rematerialised per layer.

    What `lax.scan(jax.checkpoint(body))` computes, written out so the saved layer inputs are
    stored as bits (see `_store`). The forward keeps each layer's input; the backward runs the
    layers in reverse, recomputing one layer at a time from its input and pulling the
    cotangent through it (`jax.vjp`), writing each layer's parameter gradient into the stacked
    gradient. `consts` (positions, masks: integers or booleans) get no gradient.

    `group` > 1 (dividing the layer count) keeps only every `group`-th layer input between the
    forward and the backward: the backward takes the groups in reverse, recomputes the
    group's other inputs from its first (one more forward of those layers), then runs the
    per-layer backward above over them. n/group + group saved inputs are live instead of n
    (10 instead of 24 for 24 layers in groups of 6), for about a quarter more step compute.
    The per-layer arithmetic is the same, so are the results.
    """
    dtype = x_btd.dtype
    n = jax.tree.leaves(stacked)[0].shape[0]
    if group > 1 and n % group:
        raise ValueError(f"trainer.remat_group={group} does not divide the {n} layers; pick a "
                         "divisor of model.n_layers (1: keep every layer's input)")
    group = max(group, 1)

    def layer(stacked, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                            stacked)

    @jax.custom_vjp
    def stack(stacked, x, consts):
        return jax.lax.scan(lambda x, st: (apply(st, x, consts), None), x, stacked)[0]

    def fwd(stacked, x, consts):
        if group == 1:
            def body(x, st):
                return apply(st, x, consts), _store(x)

            y, saved = jax.lax.scan(body, x, stacked)
            return y, (stacked, saved, consts)

        def gbody(carry, xs):
            x, saved = carry
            st, i = xs
            slot = i // group
            # Only a group's first input is kept: the others rewrite the slot as it was.
            cur = jax.lax.dynamic_index_in_dim(saved, slot, keepdims=False)
            keep = jnp.where(i % group == 0, _store(x), cur)
            saved = jax.lax.dynamic_update_index_in_dim(saved, keep, slot, 0)
            return (apply(st, x, consts), saved), None

        saved0 = jnp.zeros((n // group, *x.shape), _store(x).dtype)
        (y, saved), _ = jax.lax.scan(gbody, (x, saved0), (stacked, jnp.arange(n)))
        return y, (stacked, saved, consts)

    def bwd(res, dy):
        stacked, saved, consts = res
        if group == 1:
            def body(dy, xs):
                st, x_saved = xs
                _, vjp = jax.vjp(lambda st, x: apply(st, x, consts), st, _load(x_saved, dtype))
                dst, dx = vjp(dy)
                return dx, dst

            dx, dstacked = jax.lax.scan(body, dy, (stacked, saved), reverse=True)
            return dstacked, dx, jax.tree.map(lambda _: None, consts)

        def group_bwd(carry, g):
            def refwd(x, j):
                return apply(layer(stacked, g * group + j), x, consts), _store(x)

            _, inner = jax.lax.scan(refwd, _load(saved[g], dtype), jnp.arange(group))

            def body(carry, j):
                dy, dstacked = carry
                i = g * group + j
                x_in = _load(jax.lax.dynamic_index_in_dim(inner, j, keepdims=False), dtype)
                _, vjp = jax.vjp(lambda st, x: apply(st, x, consts), layer(stacked, i), x_in)
                dst, dx = vjp(dy)
                dstacked = jax.tree.map(
                    lambda acc, d: jax.lax.dynamic_update_index_in_dim(acc, d, i, 0),
                    dstacked, dst)
                return (dx, dstacked), None

            carry, _ = jax.lax.scan(body, carry, jnp.arange(group), reverse=True)
            return carry, None

        zeros = jax.tree.map(jnp.zeros_like, stacked)
        (dx, dstacked), _ = jax.lax.scan(group_bwd, (dy, zeros), jnp.arange(n // group),
                                         reverse=True)
        return dstacked, dx, jax.tree.map(lambda _: None, consts)

    stack.defvjp(fwd, bwd)
    return stack(stacked, x_btd, consts)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, lora: LoraSpec | None) -> Block:
    """`n_layers` blocks as one Block whose parameters have a leading layer axis (logical name
    'layers', never sharded), each layer initialised from its own split of `rngs`."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs, lora=lora)

    return make(rngs)


class Decoder(nnx.Module):
    """Llama/Qwen-style decoder: RMSNorm, RoPE (optionally llama3-scaled), GQA, SwiGLU, optional
    qkv bias and q/k norm, tied or untied embeddings. `lora`: LoRA adapters on the targeted
    projections (models/lora.py; their keys come from `rngs`' 'lora' stream, the base weights
    are drawn as without them)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        pd = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                               cfg.init_std, pd)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs, lora)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs, lora=lora)
                                    for _ in range(cfg.n_layers)])
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
        token_chunk: int = 0,
        remat_group: int = 1,
        inputs_btd: Float[Array, "B T D"] | None = None,
        layer_adds: tuple[Float[Array, "B T D"], ...] = (),
    ) -> tuple[Float[Array, "B T D"], AttentionCache | None]:
        """Final hidden states (after the final norm, compute dtype), without the vocab head.

        The trainer applies the head in chunks (train/head.py) and the engine only at sampled
        positions, so neither holds a B×T×V array. Training path only: `remat` recomputes each
        block in the backward (only block inputs are kept between forward and backward);
        `token_chunk` > 0 runs each block's attention queries and MLP that many positions at a
        time (`attend_query_chunked`, `map_time_chunks`: no T×T scores per head, no T×mlp_dim
        intermediates); `remat_group` > 1 with scanned layers keeps only every that-many-th
        block input (`scan_remat`).

        Vision-language policies (models/vlm.py): `positions_bt` may be [B, T, 3] M-RoPE
        positions; `inputs_btd` replaces the token embeddings (image features scattered in);
        `layer_adds[i]` is added to block i's output (Qwen3-VL's deepstack; not with
        `model.scan_layers`).
        """
        cd = DTYPES[self.cfg.compute_dtype]
        x_btd = (self.embed(tokens_bt) if inputs_btd is None else inputs_btd).astype(cd)
        if layer_adds and self.cfg.scan_layers:
            raise ValueError("layer_adds (deepstack features) need per-layer blocks; set "
                             "model.scan_layers=false")

        def add(i, x):
            return x + layer_adds[i].astype(x.dtype) if i < len(layer_adds) else x

        if cache is not None:
            for i, block in enumerate(self._blocks()):
                x_btd, cache = block(x_btd, positions_bt, None, cache=cache, layer=i)
                x_btd = add(i, x_btd)
            return rms_norm(x_btd, self.final_norm_d[...], self.cfg.norm_eps), cache
        # Query-chunked attention builds its mask per chunk from the segment ids.
        mask_btt = (segment_ids_bt if token_chunk
                    else training_mask(segment_ids_bt, _train_impl(self.cfg, tokens_bt.shape[1])))

        def run(block, x, pos, mask):
            return block(x, pos, mask, cache=None, layer=0, token_chunk=token_chunk)[0]

        if self.cfg.scan_layers:
            graphdef, stacked = nnx.split(self.layers)

            def apply(layer_state, x, consts):
                return run(nnx.merge(graphdef, layer_state), x, *consts)

            consts = (positions_bt, mask_btt)
            if remat:
                x_btd = scan_remat(apply, stacked, x_btd, consts, remat_group)
            else:
                x_btd, _ = jax.lax.scan(lambda x, st: (apply(st, x, consts), None), x_btd,
                                        stacked)
        else:
            step = nnx.remat(run) if remat else run
            for i, block in enumerate(self.layers):
                x_btd = add(i, step(block, x_btd, positions_bt, mask_btt))
        return rms_norm(x_btd, self.final_norm_d[...], self.cfg.norm_eps), None

    def embed(self, tokens_bt: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """The token embeddings (param dtype)."""
        return jnp.take(self.embed_vd[...], tokens_bt, axis=0)

    def _blocks(self):
        """The blocks one by one (a stacked layout is sliced per layer: the serving path hands
        each layer's k/v to the cache by its index; `policy.serving_params` unstacks once
        instead, which the engine's weights go through)."""
        if not self.cfg.scan_layers:
            yield from self.layers
            return
        graphdef, stacked = nnx.split(self.layers)
        for i in range(self.cfg.n_layers):
            yield nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))

    def head_vd(self) -> Float[Array, "V D"]:
        """The vocab head as a V×D matrix in the param dtype (the tied embedding or lm_head^T)."""
        return self.embed_vd[...] if self.cfg.tie_embeddings else self.lm_head_dv[...].T

    def logits(self, h_btd: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The head on hidden states; fp32 logits (fp32 accumulation in any compute dtype)."""
        return jnp.einsum("btd,vd->btv", h_btd, self.head_vd().astype(h_btd.dtype),
                          preferred_element_type=jnp.float32)
