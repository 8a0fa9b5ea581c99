"""Cost models of the engine, the trainer and the links between them, from device profiles.
No JAX.

Every operation costs `c0 + max_k(work_k / rate_k)`: a fixed per-call cost (launch, dispatch,
host bookkeeping) plus the slowest of its resources working in parallel (FLOPs, HBM bytes, link
bytes, PCIe bytes), the roofline form serving simulators use (Vidur, LLMServingSim). The *work*
comes from the model's shape and the operation's exact arguments (the rows and contexts of a
prefill, the sequences of a micro-batch); the *rates* and `c0` come from a device profile
(`tiderl/sim/profiles/*.yaml`, read by `tiderl.sim.device_profile`, whose names are
re-exported here).

Model shapes (`ModelShape`) hold what the work formulas need; the Qwen2.5 presets copy the
numbers of the models' `config.json` files. `SimCostModel` prices one model's operations
under one profile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

from tiderl.configlib import ConfigError
from tiderl.sim import memory
from tiderl.sim.device_profile import (
    COMPONENTS,
    OPS,
    PROFILES,
    Device,
    EngineRules,
    OpCost,
    Profile,
    load_profile,
    profile_from_dict,
)
from tiderl.sim.vision_tower import QWEN3_VL_4B, SCREEN, VisionShape

__all__ = ["COMPONENTS", "MODELS", "OPS", "PROFILES", "Device", "EngineRules", "ModelShape",
           "OpCost", "Profile", "SimCostModel", "load_profile", "model_shape", "profile_from_dict"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder's shape: what FLOP and byte counts need (GQA, SwiGLU, untied or tied head)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab: int
    tied: bool = False
    dtype_bytes: int = 2
    """Bytes per weight/activation element in serving and the bf16 training copy."""
    vision: VisionShape | None = None
    """A vision-language model's tower (`tiderl.sim.vision_tower`): its weights are served
    beside the decoder's, it runs in prefill over the images a call computes, and (frozen) in
    the trainer's Ref and Actor forwards."""

    @functools.cached_property
    def layer_params(self) -> int:
        d, h, k, hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd + 2 * d * k * hd + h * hd * d
        return attn + 3 * d * self.mlp_dim + 2 * d

    @functools.cached_property
    def params(self) -> int:
        emb = self.vocab * self.d_model
        return self.n_layers * self.layer_params + emb * (1 if self.tied else 2) + self.d_model

    @functools.cached_property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through (layers and the output head)."""
        return self.n_layers * self.layer_params + self.vocab * self.d_model

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @functools.cached_property
    def weight_bytes(self) -> int:
        tower = self.vision.weight_bytes(self.dtype_bytes) if self.vision else 0
        return self.params * self.dtype_bytes + tower

    @functools.cached_property
    def vision_flops_per_token(self) -> float:
        """The tower's forward FLOPs per image token, every image a 1280×720 screenshot
        (`tiderl.sim.vision_tower.SCREEN`, the paper's GUI tasks): 0 without a tower."""
        if self.vision is None:
            return 0.0
        return self.vision.flops_per_image(*SCREEN) / self.vision.image_tokens(*SCREEN)

    def attn_flops(self, pairs: float) -> float:
        """FLOPs of attention over `pairs` (query, key) pairs: QKᵀ and AV, every layer."""
        return 4.0 * self.n_layers * self.n_heads * self.head_dim * pairs

    def forward_flops(self, tokens: float, pairs: float) -> float:
        return 2.0 * self.matmul_params * tokens + self.attn_flops(pairs)


# Qwen2.5 shapes, from the Hugging Face config.json of Qwen/Qwen2.5-7B(-Instruct) and -14B.
MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", n_layers=28, d_model=3584, n_heads=28,
                             n_kv_heads=4, head_dim=128, mlp_dim=18944, vocab=152064),
    "qwen2.5-14b": ModelShape(name="qwen2.5-14b", n_layers=48, d_model=5120, n_heads=40,
                              n_kv_heads=8, head_dim=128, mlp_dim=13824, vocab=152064),
    # Qwen3-4B's text decoder (the language model of Qwen3-VL-4B), without the tower.
    "qwen3-4b": ModelShape(name="qwen3-4b", n_layers=36, d_model=2560, n_heads=32,
                           n_kv_heads=8, head_dim=128, mlp_dim=9728, vocab=151936, tied=True),
    # Qwen3-VL-4B (config.json of Qwen/Qwen3-VL-4B-Instruct): the same decoder (text_config)
    # with its vision tower (vision_config, tiderl.sim.vision_tower).
    "qwen3-vl-4b": ModelShape(name="qwen3-vl-4b", n_layers=36, d_model=2560, n_heads=32,
                              n_kv_heads=8, head_dim=128, mlp_dim=9728, vocab=151936, tied=True,
                              vision=QWEN3_VL_4B),
    # The embedded CPU default (configs/default.yaml), float32.
    "tiny": ModelShape(name="tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                       head_dim=16, mlp_dim=128, vocab=272, tied=True, dtype_bytes=4),
}


def model_shape(name: str) -> ModelShape:
    if name not in MODELS:
        raise ConfigError(f"sim model {name!r} is unknown; use one of {sorted(MODELS)}")
    return MODELS[name]


def _pow2_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1] * math.ceil(n / buckets[-1])


class SimCostModel:
    """Costs of one model's operations under one profile (seconds)."""

    def __init__(self, profile: Profile, model: ModelShape):
        self.profile, self.model = profile, model
        self.rules = profile.engine
        self._ops = {k: profile.op(k) for k in profile.ops}

    # -- engine ----------------------------------------------------------------------------
    def kv_capacity_tokens(self, gpus_per_rank: int = 1) -> int:
        """Tokens of KV a rollout rank holds (HBM share minus weights and activations)."""
        dev = self.profile.device
        if dev is None:
            raise ConfigError(f"profile {self.profile.name!r} has no device section; give the "
                              "KV pool size explicitly")
        free = gpus_per_rank * (dev.hbm_bytes * self.rules.kv_fraction
                                - self.rules.activation_bytes) - self.model.weight_bytes
        if free <= 0:
            raise ConfigError(f"model {self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB "
                              f"of weights) does not fit a rollout rank of {gpus_per_rank} "
                              f"{self.profile.name} device(s); use more devices per rank")
        return int(free // self.model.kv_bytes_per_token)

    def prefill_work(self, rows: Sequence[tuple[int, int]], gpus: int = 1
                     ) -> list[dict[str, float]]:
        """Work of each device round of one prefill call over `rows` of (cached prefix, new
        tokens), the engine's rules applied: long inputs in chunks of the largest bucket, each
        round padded to its buckets when the engine pads."""
        r, m = self.rules, self.model
        chunk = r.prefill_buckets[-1]
        todo = [[c, n] for c, n in rows if n > 0]
        out = []
        while todo:
            take = [min(chunk, n) for _, n in todo]
            if r.padded:
                t = _bucket(max(take), r.prefill_buckets)
                b = _bucket(len(todo), r.decode_buckets)
                tokens = b * t
                pairs = b * t * r.max_context  # gather attention over the whole page table
                kv_read = b * r.max_context
            else:
                tokens = sum(take)
                pairs = sum(n * c + n * (n + 1) / 2
                            for (c, _), n in zip(todo, take, strict=True))
                kv_read = sum(c for c, _ in todo)
            flops = m.forward_flops(tokens, pairs)
            hbm = m.weight_bytes + m.kv_bytes_per_token * (kv_read + tokens)
            out.append({"flops": flops / gpus, "hbm": hbm / gpus})
            for row, n in zip(todo, take, strict=True):
                row[0] += n
                row[1] -= n
            todo = [row for row in todo if row[1] > 0]
        return out

    def prefill(self, rows: Sequence[tuple[int, int]], gpus: int = 1, *,
                image_tokens: int = 0) -> float:
        """One prefill call (see `prefill_work`): the sum of its rounds, plus the vision
        tower over the images whose `image_tokens` the call computes (`vision_prefill`)."""
        op = self._ops["prefill"]
        t = sum(op(**w) for w in self.prefill_work(rows, gpus))
        return t + self.vision_prefill(image_tokens, gpus) if image_tokens else t

    def sample(self, rows: int) -> float:
        """Sampling the first token of `rows` siblings from logits a sibling computed (prefix
        sharing: nothing is prefilled for them): one call reading each row's float32 logits.
        A profile without `ops.sample` charges nothing for it."""
        op = self._ops.get("sample")
        if op is None or rows <= 0:
            return 0.0
        return op(hbm=rows * self.model.vocab * 4.0)

    def vision_prefill(self, image_tokens: int, gpus: int = 1) -> float:
        """The vision tower over the images of `image_tokens` language-model tokens, inside a
        prefill call (no call overhead of its own): its FLOPs at the prefill rate or its
        weights read once at the HBM rate, the slower. 0 for a model without a tower."""
        m = self.model
        if m.vision is None or image_tokens <= 0:
            return 0.0
        op = self._ops["prefill"]
        return op(flops=m.vision_flops_per_token * image_tokens / gpus,
                  hbm=m.vision.weight_bytes(m.dtype_bytes) / gpus) - op.c0

    def decode_work(self, *, batch: int, context_sum: int, gpus: int = 1) -> dict[str, float]:
        r, m = self.rules, self.model
        if r.padded:
            batch = _bucket(batch, r.decode_buckets)
            context_sum = batch * r.max_context
        return {"flops": m.forward_flops(batch, context_sum) / gpus,
                "hbm": (m.weight_bytes + m.kv_bytes_per_token * context_sum) / gpus}

    def decode_fn(self, gpus: int = 1) -> Callable[[int, int], float]:
        """`lambda batch, context_sum: decode(batch=..., context_sum=..., gpus=gpus)` with the
        model's constants hoisted: the same arithmetic in the same order, so the same floats
        (a simulated engine prices every decode step; tests check it against `decode`)."""
        op, m = self._ops["decode"], self.model
        if self.rules.padded or any(k not in ("flops", "hbm") for k, r in op.rates if r > 0):
            return lambda batch, context_sum: self.decode(batch=batch, context_sum=context_sum,
                                                          gpus=gpus)
        c0 = op.c0
        rates = [(k, r) for k, r in op.rates if r > 0]
        mm2 = 2.0 * m.matmul_params
        att = 4.0 * m.n_layers * m.n_heads * m.head_dim
        wb, kvb = m.weight_bytes, m.kv_bytes_per_token

        def cost(batch: int, context_sum: int) -> float:
            if batch <= 0:
                return 0.0
            t = 0.0
            for k, rate in rates:
                w = ((mm2 * batch + att * context_sum) / gpus if k == "flops"
                     else (wb + kvb * context_sum) / gpus)
                if w > 0:
                    t = max(t, w / rate)
            return c0 + t

        return cost

    def decode(self, contexts: Sequence[int] | None = None, *, batch: int = 0,
               context_sum: int = 0, gpus: int = 1) -> float:
        """One decode step of `batch` rows whose contexts sum to `context_sum`."""
        if contexts is not None:
            batch, context_sum = len(contexts), sum(contexts)
        if batch <= 0:
            return 0.0
        return self._ops["decode"](**self.decode_work(batch=batch, context_sum=context_sum,
                                                       gpus=gpus))

    # -- trainer ----------------------------------------------------------------------------
    def train_work(self, rank_lens: Sequence[Sequence[int]], *, row_len: int | None,
                    backward: bool, rank_images: Sequence[int] = ()) -> dict[str, float]:
        """Work of one micro-batch on a data-parallel group, one list of sequence lengths per
        rank: the busiest rank's compute (ranks wait for each other at the collectives) and the
        group's FSDP traffic. `rank_images`: image tokens per rank, whose features a forward
        recomputes with the (frozen) vision tower; a backward does not reach the tower."""
        m = self.model
        gpus = max(1, len(rank_lens))
        mult = 2.0 if backward else 1.0  # a backward pass is twice its forward
        tower = 0.0 if backward else m.vision_flops_per_token
        flops = act = 0.0
        for i, lens in enumerate(rank_lens):
            if row_len:  # the JAX trainer: packed rows of row_len, bucketed to powers of 2
                rows = _pow2_bucket(max(1, math.ceil(sum(lens) / row_len)))
                tokens, pairs = rows * row_len, rows * row_len * row_len
            else:
                tokens, pairs = sum(lens), sum(s * (s + 1) / 2 for s in lens)
            images = rank_images[i] if i < len(rank_images) else 0
            flops = max(flops, mult * m.forward_flops(tokens, pairs) + tower * images)
            act = max(act, mult * tokens * m.d_model * m.n_layers * 16)
        hbm = mult * m.weight_bytes / gpus + act
        # FSDP: params all-gathered in the forward; all-gathered again and grads
        # reduce-scattered in the backward: each GPU moves (g-1)/g of the bf16 params per one.
        link = self.link_bytes(mult * m.weight_bytes * (gpus - 1) / gpus, gpus)
        return {"flops": flops, "hbm": hbm, "link": link}

    def link_bytes(self, nbytes: float, gpus: int) -> float:
        """`nbytes` over the group's slowest link, in NVLink-equivalent bytes: a group that
        spans nodes runs its collectives at the cross-node bandwidth."""
        dev = self.profile.device
        if dev is None or gpus <= dev.gpus_per_node or not dev.cross_node_bw:
            return nbytes
        return nbytes * dev.nvlink_bw / dev.cross_node_bw

    def ref_forward(self, rank_lens: Sequence[Sequence[int]], *,
                    row_len: int | None = None, images: Sequence[int] = ()) -> float:
        return self._ops["ref_forward"](**self.train_work(rank_lens, row_len=row_len,
                                                           backward=False, rank_images=images))

    def actor_forward(self, rank_lens: Sequence[Sequence[int]], *,
                      row_len: int | None = None, images: Sequence[int] = ()) -> float:
        return self._ops["actor_forward"](**self.train_work(rank_lens, row_len=row_len,
                                                             backward=False,
                                                             rank_images=images))

    def actor_backward(self, rank_lens: Sequence[Sequence[int]], *,
                       row_len: int | None = None, images: Sequence[int] = ()) -> float:
        return self._ops["actor_backward"](**self.train_work(rank_lens, row_len=row_len,
                                                              backward=True,
                                                              rank_images=images))

    # -- memory (tiderl.sim.memory) -----------------------------------------------------------
    def _device(self) -> Device:
        if self.profile.device is None:
            raise ConfigError(f"profile {self.profile.name!r} has no device section; memory-"
                              "derived costs need the device's HBM and PCIe bandwidth")
        return self.profile.device

    def trainer_memory(self, gpus: int, tokens_per_gpu: int) -> memory.TrainerMemory:
        return memory.trainer_memory(self.model, self._device(), gpus=gpus,
                                     tokens_per_gpu=tokens_per_gpu,
                                     runtime_bytes=self.profile.memory.get("runtime_bytes", 0.0))

    def colocation_swap(self, gpus: int, tokens_per_gpu: int) -> float:
        """Seconds one Ref/Actor alternation spends on PCIe when both do not fit one device
        (the bytes they are over HBM by, out and in); 0 when they fit. Where the Actor alone
        does not fit either, its optimizer state is offloaded too (as VeRL's
        `optimizer_offload`); the alternation still moves at least the excess, so this is a
        lower bound there."""
        tm = self.trainer_memory(gpus, tokens_per_gpu)
        return self._ops["swap"](pcie=tm.colocation_excess) if tm.colocation_excess else 0.0

    def hybrid_switch(self, gpus: int, gpus_per_rank: int, tokens_per_gpu: int
                      ) -> dict[str, float]:
        """Seconds of the hybrid engine's two switches per step (`to_train`, `to_rollout`),
        from the bytes `tiderl.sim.memory.hybrid_switch_bytes` says move over PCIe."""
        b = memory.hybrid_switch_bytes(self.model, self._device(), gpus=gpus,
                                       gpus_per_rank=gpus_per_rank,
                                       tokens_per_gpu=tokens_per_gpu,
                                       kv_fraction=self.rules.kv_fraction,
                                       runtime_bytes=self.profile.memory.get("runtime_bytes",
                                                                             0.0))
        swap = self._ops["swap"]
        return {"to_train": swap(pcie=b["to_train"]), "to_rollout": swap(pcie=b["to_rollout"]),
                **{f"bytes_{k}": v for k, v in b.items()}}

    def reshard(self, gpus: int) -> float:
        """The hybrid engine's weight update: every device all-gathers the full bf16 weights
        from the trainer's FSDP shards ((g-1)/g of them over the group's slowest link)."""
        g = max(1, gpus)
        return self._ops["weight_sync"](link=self.link_bytes(
            self.model.weight_bytes * (g - 1) / g, g))

    def actor_state_bytes(self) -> float:
        """Actor state moved by an offload: bf16 params and grads (accumulating over the step's
        micro-batches), fp32 master copy, Adam's two moments (`memory.TRAIN_BYTES_PER_PARAM`)."""
        return self.model.params * memory.TRAIN_BYTES_PER_PARAM

    def apply(self, gpus: int = 1) -> float:
        """Optimizer update: reads grads and state, writes params and state (sharded)."""
        p = self.model.params / gpus
        return self._ops["apply"](hbm=p * (4 + 2 * 12 + self.model.dtype_bytes))

    def swap(self, role: str, gpus: int = 1) -> float:
        """One model's state between device and host memory, one direction (sharded)."""
        nbytes = self.actor_state_bytes() if role == "actor" else self.model.weight_bytes
        return self._ops["swap"](pcie=nbytes / gpus)

    def weight_sync(self, *, cross_node: bool, gpus_per_rank: int = 1) -> float:
        """New weights from the trainer to every rollout rank (a pipelined broadcast: each rank
        receives its shard of the bf16 weights once)."""
        nbytes = self.model.weight_bytes / gpus_per_rank
        if cross_node:
            nbytes = self.link_bytes(nbytes, 1 << 30)
        return self._ops["weight_sync"](link=nbytes)

    def role_change(self, gpus: int = 1) -> float:
        """A rank changing role loads the other model's weights over PCIe (the Ref from host
        memory; a leaving rollout rank drops its weights and KV)."""
        return self._ops["role_change"](pcie=self.model.weight_bytes / gpus)

    def env_call(self) -> float:
        """Protocol overhead of one environment call (HTTP round trip), besides its latency."""
        op = self._ops.get("env_call")
        return op() if op is not None else 0.0

    def env_served(self) -> tuple[float, float]:
        """An env call's host work when the env is served by a process of its own: (the
        client's, on the job's event loop; the server's, on its own thread), the profile's
        `env_client` and `env_server` (`tiderl.sim.hostcost.env_served_cpu_s`)."""
        missing = [k for k in ("env_client", "env_server") if k not in self._ops]
        if missing:
            raise ConfigError(
                f"sim profile {self.profile.name!r} has no {' or '.join(missing)} cost, which a "
                "job with its env served by another process needs; measure them with `python -m "
                "tiderl.sim.calibrate --host-only` (or add ops.env_client and ops.env_server, "
                "CPU seconds per call, to the profile)")
        return self._ops["env_client"](), self._ops["env_server"]()

    def context_switch(self) -> float:
        """Fixed cost of one Ref/Actor alternation on shared devices, besides any swap."""
        return self._ops["context_switch"]()
