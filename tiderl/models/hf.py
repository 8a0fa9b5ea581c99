"""Hugging Face import/export for the decoder family (Qwen2ForCausalLM, LlamaForCausalLM).

Reads a local directory (`config.json` + `model.safetensors` or a sharded
`model.safetensors.index.json`) into our layout, and writes our params back as HF safetensors so
a trained policy can be served elsewhere. Never downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.flax import save_file

from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES, Decoder
from tiderl.models.sharding import state_shardings

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
# Buffers some exporters write that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model; the message lists every problem."""


def load_hf_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
    """Our ModelConfig from an HF `config.json` (errors name unsupported features)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} not found; model.checkpoint must be a local HF "
                                "directory with config.json and *.safetensors")
    hf = json.loads(p.read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{str(p)!r}: architecture {arch!r} is not supported; tiderl imports "
                         f"{', '.join(ARCHITECTURES)}")
    # transformers 4 writes rope_theta (+ rope_scaling); transformers 5 writes rope_parameters.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"{str(p)!r}: rope scaling {rope} is not supported yet; "
                         "use a checkpoint without rope scaling")
    rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ValueError(f"{str(p)!r}: Llama attention_bias/mlp_bias=true is not supported "
                         "(only q/k/v biases, as in Qwen2)")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{str(p)!r}: sliding-window attention is not supported; "
                         "set use_sliding_window=false")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=h,
        n_kv_heads=hf.get("num_key_value_heads") or h,
        head_dim=hf.get("head_dim") or d // h,
        mlp_dim=hf["intermediate_size"],
        rope_theta=rope_theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=dtype,  # type: ignore[arg-type]  # validated by ModelConfig
        compute_dtype=dtype,  # type: ignore[arg-type]
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        checkpoint=str(path),
    )


def _hf_to_ours(cfg: ModelConfig) -> Iterator[tuple[str, tuple[Any, ...], Any, Any]]:
    """(hf name, our state path, to_ours(np) , to_hf(np)) for every tensor of `cfg`."""
    d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def proj_in(heads):  # HF [heads*Dh, D] <-> ours [D, heads, Dh]
        return (lambda w: w.T.reshape(d, heads, dh), lambda w: w.reshape(d, heads * dh).T)

    def bias(heads):
        return (lambda b: b.reshape(heads, dh), lambda b: b.reshape(heads * dh))

    ident = (lambda w: w, lambda w: w)
    trans = (lambda w: w.T, lambda w: w.T)
    o_proj = (lambda w: w.T.reshape(h, dh, d), lambda w: w.reshape(h * dh, d).T)
    yield ("model.embed_tokens.weight", ("embed_vd",), *ident)
    for i in range(cfg.n_layers):
        pre, ours = f"model.layers.{i}.", ("layers", i)
        yield (pre + "self_attn.q_proj.weight", (*ours, "attn", "wq_dhk"), *proj_in(h))
        yield (pre + "self_attn.k_proj.weight", (*ours, "attn", "wk_dkh"), *proj_in(k))
        yield (pre + "self_attn.v_proj.weight", (*ours, "attn", "wv_dkh"), *proj_in(k))
        if cfg.qkv_bias:
            yield (pre + "self_attn.q_proj.bias", (*ours, "attn", "bq_hk"), *bias(h))
            yield (pre + "self_attn.k_proj.bias", (*ours, "attn", "bk_kh"), *bias(k))
            yield (pre + "self_attn.v_proj.bias", (*ours, "attn", "bv_kh"), *bias(k))
        yield (pre + "self_attn.o_proj.weight", (*ours, "attn", "wo_hkd"), *o_proj)
        yield (pre + "mlp.gate_proj.weight", (*ours, "mlp", "w_gate_df"), *trans)
        yield (pre + "mlp.up_proj.weight", (*ours, "mlp", "w_up_df"), *trans)
        yield (pre + "mlp.down_proj.weight", (*ours, "mlp", "w_down_fd"), *trans)
        yield (pre + "input_layernorm.weight", (*ours, "attn_norm_d"), *ident)
        yield (pre + "post_attention_layernorm.weight", (*ours, "mlp_norm_d"), *ident)
    yield ("model.norm.weight", ("final_norm_d",), *ident)
    if not cfg.tie_embeddings:
        yield ("lm_head.weight", ("lm_head_dv",), *trans)


def _open_tensors(path: Path) -> dict[str, Path]:
    """Tensor name → file holding it, for single-file and sharded (index.json) checkpoints."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {str(path)!r}; model.checkpoint must be a "
                                "local HF directory with safetensors weights")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="flax") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def _get(state: nnx.State, path: tuple[Any, ...]) -> Any:
    node: Any = state
    for part in path:
        node = node[part]
    return node


def from_pretrained(path: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None,
                    ) -> Decoder:
    """Loads a local HF Qwen2/Llama directory into a `Decoder` (sharded on `mesh` if given).

    Missing, unexpected and mis-shaped tensors are collected and reported in one error.
    """
    path = Path(path)
    cfg = load_hf_config(path, dtype=dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh) if mesh is not None else None
    where = _open_tensors(path)
    pd = DTYPES[cfg.param_dtype]
    missing, misshaped = [], []
    expected = set()
    handles: dict[Path, Any] = {}
    try:
        for hf_name, ours, to_ours, _ in _hf_to_ours(cfg):
            expected.add(hf_name)
            if hf_name not in where:
                missing.append(hf_name)
                continue
            f = where[hf_name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="flax").__enter__()
            var = _get(state, ours)
            raw = handles[f].get_tensor(hf_name)
            try:
                value = to_ours(raw)
            except (TypeError, ValueError):
                misshaped.append(f"{hf_name}: {tuple(raw.shape)}")
                continue
            if tuple(value.shape) != tuple(var.shape):
                misshaped.append(f"{hf_name}: {tuple(raw.shape)} (expected a tensor mapping to "
                                 f"{tuple(var.shape)})")
                continue
            value = jnp.asarray(value, dtype=pd)
            if shardings is not None:
                value = jax.device_put(value, _get(shardings, ours)[...])
            var.set_value(value)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    unexpected = sorted(
        n for n in where
        if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and n == "lm_head.weight")
    )
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected)}")
        if misshaped:
            parts.append(f"mis-shaped tensors: {'; '.join(misshaped)}")
        raise CheckpointMismatchError(
            f"checkpoint {str(path)!r} does not match its config.json ({cfg.n_layers} layers, "
            f"d_model={cfg.d_model}): " + " | ".join(parts)
        )
    return nnx.merge(graphdef, state)


def save_pretrained(model: nnx.Module, path: str | Path, *,
                    architecture: str | None = None) -> Path:
    """Writes `model` (a built-in Decoder) as an HF directory: config.json + model.safetensors."""
    cfg: ModelConfig = model.cfg
    arch = architecture or ("Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} not supported; use one of {ARCHITECTURES}")
    if arch == "LlamaForCausalLM" and cfg.qkv_bias:
        raise ValueError("a model with qkv biases exports as Qwen2ForCausalLM, not Llama")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    tensors = {}
    for hf_name, ours, _, to_hf in _hf_to_ours(cfg):
        value = np.asarray(jax.device_get(_get(state, ours)[...]))
        tensors[hf_name] = jnp.asarray(np.ascontiguousarray(to_hf(value)))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = {
        "architectures": [arch],
        "model_type": "qwen2" if arch == "Qwen2ForCausalLM" else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype,
    }
    if arch == "LlamaForCausalLM":
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path
