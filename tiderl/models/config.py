"""Policy model config. No JAX: the control plane and launch validation import it."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError

DType = Literal["float32", "bfloat16"]
RopeScaling = Literal["none", "llama3"]
AttentionImpl = Literal["auto", "xla", "pallas", "cudnn"]


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
        if self.policy != "decoder" and ":" not in self.policy:
            raise ConfigError(
                f"config key 'model.policy'={self.policy!r}: use 'decoder' or "
                "'package.module:Class' for a custom policy"
            )

    @property
    def llama3_rope(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len), or None unscaled."""
        if self.rope_scaling != "llama3":
            return None
        return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_len)
