"""A custom policy in a few dozen lines: select it with `model.policy=examples.custom_policy:MiniTransformer`.

Any `nnx.Module` built as `Class(cfg, rngs=...)` with
`__call__(tokens, positions, segment_ids, *, cache=None) -> (logits, cache)` is a tiderl policy.
Handing q/k/v to `cache.attend(layer, ...)` when a cache is given is what lets the rollout
engine serve it from the paged KV cache; the training path (`cache=None`) gets packed rows.
This one has as many kv heads as query heads, so it declares `supports_gqa = False`: launch
then asks for `model.n_kv_heads` equal to `model.n_heads`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from tiderl.models.config import ModelConfig
from tiderl.models.layers import attend, packed_causal_mask, rope


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.h, self.dh, self.theta = h, dh, cfg.rope_theta
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * h * dh, rngs=rngs)
        self.out = nnx.Linear(h * dh, d, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, cfg.mlp_dim, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_dim, d, rngs=rngs)

    def __call__(self, x, positions, mask, cache, layer):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.h, self.dh), 3, axis=2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if cache is None:
            a = attend(q, k, v, mask)
        else:
            a, cache = cache.attend(layer, q, k, v)
        x = x + self.out(a.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), cache


class MiniTransformer(nnx.Module):
    """LayerNorm + GELU transformer with multi-head attention (kv heads = heads)."""

    supports_gqa = False

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids, *, cache=None):
        x = self.embed(tokens)
        mask = packed_causal_mask(segment_ids) if cache is None else None
        for i, block in enumerate(self.blocks):
            x, cache = block(x, positions, mask, cache, i)
        return self.head(self.norm(x)), cache
