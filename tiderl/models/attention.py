"""Training-path attention over packed rows: one entry point, a kernel per `model.attention_impl`.

Rows are packed (`segment_ids`, 0 = padding): a token attends causally within its own segment,
never across, and a padding token only to itself (`layers.packed_causal_mask`). Every kernel
here computes exactly that, so they are interchangeable (tests: equal to 'xla' within 1e-5 in
fp32, values and gradients). The serving path never comes here: it attends through the
engine's paged cache (serving/kv.py).

- 'xla': `layers.attend` with the dense [B, T, T] mask; scores materialised, fp32 softmax.
  Runs everywhere; the reference.
- 'pallas': flash attention in Pallas (`jax.experimental.pallas.ops.gpu.attention.mha`:
  Triton forward and backward kernels), masking from segment ids inside each tile, so no T×T
  array exists in the forward or the backward. The kernel takes as many k/v heads as q heads,
  so grouped k/v are repeated to the query heads first (a [B, T, H, Dh] copy per layer; the
  scores it saves dwarf it). Padding tokens get segment ids of their own (−1 − t) so each sees
  only itself. Off-GPU it runs in Pallas interpret mode (slow; for tests).
- 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')`, cuDNN's fused flash
  attention, with the packed mask passed as its boolean mask (cuDNN adds it as a [B, 1, T, T]
  bias). bf16/fp16 only, head_dim a multiple of 8 up to 128, even T; GPU only.
- 'auto': 'cudnn' on a GPU where it applies (bf16 compute), else 'pallas' on a GPU where it
  applies, else 'xla'. Resolved at trace time from the backend JAX runs on.

Tolerances against 'xla' on a GPU (tests/test_gpu.py): bf16 2e-2 absolute on outputs of unit
scale (both sides round q·k and p·v inputs to bf16 differently); fp32 2e-3 (Triton's fp32 dots
run in TF32 on GPUs).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from tiderl.models.layers import attend, packed_causal_mask

log = logging.getLogger(__name__)

AttentionImpl = Literal["auto", "xla", "pallas", "cudnn"]
IMPLS = ("xla", "pallas", "cudnn")

__all__ = ["AttentionImpl", "IMPLS", "resolve_impl", "train_attention", "training_mask",
           "unsupported"]


def pallas_block(seq_len: int) -> int:
    """The flash kernel's tile along time: the largest power of two ≤ 128 dividing T (0 if
    under 16, which Triton's dot cannot tile)."""
    b = 128
    while b >= 16 and seq_len % b:
        b //= 2
    return b if b >= 16 else 0


def unsupported(impl: str, *, backend: str, compute_dtype: str, head_dim: int,
                seq_len: int) -> str | None:
    """Why `impl` cannot run this attention here, or None if it can."""
    if impl == "xla":
        return None
    if impl == "pallas":
        if not pallas_block(seq_len):
            return f"the Pallas flash kernel tiles time by 16-128 and T={seq_len} is no multiple of 16"
        return None
    if impl == "cudnn":
        if backend != "gpu":
            return f"cuDNN attention needs a GPU (JAX runs on {backend!r})"
        if compute_dtype not in ("bfloat16", "float16"):
            return (f"cuDNN flash attention takes bf16/fp16, not {compute_dtype} "
                    "(set model.compute_dtype=bfloat16)")
        if head_dim % 8 or head_dim > 128:
            return f"cuDNN flash attention needs head_dim a multiple of 8 up to 128, not {head_dim}"
        if seq_len % 2:
            return f"cuDNN attention with a mask needs an even T, not {seq_len}"
        return None
    return f"unknown attention implementation {impl!r}; use one of auto, {', '.join(IMPLS)}"


@functools.cache
def resolve_impl(impl: str, *, backend: str, compute_dtype: str, head_dim: int,
                 seq_len: int) -> str:
    """The kernel `model.attention_impl=impl` means for this shape on `backend`.

    An explicit choice that cannot run is a ValueError naming the key; 'auto' falls back
    ('cudnn' → 'pallas' → 'xla' on a GPU, 'xla' elsewhere) and says so once per shape."""
    shape = dict(backend=backend, compute_dtype=compute_dtype, head_dim=head_dim,
                 seq_len=seq_len)
    if impl != "auto":
        why = unsupported(impl, **shape)
        if why:
            raise ValueError(f"model.attention_impl={impl!r}: {why}; set "
                             "model.attention_impl=auto (or xla)")
        return impl
    if backend != "gpu":
        return "xla"
    for cand in ("cudnn", "pallas"):
        why = unsupported(cand, **shape)
        if why is None:
            return cand
        log.info("model.attention_impl=auto: not %s here (%s)", cand, why)
    return "xla"


def training_mask(segment_ids_bt: Int[Array, "B T"], impl: str) -> Array:
    """What the decoder's blocks carry to `train_attention`: the dense [B, T, T] mask for
    'xla' (built once per forward, shared by the layers), the segment ids for the fused kernels
    (they mask inside their tiles, or build the mask next to the kernel)."""
    return packed_causal_mask(segment_ids_bt) if impl == "xla" else segment_ids_bt


def train_attention(
    q_bthd: Float[Array, "B T H Dh"],
    k_btkd: Float[Array, "B T K Dh"],
    v_btkd: Float[Array, "B T K Dh"],
    mask_or_segments: Bool[Array, "B T T"] | Int[Array, "B T"],
    impl: str,
) -> Float[Array, "B T H Dh"]:
    """Packed causal self-attention with the kernel `impl` (already resolved, not 'auto')."""
    if impl == "xla":
        mask_btt = mask_or_segments
        if mask_btt.ndim == 2:  # given segment ids
            mask_btt = packed_causal_mask(mask_btt)
        return attend(q_bthd, k_btkd, v_btkd, mask_btt)
    if mask_or_segments.ndim != 2:
        raise ValueError(f"attention impl {impl!r} takes segment ids [B, T], got an array of "
                         f"shape {mask_or_segments.shape}")
    if impl == "pallas":
        return pallas_attention(q_bthd, k_btkd, v_btkd, mask_or_segments,
                                interpret=jax.default_backend() != "gpu")
    if impl == "cudnn":
        return dpa_attention(q_bthd, k_btkd, v_btkd, mask_or_segments, implementation="cudnn")
    raise ValueError(f"unknown attention implementation {impl!r}")


def _own_padding_segments(segment_ids_bt: Array) -> Array:
    """Segment 0 (padding) → −1 − t: every padding token a segment of its own."""
    t_t = jnp.arange(segment_ids_bt.shape[1], dtype=jnp.int32)
    return jnp.where(segment_ids_bt == 0, -1 - t_t[None, :], segment_ids_bt).astype(jnp.int32)


def pallas_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, *, interpret: bool):
    """Pallas flash attention (Triton forward and backward) over packed segments."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha

    t, h, dh = q_bthd.shape[1], q_bthd.shape[2], q_bthd.shape[3]
    g = h // k_btkd.shape[2]
    if g > 1:
        k_btkd = jnp.repeat(k_btkd, g, axis=2)
        v_btkd = jnp.repeat(v_btkd, g, axis=2)
    fwd = pallas_block(t)
    # The backward tiles of 32 are the kernel's own defaults (its fused dq/dkv pass needs the
    # same number of q and kv tiles).
    bwd = min(32, fwd)
    blocks = BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd,
                        block_q_dq=bwd, block_kv_dq=bwd)
    return mha(q_bthd, k_btkd, v_btkd, _own_padding_segments(segment_ids_bt),
               sm_scale=float(1.0 / np.sqrt(dh)), causal=True, block_sizes=blocks,
               interpret=interpret)


def dpa_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, *,
                  implementation: Literal["cudnn", "xla"]):
    """`jax.nn.dot_product_attention` with the packed causal mask (GQA native). 'cudnn' is the
    fused GPU kernel; 'xla' is the same call on any backend (what tests run on the CPU)."""
    mask_b1tt = packed_causal_mask(segment_ids_bt)[:, None]
    return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, mask=mask_b1tt,
                                        implementation=implementation)
