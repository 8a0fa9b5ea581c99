"""The weights an engine serves: the trainer's params in the policy's compute dtype.

A bf16-compute run keeps fp32 master weights for the optimizer, but decoding reads every
weight once per step, so an engine holding them in fp32 moves twice the bytes the step needs
(decode is bound by memory bandwidth) and keeps twice the copy next to its KV pool. The
built-in decoder casts each matrix to the compute dtype where it uses it and keeps vectors
(RMSNorm and q/k-norm scales) in fp32 (`rms_norm` upcasts them), so casting the ≥ 2-D float
params ahead of time leaves every value the engine computes unchanged: its logprobs stay those
the trainer recomputes from the master weights (tested). Custom policies are served as given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES
from tiderl.models.policy import LoraExport

__all__ = ["serving_weights"]


def serving_weights(params: Any, cfg: ModelConfig) -> Any:
    """`params` with the built-in decoder's matrices in `cfg.compute_dtype` when that is
    narrower than `cfg.param_dtype` (a new tree on the same devices); otherwise, or for a
    custom policy, `params` itself. A LoRA trainer's export (`policy.LoraExport`) gives its
    merged serving weights."""
    if isinstance(params, LoraExport):
        return params.full()
    cd = DTYPES[cfg.compute_dtype]
    if cfg.policy != "decoder" or (jnp.dtype(cd).itemsize
                                   >= jnp.dtype(DTYPES[cfg.param_dtype]).itemsize):
        return params

    def cast(x: Any) -> Any:
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 and x.dtype != cd:
            return x.astype(cd)
        return x

    return jax.jit(lambda p: jax.tree.map(cast, p))(params)
