"""Policy model config. No JAX: the control plane and launch validation import it."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError

DType = Literal["float32", "bfloat16"]


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
    tie_embeddings: bool = True
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    max_seq_len: int = 2048
    init_std: float = 0.02

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
        if self.policy != "decoder" and ":" not in self.policy:
            raise ConfigError(
                f"config key 'model.policy'={self.policy!r}: use 'decoder' or "
                "'package.module:Class' for a custom policy"
            )
