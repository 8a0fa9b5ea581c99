"""LoRA adapters of the built-in decoder (`trainer.lora_rank`, `lora_alpha`, `lora_targets`).

A targeted projection W (e.g. the attention query map, [D, H, Dh]) keeps its base weight frozen
and gains a low-rank update: y = x·W + (alpha / rank)·(x·A)·B, with A [in, rank] and B [rank,
out] (`in`/`out` are W's input and output axes flattened). The adapters are `flax.nnx.LoRA`
modules held under each block's `attn.lora` / `mlp.lora` (their variables are
`nnx.LoRAParam`, so `nnx.split(model, nnx.LoRAParam, ...)` separates them from the base); A
starts He-uniform, B at zero, so a fresh adapter changes nothing. The decoder computes the
unmerged form above (training); the engines serve merged weights W + (alpha/rank)·A·B
(`merge_lora`), which a weight sync rebuilds on each rollout device from the adapters alone
(`policy.LoraExport`, `tiderl.runtime.parts`).

Target names are PEFT's (what Tunix/verl users write): q_proj, k_proj, v_proj, o_proj (attention),
gate_proj, up_proj, down_proj (MLP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tiderl.models.config import ModelConfig

TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("attn", "wq_dhk"), "k_proj": ("attn", "wk_dkh"), "v_proj": ("attn", "wv_dkh"),
    "o_proj": ("attn", "wo_hkd"), "gate_proj": ("mlp", "w_gate_df"),
    "up_proj": ("mlp", "w_up_df"), "down_proj": ("mlp", "w_down_fd"),
}
"""LoRA target name -> (block part, the base weight it adapts)."""

ALL_TARGETS = tuple(TARGETS)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the decoder builds adapters for (hashable: part of the kernels' cache key)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def part_targets(self, part: str) -> tuple[str, ...]:
        return tuple(t for t in self.targets if TARGETS[t][0] == part)


def _dims(cfg: ModelConfig, name: str) -> tuple[int, int, str, str]:
    """(in features, out features, their logical axis names) of target `name` (flattened)."""
    d, hd, kd, f = (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim,
                    cfg.mlp_dim)
    return {"q_proj": (d, hd, "embed", "heads"), "k_proj": (d, kd, "embed", "kv_heads"),
            "v_proj": (d, kd, "embed", "kv_heads"), "o_proj": (hd, d, "heads", "embed"),
            "gate_proj": (d, f, "embed", "mlp"), "up_proj": (d, f, "embed", "mlp"),
            "down_proj": (f, d, "mlp", "embed")}[name]


def make_adapters(cfg: ModelConfig, spec: LoraSpec, part: str, rngs: nnx.Rngs,
                  param_dtype: Any) -> nnx.Dict | None:
    """The `nnx.LoRA` adapters of one block part ('attn' or 'mlp'), by target name; None when
    the part has no target. Their keys come from the `lora` rng stream, so the base weights are
    drawn exactly as without LoRA (same seed, same base). A is sharded like W's input axis,
    B like its output axis; the rank axis is replicated."""
    names = spec.part_targets(part)
    if not names:
        return None
    out = {}
    for name in names:
        n_in, n_out, ax_in, ax_out = _dims(cfg, name)
        out[name] = nnx.LoRA(
            n_in, spec.rank, n_out, param_dtype=param_dtype,
            rngs=nnx.Rngs(params=rngs.lora()),
            a_metadata={"out_sharding": (ax_in, None), "eager_sharding": False},
            b_metadata={"out_sharding": (None, ax_out), "eager_sharding": False})
    return nnx.Dict(out)


def adapter(adapters: nnx.Dict | None, name: str) -> tuple[jax.Array, jax.Array] | None:
    """(A, B) of target `name`'s adapter, or None without one."""
    if adapters is None or name not in adapters:
        return None
    return adapters[name].lora_a[...], adapters[name].lora_b[...]


def lora_delta(ab: tuple[jax.Array, jax.Array] | None, scale: float, x: jax.Array,
               n_in_axes: int = 1) -> jax.Array | None:
    """scale·(x·A)·B in x's dtype, the last `n_in_axes` axes of x flattened as its input
    (the output flat: the caller reshapes); None without an adapter."""
    if ab is None:
        return None
    cd = x.dtype
    x = x.reshape(*x.shape[:x.ndim - n_in_axes], -1)
    return scale * ((x @ ab[0].astype(cd)) @ ab[1].astype(cd))


def _pairs(adapters: nnx.State) -> dict[tuple, tuple[Any, Any]]:
    """Base weight path -> (A, B) values, from adapter paths (..., part, 'lora', name, a|b)."""
    flat = dict(nnx.to_flat_state(adapters))
    out = {}
    for path, var in flat.items():
        if path[-1] == "lora_a":
            prefix, name = path[:-3], path[-2]
            out[(*prefix, TARGETS[name][1])] = (var[...], flat[(*path[:-1], "lora_b")][...])
    return out


def merge_lora(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
    """`base` with every adapted weight replaced by W + scale·A·B (in fp32, cast back to W's
    dtype); adapters and base in the same layout (both stacked or both per layer). The adapted
    weights are fresh arrays, the others are the base's own (a rollout device keeps one base
    and one merged copy of the adapted weights, not two of everything)."""
    pairs = _pairs(adapters)
    flat = list(nnx.to_flat_state(base))
    missing = set(pairs) - {p for p, _ in flat}
    if missing:
        raise ValueError(f"adapters for weights the base does not have: {sorted(missing)}")
    keys = [p for p, _ in flat if p in pairs]
    ws = [dict(flat)[p][...] for p in keys]
    # Concrete arrays keep their shardings (an engine checks them at update_weights).
    out = (None if any(isinstance(w, jax.core.Tracer) for w in ws)
           else [w.sharding for w in ws])
    merged = jax.jit(_merge_core, out_shardings=out)(ws, [pairs[p] for p in keys],
                                                     jnp.float32(scale))
    new = dict(zip(keys, merged, strict=True))
    return nnx.from_flat_state([(p, v.replace(new[p]) if p in new else v) for p, v in flat])


def _merge_core(ws: list, abs_: list, scale: jax.Array) -> list:
    out = []
    for w, (a, b) in zip(ws, abs_, strict=True):
        delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).reshape(w.shape)
        out.append((w.astype(jnp.float32) + scale * delta).astype(w.dtype))
    return out


def unstack_adapters(adapters: nnx.State, abstract_per_layer: nnx.State) -> nnx.State:
    """Stacked adapters ('layers', *rest) [L, ...] in the per-layer layout ('layers', i,
    *rest) of `abstract_per_layer` (whose variables' metadata the result takes). Fresh arrays:
    jit it."""
    src = dict(nnx.to_flat_state(adapters))
    out = []
    for path, var in nnx.to_flat_state(abstract_per_layer):
        value = src[("layers", *path[2:])][...][path[1]] if path[0] == "layers" else \
            jnp.copy(src[path][...])
        out.append((path, var.replace(value)))
    return nnx.from_flat_state(out)
