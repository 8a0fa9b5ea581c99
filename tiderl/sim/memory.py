"""Per-device memory of each role, from the model's shape and its sharding; what a colocation
that does not fit moves over PCIe. No JAX.

Every number below is derived from the model shape (`tiderl.sim.costs.ModelShape`), the
sharding and the device (`tiderl.sim.costs.Device`), with its derivation beside it; nothing is
fitted to the paper's results.

- **Actor** (mixed-precision Adam, ZeRO-3/FSDP over the trainer's data-parallel GPUs):
  `TRAIN_BYTES_PER_PARAM` = 16 bytes per parameter, sharded: bf16 params (2) + bf16 grads (2)
  + fp32 master params (4) + Adam's first and second moments in fp32 (4 + 4) — the 16Ψ of
  Rajbhandari et al., "ZeRO" (SC'20), §3.1 (2Ψ + 2Ψ + KΨ with K = 12).
- **Ref**: the same architecture in bf16, sharded the same way (`dtype_bytes` per parameter).
- **Gathered layers**: FSDP all-gathers one layer's full bf16 parameters to compute it and
  prefetches the next (two layers' worth, unsharded).
- **Activations of one micro-batch with full rematerialisation** (the trainer's remat policy
  keeps only each layer's input): the bf16 layer inputs of every layer, plus one layer's
  working set while it is recomputed and differentiated, plus the logits (see
  `activation_bytes`).
- **Runtime**: the profile's `memory.runtime_bytes` (CUDA context, library workspaces, NCCL
  buffers, allocator fragmentation; stated in the profile).
- **Rollout** (one engine per rank, tensor-parallel over `gpus_per_rank`): the bf16 weights
  plus the KV pool the engine reserves (`engine.kv_fraction` of HBM in all, as vLLM's
  `gpu_memory_utilization`).

A colocation (Ref and Actor on the same devices; rollout and training in the hybrid engine)
that fits in HBM keeps both resident and pays nothing to alternate; one that does not fit
moves the bytes it is over by, out of and back into host memory at each alternation, over
PCIe (`swap_seconds`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

TRAIN_BYTES_PER_PARAM = 16
"""bf16 params 2 + bf16 grads 2 + fp32 master 4 + Adam m 4 + Adam v 4 (ZeRO, §3.1)."""
FP32 = 4
GATHERED_LAYERS = 2
"""FSDP holds the layer it computes and the one it prefetches, unsharded."""


def layer_working_bytes_per_token(m: Any) -> float:
    """Bytes one decoder layer saves per token for its backward (bf16, flash attention, no
    dropout): the norm outputs feeding attention and the MLP (2·d), Q and the K/V projections
    (d + 2·kv), the attention output and its softmax statistics (d; the (s × s) scores are
    recomputed by flash attention, so the 5·a·s/h term of Korthikanti et al., "Reducing
    Activation Recomputation", MLSys'23, Eq. 1 drops out), the out-projection input (d), the
    residual stream twice (2·d) and the MLP's gate, up and activated outputs (3·mlp_dim) —
    each times the element size."""
    kv = m.n_kv_heads * m.head_dim
    return m.dtype_bytes * (7 * m.d_model + 2 * kv + 3 * m.mlp_dim)


def activation_bytes(m: Any, tokens: float) -> float:
    """Activations of one micro-batch of `tokens` tokens on one device under full remat:
    every layer's bf16 input (the checkpoints), one layer's working set during its recompute
    and backward, and the logits — bf16 from the head plus the fp32 copy the log-softmax of
    the policy loss runs on, and its gradient in bf16 (2 + 4 + 2 bytes per vocabulary entry)."""
    checkpoints = m.n_layers * m.d_model * m.dtype_bytes * tokens
    working = layer_working_bytes_per_token(m) * tokens
    logits = (m.dtype_bytes + FP32 + m.dtype_bytes) * m.vocab * tokens
    return checkpoints + working + logits


@dataclasses.dataclass(frozen=True)
class TrainerMemory:
    """Per-device bytes of the trainer's parts on `gpus` data-parallel devices."""

    actor_state: float
    ref: float
    gathered: float
    activations: float
    runtime: float
    hbm: float

    @property
    def actor_alone(self) -> float:
        return self.actor_state + self.gathered + self.activations + self.runtime

    @property
    def colocated(self) -> float:
        """Ref and Actor resident together, the Actor training one micro-batch."""
        return self.actor_alone + self.ref

    @property
    def colocation_excess(self) -> float:
        """Bytes over HBM when Ref and Actor share the devices (0: both fit, nothing moves)."""
        return max(0.0, self.colocated - self.hbm)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "colocated": self.colocated,
                "colocation_excess": self.colocation_excess}


def trainer_memory(m: Any, dev: Any, *, gpus: int, tokens_per_gpu: int,
                   runtime_bytes: float) -> TrainerMemory:
    """The trainer's per-device bytes: Actor state and Ref sharded over `gpus`, two gathered
    layers, one micro-batch of `tokens_per_gpu` tokens' activations, the runtime."""
    g = max(1, gpus)
    layer = m.layer_params * m.dtype_bytes
    return TrainerMemory(actor_state=TRAIN_BYTES_PER_PARAM * m.params / g,
                         ref=m.params * m.dtype_bytes / g,
                         gathered=GATHERED_LAYERS * layer,
                         activations=activation_bytes(m, tokens_per_gpu),
                         runtime=runtime_bytes, hbm=dev.hbm_bytes)


def rollout_bytes(m: Any, dev: Any, *, gpus_per_rank: int, kv_fraction: float) -> dict:
    """A rollout engine's per-device bytes: its weight shard and the rest of its reservation
    (`kv_fraction` of HBM: KV pool and the engine's activations)."""
    weights = m.weight_bytes / max(1, gpus_per_rank)
    reserved = dev.hbm_bytes * kv_fraction
    return {"weights": weights, "kv_and_activations": max(0.0, reserved - weights),
            "reserved": reserved}


def hybrid_switch_bytes(m: Any, dev: Any, *, gpus: int, gpus_per_rank: int, tokens_per_gpu: int,
                        kv_fraction: float, runtime_bytes: float) -> dict[str, float]:
    """Per-device bytes a colocated hybrid engine (VeRL: rollout and training on the same
    devices, every step) moves over PCIe at each switch, one direction each:

    - rollout → train: the engine sleeps — its weight shard goes to host memory (vLLM's
      `sleep(level=1)`), its KV pool is freed (no bytes: the cache is stale after the update
      anyway); the Actor state and Ref come in from host memory unless they stayed resident
      beside the engine's reservation;
    - train → rollout: the Actor state and Ref go back out when they do not fit beside the
      engine, and the engine wakes (its weights are then overwritten by the resharded new
      weights, which the weight sync charges over the devices' links, so they are not read
      back over PCIe); the KV pool is re-allocated (no bytes).
    """
    tm = trainer_memory(m, dev, gpus=gpus, tokens_per_gpu=tokens_per_gpu,
                        runtime_bytes=runtime_bytes)
    ro = rollout_bytes(m, dev, gpus_per_rank=gpus_per_rank, kv_fraction=kv_fraction)
    state = tm.actor_state + tm.ref
    resident = ro["reserved"] + state + tm.runtime <= dev.hbm_bytes
    moved_state = 0.0 if resident else state
    return {"to_train": ro["weights"] + moved_state, "to_rollout": moved_state,
            "train_state_resident": float(resident), "train_state": state}


def swap_seconds(nbytes: float, pcie_bw: float) -> float:
    """`nbytes` out of the device and as many in: PCIe is full duplex, so the two directions
    overlap and the swap takes `nbytes / pcie_bw` (per direction)."""
    return nbytes / pcie_bw if nbytes > 0 and pcie_bw > 0 else 0.0
