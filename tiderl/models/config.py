"""Policy model config. No JAX: the control plane and launch validation import it."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError

DType = Literal["float32", "bfloat16"]
RopeScaling = Literal["none", "llama3"]
AttentionImpl = Literal["auto", "xla", "pallas", "cudnn"]


def mrope_axes(sections: tuple[int, ...], interleaved: bool) -> tuple[int, ...]:
    """Multimodal RoPE (M-RoPE): the position axis (0 t, 1 h, 2 w) each of the head's Dh/2
    rotary frequencies takes its angle from. `sections` = (t, h, w) counts of frequencies.
    Qwen2-VL/Qwen2.5-VL give each axis a contiguous band (t first, then h, then w); Qwen3-VL
    interleaves them (frequency j is h when j % 3 == 1 and j < 3·h, w when j % 3 == 2 and
    j < 3·w, else t), as transformers' `recomposition_frequencies` lays them out."""
    n = sum(sections)
    if not interleaved:
        return tuple(i % 3 for i, s in enumerate(sections) for _ in range(s))
    axes = [0] * n
    for axis in (1, 2):
        for j in range(axis, min(3 * sections[axis], n), 3):
            axes[j] = axis
    return tuple(axes)


VisionKind = Literal["qwen2_5_vl", "qwen3_vl"]
VisionAct = Literal["silu", "gelu", "gelu_tanh"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The vision tower of a vision-language policy (models/vision.py): what an HF Qwen2.5-VL or
    Qwen3-VL `vision_config` holds, plus the image token ids of the language side."""

    kind: VisionKind = "qwen2_5_vl"
    """'qwen2_5_vl' (RMSNorm, SwiGLU MLP, windowed attention but in `fullatt_blocks`, no patch
    bias) or 'qwen3_vl' (LayerNorm, 2-layer MLP, full attention, patch bias, learned position
    embeddings resampled per image, deepstack mergers)."""
    depth: int = 2
    d_model: int = 32
    n_heads: int = 2
    mlp_dim: int = 64
    act: VisionAct = "silu"
    """The MLP activation: 'silu', 'gelu' (exact) or 'gelu_tanh' (HF gelu_pytorch_tanh)."""
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    """Patches merged (per side) into one language-model token by the merger."""
    out_dim: int = 64
    """The merger's output width: the language model's model.d_model."""
    window_size: int = 112
    """qwen2_5_vl: the attention window side in pixels (window_size / merge / patch merged
    tokens per side); blocks outside `fullatt_blocks` attend within their window."""
    fullatt_blocks: tuple[int, ...] = ()
    """qwen2_5_vl: the blocks attending over the whole image."""
    rope_theta: float = 10000.0
    num_position_embeddings: int = 0
    """qwen3_vl: the learned position grid (a square count, resampled bilinearly per image)."""
    deepstack_blocks: tuple[int, ...] = ()
    """qwen3_vl: blocks whose output is merged and added to the first language layers'."""
    image_token_id: int = 1
    """The placeholder token each merged image feature replaces."""
    vision_start_token_id: int = 0

    def __post_init__(self):
        for name in ("depth", "d_model", "n_heads", "mlp_dim", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "out_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'model.vision.{name}' must be positive, "
                                  f"got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 4:
            raise ConfigError(
                f"config keys 'model.vision.d_model'={self.d_model} and 'model.vision.n_heads'="
                f"{self.n_heads}: the head dim must be a multiple of 4 (2-D RoPE rotates h and "
                "w pairs); pick them so")
        for name in ("fullatt_blocks", "deepstack_blocks"):
            bad = [i for i in getattr(self, name) if not 0 <= i < self.depth]
            if bad:
                raise ConfigError(f"config key 'model.vision.{name}' has blocks {bad} outside "
                                  f"0..{self.depth - 1} (model.vision.depth); drop them")
        if self.kind == "qwen3_vl" and int(self.num_position_embeddings ** 0.5) ** 2 != \
                self.num_position_embeddings:
            raise ConfigError(f"config key 'model.vision.num_position_embeddings'="
                              f"{self.num_position_embeddings} must be a square (a grid of "
                              "learned positions) for kind=qwen3_vl")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of the policy; also what `from_pretrained` fills from an HF config."""

    policy: str = "decoder"
    """'decoder' for the built-in Llama/Qwen2 family, or 'package.module:Class' for a user policy
    (a `nnx.Module` built as `Class(cfg, rngs=...)`)."""
    checkpoint: str = ""
    """Local Hugging Face directory (config.json + *.safetensors) to load; '' initialises."""
    init_from: str = ""
    """'RUN_DIR' or 'RUN_DIR:STEP': start from another tiderl run's trained weights (its newest
    checkpoint, or the one of STEP); that run's config.yaml defines the shape."""
    tokenizer: str = "byte"
    """'byte' (built-in, no download) or the path of an HF tokenizer.json or its folder; with
    model.checkpoint it defaults to the checkpoint folder when that holds a tokenizer.json."""
    vocab_size: int = 272
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm of q and k (weights of size head_dim) before RoPE, as in Qwen3."""
    rope_scaling: RopeScaling = "none"
    """RoPE frequency scaling: 'none', or 'llama3' (Llama 3.1+: low frequencies divided by
    rope_factor, a smooth ramp between rope_low_freq_factor and rope_high_freq_factor)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    """The pre-training context of a llama3-scaled RoPE (HF original_max_position_embeddings)."""
    tie_embeddings: bool = True
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    max_seq_len: int = 2048
    init_std: float = 0.02
    attention_impl: AttentionImpl = "auto"
    """Training-path attention kernel (models/attention.py): 'xla' (dense mask, everywhere),
    'pallas' (flash attention with segment ids; interpret mode off-GPU), 'cudnn' (cuDNN flash
    attention, GPU, bf16), 'auto' (cudnn, else pallas on a GPU; xla elsewhere). All compute the
    same packed causal attention; serving uses the engine's paged kernels instead."""
    scan_layers: bool = False
    """Store the blocks' parameters stacked (one array per kind with a leading layer axis) and
    run the training forward as one `lax.scan` over them: one compiled block (faster compiles
    of deep models) and, with trainer.remat, a backward that recomputes one block at a time
    (XLA:CPU overlaps several blocks' recomputations of an unrolled stack). A layout choice of
    the run, not of the checkpoint: HF import/export and `model.init_from` convert; engines are
    fed per-layer weights (`policy.serving_params`). Built-in decoder only."""
    mrope_section: tuple[int, ...] = ()
    """Multimodal RoPE (Qwen2.5-VL, Qwen3-VL): how many of the head's head_dim/2 rotary
    frequencies turn with the t, h and w positions (three counts summing to head_dim/2); ()
    is plain RoPE. Text tokens have t = h = w, so a text-only call is plain RoPE either way."""
    mrope_interleaved: bool = False
    """Interleave the M-RoPE frequencies over t/h/w (Qwen3-VL) instead of contiguous bands."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language policy (models/vlm.py); null: text only."""
    train_vision: bool = True
    """Train the vision tower; false freezes it (its parameters get no gradient, no optimizer
    update — weight decay included — and no optimizer state)."""
    image_max_pixels: int = 0
    """The largest image area (pixels) the vision tower reads: a bigger screenshot is resized
    to fit, aspect kept (sides multiples of patch_size × spatial_merge_size). 0: the
    checkpoint's preprocessor_config.json, else Qwen2.5-VL's 1,003,520."""

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "mlp_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'model.{name}' must be positive, "
                                  f"got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"config key 'model.n_kv_heads'={self.n_kv_heads} must divide "
                f"model.n_heads={self.n_heads} (grouped-query attention); pick a divisor"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config key 'model.head_dim'={self.head_dim} must be even (RoPE "
                              "rotates pairs); pick an even head_dim")
        if self.rope_scaling == "llama3":
            if self.rope_factor < 1.0:
                raise ConfigError(f"config key 'model.rope_factor'={self.rope_factor} must be "
                                  ">= 1 for rope_scaling=llama3; raise it")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(
                    f"config keys 'model.rope_low_freq_factor'={self.rope_low_freq_factor} and "
                    f"'model.rope_high_freq_factor'={self.rope_high_freq_factor} must satisfy "
                    "0 < low < high for rope_scaling=llama3; set them so")
            if self.rope_original_max_len <= 0:
                raise ConfigError(f"config key 'model.rope_original_max_len'="
                                  f"{self.rope_original_max_len} must be positive; set the "
                                  "pre-training context length")
        if self.scan_layers and self.policy != "decoder":
            raise ConfigError(f"config key 'model.scan_layers'=true needs the built-in decoder, "
                              f"not model.policy={self.policy!r}; set model.scan_layers=false")
        if self.mrope_section and (len(self.mrope_section) != 3
                                   or sum(self.mrope_section) != self.head_dim // 2):
            raise ConfigError(f"config key 'model.mrope_section'={list(self.mrope_section)} "
                              f"must be three counts summing to model.head_dim/2="
                              f"{self.head_dim // 2}; fix them")
        if self.image_max_pixels < 0:
            raise ConfigError(f"config key 'model.image_max_pixels'={self.image_max_pixels} "
                              "must be >= 0 (0: the checkpoint's image processor setting)")
        if self.vision is not None and self.vision.out_dim != self.d_model:
            raise ConfigError(f"config key 'model.vision.out_dim'={self.vision.out_dim} must "
                              f"equal model.d_model={self.d_model} (merged image features "
                              "replace token embeddings); set it so")
        if self.vision is not None and self.vision.deepstack_blocks and self.scan_layers:
            raise ConfigError("config key 'model.scan_layers'=true cannot carry Qwen3-VL's "
                              "deepstack features into the first layers (model.vision."
                              "deepstack_blocks); set model.scan_layers=false")
        if self.vision is not None and self.policy != "decoder":
            raise ConfigError(f"config key 'model.vision' needs the built-in policy, not "
                              f"model.policy={self.policy!r}; set model.vision=null")
        if self.policy != "decoder" and ":" not in self.policy:
            raise ConfigError(
                f"config key 'model.policy'={self.policy!r}: use 'decoder' or "
                "'package.module:Class' for a custom policy"
            )

    @property
    def mrope(self) -> tuple[int, ...] | None:
        """The M-RoPE axis of each rotary frequency (`mrope_axes`), or None."""
        if not self.mrope_section:
            return None
        return mrope_axes(self.mrope_section, self.mrope_interleaved)

    @property
    def llama3_rope(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len), or None unscaled."""
        if self.rope_scaling != "llama3":
            return None
        return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_len)
