"""Hugging Face import/export for the decoder family (Qwen2ForCausalLM, Qwen3ForCausalLM,
LlamaForCausalLM, with Llama 3.1's 'llama3' RoPE scaling).

Reads a local directory (`config.json` + `model.safetensors` or a sharded
`model.safetensors.index.json`) into our layout, and writes our params back as HF safetensors so
a trained policy can be served elsewhere. A llama.cpp `.gguf` file is first converted into such a
directory (tiderl/models/gguf.py). Never downloads anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES, Decoder
from tiderl.models.hf_vlm import (
    VLM_ARCHITECTURES,
    VLM_MODEL_TYPES,
    canonical_name,
    split_vlm_config,
    vision_tensors,
    vlm_architecture,
    vlm_hf_config,
    written_name,
)
from tiderl.models.sharding import state_shardings
from tiderl.models.vlm import VisionLanguageModel

TEXT_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")
ARCHITECTURES = (*TEXT_ARCHITECTURES, *VLM_ARCHITECTURES)
MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
               "Qwen3ForCausalLM": "qwen3", **VLM_MODEL_TYPES}
# Buffers some exporters write that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


class CheckpointMismatchError(ConfigError):
    """The checkpoint's tensors do not match the model; the message lists every problem."""


def _rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's rope_* fields from an HF config (transformers 4 `rope_theta` +
    `rope_scaling`, or transformers 5 `rope_parameters`, resolved as transformers does)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(key) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: per-layer-type {key} are not supported; use a checkpoint "
                          "with one RoPE for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial} is not supported (tiderl "
                          "rotates the whole head); use a checkpoint without it")
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if rope_type != "llama3":
        raise ConfigError(f"{where}: rope scaling {key}.rope_type={rope_type!r} is not supported "
                          "(tiderl implements 'default' and 'llama3'); use a checkpoint without it")
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise ConfigError(f"{where}: {key} of rope_type 'llama3' lacks {', '.join(missing)}; "
                          "add them to config.json")
    original = (params.get("original_max_position_embeddings")
                or hf.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings", 2048))
    return {"rope_theta": theta, "rope_scaling": "llama3",
            "rope_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_len": int(original)}


def _folder(path: str | Path) -> Path:
    """`path` itself, or for a .gguf file its converted HF folder (tiderl.models.gguf)."""
    from tiderl.models.gguf import gguf_folder, is_gguf

    return gguf_folder(path) if is_gguf(path) else Path(path)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The raw `config.json` of a local HF directory (FileNotFoundError naming it otherwise);
    a .gguf file is converted (once, cached) and its folder's config.json read."""
    p = _folder(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} not found; model.checkpoint must be a local HF "
                                "directory with config.json and *.safetensors")
    return json.loads(p.read_text())


def load_hf_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
    """Our ModelConfig from an HF `config.json` (a ConfigError names any unsupported feature).
    For a .gguf file, `checkpoint` is its converted folder."""
    path = _folder(path)
    hf = read_hf_config(path)
    where = f"config key 'model.checkpoint'={str(path)!r}: its config.json"
    arch = (hf.get("architectures") or ["?"])[0]
    if arch in VLM_ARCHITECTURES:  # the language model's config, plus the vision tower
        text_hf, extras = split_vlm_config(hf, where)
        return dataclasses.replace(_text_config(text_hf, path, where, dtype), **extras)
    return _text_config(hf, path, where, dtype)


def _text_config(hf: dict[str, Any], path: Path, where: str, dtype: str) -> ModelConfig:
    """The ModelConfig of a text architecture's config.json `hf`."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in TEXT_ARCHITECTURES:
        raise ConfigError(f"{where} has architecture {arch!r}, which is not supported; tiderl "
                          f"imports {', '.join(ARCHITECTURES)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where} has hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ConfigError(f"{where} has attention_bias/mlp_bias=true, which Llama export/import "
                          "does not support (o_proj and MLP biases); use a bias-free checkpoint")
    if arch == "Qwen3ForCausalLM" and hf.get("attention_bias"):
        raise ConfigError(f"{where} has attention_bias=true, which Qwen3 import does not support "
                          "(o_proj bias); use a bias-free checkpoint")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ConfigError(f"{where} enables sliding-window attention (use_sliding_window/"
                          "layer_types), which is not supported; use full attention in all layers")
    rope = _rope_fields(hf, where)
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=h,
        n_kv_heads=hf.get("num_key_value_heads") or h,
        head_dim=hf.get("head_dim") or d // h,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=dtype,  # type: ignore[arg-type]  # validated by ModelConfig
        compute_dtype=dtype,  # type: ignore[arg-type]
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        checkpoint=str(path),
        **rope,
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
        if cfg.qk_norm:
            yield (pre + "self_attn.q_norm.weight", (*ours, "attn", "q_norm_dh"), *ident)
            yield (pre + "self_attn.k_norm.weight", (*ours, "attn", "k_norm_dh"), *ident)
        yield (pre + "self_attn.o_proj.weight", (*ours, "attn", "wo_hkd"), *o_proj)
        yield (pre + "mlp.gate_proj.weight", (*ours, "mlp", "w_gate_df"), *trans)
        yield (pre + "mlp.up_proj.weight", (*ours, "mlp", "w_up_df"), *trans)
        yield (pre + "mlp.down_proj.weight", (*ours, "mlp", "w_down_fd"), *trans)
        yield (pre + "input_layernorm.weight", (*ours, "attn_norm_d"), *ident)
        yield (pre + "post_attention_layernorm.weight", (*ours, "mlp_norm_d"), *ident)
    yield ("model.norm.weight", ("final_norm_d",), *ident)
    if not cfg.tie_embeddings:
        yield ("lm_head.weight", ("lm_head_dv",), *trans)
    if cfg.vision is not None:
        yield from vision_tensors(cfg)


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


def _sharding_at(shardings: Any, path: tuple[Any, ...]) -> NamedSharding:
    """The NamedSharding at `path` of `state_shardings(...)`, whose leaves are Variables holding
    a NamedSharding (or bare NamedShardings for non-Variable leaves)."""
    node = _get(shardings, path)
    return node.get_raw_value() if isinstance(node, nnx.Variable) else node


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """Reads tensors into host memory (the CPU backend) when there is one, so a large tensor is
    never materialised whole on an accelerator before it is sharded."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # jax_platforms excludes cpu: read onto the default device
        yield
        return
    with jax.default_device(cpu):
        yield


def _layer_path(ours: tuple[Any, ...], stacked: bool) -> tuple[tuple[Any, ...], int | None]:
    """(path in our state, layer index into a stacked array or None) of a `_hf_to_ours` path."""
    if stacked and ours[0] == "layers":
        return ("layers", *ours[2:]), ours[1]
    return ours, None


def from_pretrained(path: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None,
                    scan_layers: bool = False) -> Decoder:
    """Loads a local HF Qwen2/Qwen3/Llama directory into a `Decoder` (a Qwen2.5-VL/Qwen3-VL
    one into a `VisionLanguageModel`).

    With `mesh`, every parameter is placed straight into its NamedSharding from host memory
    (each device receives only its shard). `scan_layers` builds the stacked layout
    (`model.scan_layers`): each kind of layer tensor is stacked on the host, then placed.
    Missing, unexpected and mis-shaped tensors are collected and reported in one error.
    A .gguf file is read through its converted HF folder (tiderl.models.gguf).
    """
    path = _folder(path)
    cfg = dataclasses.replace(load_hf_config(path, dtype=dtype), scan_layers=scan_layers)
    cls = Decoder if cfg.vision is None else VisionLanguageModel
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh) if mesh is not None else None
    # Canonical name → (file, the name stored): VLM checkpoints name their parts two ways.
    where = {canonical_name(n): (f, n) for n, f in _open_tensors(path).items()}
    pd = np.dtype(DTYPES[cfg.param_dtype])
    missing, misshaped = [], []
    expected = set()
    layers: dict[tuple[Any, ...], dict[int, np.ndarray]] = {}  # stacked: path → layer → value

    def place(ours: tuple[Any, ...], value: np.ndarray) -> None:
        sharding = _sharding_at(shardings, ours) if shardings is not None else None
        _get(state, ours).set_value(jax.device_put(value, sharding))

    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for hf_name, ours, to_ours, _ in _hf_to_ours(cfg):
            expected.add(hf_name)
            if hf_name not in where:
                missing.append(hf_name)
                continue
            f, stored = where[hf_name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="flax"))
            at, layer = _layer_path(ours, cfg.scan_layers)
            want = tuple(_get(state, at).shape)[0 if layer is None else 1:]
            with _on_host():
                raw = np.asarray(handles[f].get_tensor(stored))
            try:
                value = to_ours(raw)
            except (TypeError, ValueError):
                misshaped.append(f"{hf_name}: {tuple(raw.shape)}")
                continue
            if tuple(value.shape) != want:
                misshaped.append(f"{hf_name}: {tuple(raw.shape)} (expected a tensor mapping to "
                                 f"{want})")
                continue
            value = np.ascontiguousarray(value.astype(pd))
            if layer is None:
                place(at, value)
            else:
                layers.setdefault(at, {})[layer] = value
    for at, per_layer in layers.items():
        if len(per_layer) == cfg.n_layers:  # else a tensor is missing: reported below
            place(at, np.stack([per_layer[i] for i in range(cfg.n_layers)]))
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


def default_architecture(cfg: ModelConfig) -> str:
    """The HF architecture a config exports as when none is asked for."""
    if cfg.vision is not None:
        return vlm_architecture(cfg)
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, architecture: str | None = None,
              base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF `config.json` of `cfg` as `architecture`, on top of `base` (a source checkpoint's
    config.json, so that token ids and other keys we do not model are kept).

    Written for both transformers 4 (`rope_theta` + `rope_scaling`, `torch_dtype`) and
    transformers 5 (`rope_parameters`, `dtype`)."""
    arch = architecture or default_architecture(cfg)
    if cfg.vision is not None or arch in VLM_ARCHITECTURES:
        if cfg.vision is None or arch != vlm_architecture(cfg):
            raise ValueError(f"architecture {arch!r} does not fit this model (vision: "
                             f"{cfg.vision.kind if cfg.vision else 'none'}); export as "
                             f"{default_architecture(cfg)}")
        text_cfg = dataclasses.replace(cfg, vision=None, mrope_section=())
        text_arch = VLM_ARCHITECTURES[arch][1]
        text_base = (base or {}).get("text_config") or {}
        return vlm_hf_config(cfg, hf_config(text_cfg, text_arch, text_base), base)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} not supported; use one of {ARCHITECTURES}")
    if arch == "Qwen2ForCausalLM" and (not cfg.qkv_bias or cfg.qk_norm):
        raise ValueError("Qwen2ForCausalLM needs model.qkv_bias=true and model.qk_norm=false; "
                         f"export as {default_architecture(cfg)}")
    if arch == "LlamaForCausalLM" and (cfg.qkv_bias or cfg.qk_norm):
        raise ValueError("LlamaForCausalLM has no qkv biases or q/k norm; export as "
                         f"{default_architecture(cfg)}")
    if arch == "Qwen3ForCausalLM" and (cfg.qkv_bias or not cfg.qk_norm):
        raise ValueError("Qwen3ForCausalLM needs model.qk_norm=true and model.qkv_bias=false; "
                         f"export as {default_architecture(cfg)}")
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor,
                    low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    hf = dict(base or {})
    for stale in ("original_max_position_embeddings", "partial_rotary_factor"):
        hf.pop(stale, None)
    hf.update({
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": dict(rope) if cfg.rope_scaling != "none" else None,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype,
        "dtype": cfg.param_dtype,
    })
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        hf["attention_bias"] = False
    if arch == "LlamaForCausalLM":
        hf["mlp_bias"] = False
    if arch != "LlamaForCausalLM":
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        hf["layer_types"] = ["full_attention"] * cfg.n_layers
    return hf


def save_pretrained(model: nnx.Module, path: str | Path, *, architecture: str | None = None,
                    base_config: dict[str, Any] | None = None) -> Path:
    """Writes `model` (a built-in Decoder) as an HF directory: config.json + model.safetensors.

    `architecture` defaults to Qwen3 with q/k norm, Qwen2 with qkv biases, Llama otherwise;
    `base_config` (a source config.json) supplies the keys we do not model (token ids, ...).
    Tensors are gathered to host memory one at a time (a stacked layout: one kind of layer
    tensor at a time) and written in the parameter dtype."""
    cfg: ModelConfig = model.cfg
    hf = hf_config(cfg, architecture, base_config)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    tensors = {}
    host: dict[tuple[Any, ...], np.ndarray] = {}
    entries = list(_hf_to_ours(cfg))
    if cfg.scan_layers:  # one kind of tensor over all layers, then the next kind
        entries.sort(key=lambda e: str(_layer_path(e[1], True)[0]))
    for hf_name, ours, _, to_hf in entries:
        at, layer = _layer_path(ours, cfg.scan_layers)
        if at not in host:
            host.clear()  # keep one stacked array on the host at a time
            host[at] = np.asarray(jax.device_get(_get(state, at)[...]))
        value = host[at] if layer is None else host[at][layer]
        tensors[written_name(hf_name, cfg)] = np.ascontiguousarray(to_hf(value))
    save_numpy(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return path
