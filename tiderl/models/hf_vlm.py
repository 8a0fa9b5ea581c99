"""Hugging Face names and config of the vision-language policies (Qwen2.5-VL, Qwen3-VL).

`tiderl.models.hf` reads and writes the checkpoints; this module says what is different from a
text model: the nested `text_config`/`vision_config` of `config.json` (or Qwen2.5-VL's older
flat form), M-RoPE's `mrope_section`, and the vision tower's tensor names. The language model is
the Qwen2 (Qwen2.5-VL) or Qwen3 (Qwen3-VL) text decoder, its tensors named as in those.

Tensor name prefixes: checkpoints on the Hub and transformers' `save_pretrained` name
Qwen2.5-VL's tensors `model.*` / `visual.*` and Qwen3-VL's `model.language_model.*` /
`model.visual.*`; either form is read (`canonical_name`), and each family is written in its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig, VisionConfig

# architecture → (vision kind, the text architecture of its language model)
VLM_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3ForCausalLM"),
}
VLM_MODEL_TYPES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                   "Qwen3VLForConditionalGeneration": "qwen3_vl"}
# vision kind → (text prefix, vision prefix) as the family's checkpoints write them
PREFIXES = {"qwen2_5_vl": ("model.", "visual."),
            "qwen3_vl": ("model.language_model.", "model.visual.")}
_ACTS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
         "quick_gelu": None}


def canonical_name(name: str) -> str:
    """A checkpoint tensor name in the Qwen2.5-VL form (`model.*`, `visual.*`, `lm_head.*`)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def vlm_architecture(cfg: ModelConfig) -> str:
    kind = cfg.vision.kind if cfg.vision is not None else None
    return next(a for a, (k, _) in VLM_ARCHITECTURES.items() if k == kind)


def _vision_config(v: dict[str, Any], kind: str, top: dict[str, Any],
                   where: str) -> VisionConfig:
    act = v.get("hidden_act", "silu" if kind == "qwen2_5_vl" else "gelu_pytorch_tanh")
    if _ACTS.get(act) is None:
        raise ConfigError(f"{where}: vision_config.hidden_act={act!r} is not supported (silu, "
                          "gelu, gelu_pytorch_tanh)")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        kind=kind,  # type: ignore[arg-type]
        depth=v["depth"], d_model=v["hidden_size"], n_heads=v["num_heads"],
        mlp_dim=v["intermediate_size"], act=_ACTS[act],  # type: ignore[arg-type]
        in_channels=v.get("in_channels", 3), patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        out_dim=v.get("out_hidden_size", v.get("hidden_size")),
        window_size=v.get("window_size", 112) if kind == "qwen2_5_vl" else 0,
        fullatt_blocks=tuple(v.get("fullatt_block_indexes", ())) if kind == "qwen2_5_vl"
        else (),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=v.get("num_position_embeddings", 0) if kind == "qwen3_vl"
        else 0,
        deepstack_blocks=tuple(v.get("deepstack_visual_indexes", ())),
        image_token_id=int(top.get("image_token_id", 151655)),
        vision_start_token_id=int(top.get("vision_start_token_id", 151652)),
    )


def split_vlm_config(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the language model's config.json as its text architecture's, the ModelConfig fields a
    VLM adds) of a VLM `config.json`."""
    arch = hf["architectures"][0]
    kind, text_arch = VLM_ARCHITECTURES[arch]
    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = dict(text.get(key) or {})
    section = rope.pop("mrope_section", None)
    if section is None:
        raise ConfigError(f"{where}: the text config has no {key}.mrope_section; a "
                          f"{arch} checkpoint needs it")
    interleaved = bool(rope.pop("mrope_interleaved", kind == "qwen3_vl"))
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default"):
        rope["rope_type"] = "default"
        rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", 1e6))
    text.update({"architectures": [text_arch], "rope_parameters": rope, "rope_scaling": None,
                 "tie_word_embeddings": hf.get("tie_word_embeddings",
                                               text.get("tie_word_embeddings", False))})
    if kind == "qwen2_5_vl":  # its attention takes head_dim = hidden / heads
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    if "vision_config" not in hf:
        raise ConfigError(f"{where}: {arch} without a vision_config")
    vision = _vision_config(hf["vision_config"], kind, hf, where)
    return text, {"mrope_section": tuple(section), "mrope_interleaved": interleaved,
                  "vision": vision}


def vlm_hf_config(cfg: ModelConfig, text_hf: dict[str, Any],
                  base: dict[str, Any] | None) -> dict[str, Any]:
    """The VLM `config.json` of `cfg` (nested text/vision configs, as transformers 5 writes),
    `text_hf` being its language model's as a text architecture, on top of `base`."""
    v = cfg.vision
    assert v is not None
    arch = vlm_architecture(cfg)
    hf = dict(base or {})
    text = {k: val for k, val in text_hf.items() if k not in ("architectures", "rope_scaling")}
    for k in ("text_config", "vision_config"):
        hf.pop(k, None)
    text["model_type"] = f"{VLM_MODEL_TYPES[arch]}_text"
    rope = dict(text.pop("rope_parameters"))
    rope.update(mrope_section=list(cfg.mrope_section))
    if cfg.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    vision: dict[str, Any] = {
        "model_type": f"{VLM_MODEL_TYPES[arch]}_vision", "depth": v.depth,
        "hidden_size": v.d_model, "num_heads": v.n_heads, "intermediate_size": v.mlp_dim,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(v.act, v.act),
        "in_channels": v.in_channels, "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size, "out_hidden_size": v.out_dim,
        "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"},
    }
    if v.kind == "qwen2_5_vl":
        vision.update(window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_blocks))
    else:
        vision.update(num_position_embeddings=v.num_position_embeddings,
                      deepstack_visual_indexes=list(v.deepstack_blocks))
    if base is not None and "text_config" not in base:  # the older flat form: its text keys
        for k in (*text, "rope_scaling", "architectures"):  # move into text_config
            hf.pop(k, None)
    hf.update({"architectures": [arch], "model_type": VLM_MODEL_TYPES[arch],
               "text_config": text, "vision_config": vision,
               "image_token_id": v.image_token_id,
               "vision_start_token_id": v.vision_start_token_id,
               "tie_word_embeddings": cfg.tie_embeddings, "dtype": cfg.param_dtype})
    return hf


def _linear(hf: str, ours: tuple[Any, ...], bias: bool = True):
    trans = (lambda w: w.T, lambda w: w.T)
    ident = (lambda w: w, lambda w: w)
    yield (hf + ".weight", (*ours, "w_io"), *trans)
    if bias:
        yield (hf + ".bias", (*ours, "b_o"), *ident)


def _norm(hf: str, ours: tuple[Any, ...], layer: bool):
    ident = (lambda w: w, lambda w: w)
    yield (hf + ".weight", (*ours, "scale_d"), *ident)
    if layer:
        yield (hf + ".bias", (*ours, "bias_d"), *ident)


def _merger(hf: str, ours: tuple[Any, ...], kind: str):
    if kind == "qwen2_5_vl":
        yield from _norm(hf + ".ln_q", (*ours, "norm"), False)
        yield from _linear(hf + ".mlp.0", (*ours, "fc1"))
        yield from _linear(hf + ".mlp.2", (*ours, "fc2"))
        return
    yield from _norm(hf + ".norm", (*ours, "norm"), True)
    yield from _linear(hf + ".linear_fc1", (*ours, "fc1"))
    yield from _linear(hf + ".linear_fc2", (*ours, "fc2"))


def vision_tensors(cfg: ModelConfig) -> Iterator[tuple[str, tuple[Any, ...], Any, Any]]:
    """(hf name in the canonical form, our state path, to_ours, to_hf) of the tower's tensors."""
    v = cfg.vision
    assert v is not None
    d, qwen3 = v.d_model, v.kind == "qwen3_vl"
    conv = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    yield ("visual.patch_embed.proj.weight", ("visual", "patch", "w_io"),
           lambda w: w.reshape(d, -1).T, lambda w: w.T.reshape(d, *conv))
    if qwen3:
        yield ("visual.patch_embed.proj.bias", ("visual", "patch", "b_o"),
               lambda w: w, lambda w: w)
        yield ("visual.pos_embed.weight", ("visual", "pos_embed_nd"), lambda w: w, lambda w: w)
    for i in range(v.depth):
        pre, ours = f"visual.blocks.{i}.", ("visual", "blocks", i)
        yield from _norm(pre + "norm1", (*ours, "norm1"), qwen3)
        yield from _norm(pre + "norm2", (*ours, "norm2"), qwen3)
        yield from _linear(pre + "attn.qkv", (*ours, "qkv"))
        yield from _linear(pre + "attn.proj", (*ours, "proj"))
        mlp = (("linear_fc1", "fc1"), ("linear_fc2", "fc2")) if qwen3 else (
            ("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
        for hf_name, name in mlp:
            yield from _linear(pre + "mlp." + hf_name, (*ours, name))
    yield from _merger("visual.merger", ("visual", "merger"), v.kind)
    for j in range(len(v.deepstack_blocks)):
        yield from _merger(f"visual.deepstack_merger_list.{j}", ("visual", "deepstack", j),
                           v.kind)


def written_name(name: str, cfg: ModelConfig) -> str:
    """A canonical tensor name as `cfg`'s family writes it."""
    if cfg.vision is None:
        return name
    text, visual = PREFIXES[cfg.vision.kind]
    if name.startswith("model."):
        return text + name[len("model."):]
    if name.startswith("visual."):
        return visual + name[len("visual."):]
    return name
