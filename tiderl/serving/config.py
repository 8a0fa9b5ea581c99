"""Rollout-side config: engine shape, sampling, scheduler (JAX-free)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError
from tiderl.serving.ctb import CTBConfig


def _check_buckets(name: str, buckets: tuple[int, ...]) -> None:
    if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ConfigError(f"config key 'rollout.{name}'={buckets!r} must be a non-empty, strictly "
                          "increasing list of positive sizes; e.g. [16, 64, 256]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Rollout ranks (one engine each), their KV pool, sampling and scheduling policy."""

    ranks: int = 1
    devices_per_rank: int = 1
    """Devices of one rank (its cell): > 1 runs the engine tensor-parallel over them, SPMD, with
    attention heads, MLP and vocabulary sharded on the cell's 'model' axis and the KV pools on
    kv heads (replicated when model.n_kv_heads does not divide). Must divide model.n_heads."""
    scheduler: Literal["ctb", "vanilla"] = "ctb"
    """Task scheduler of the `tiderl` mode (the baseline modes always use 'vanilla')."""
    ctb: CTBConfig = dataclasses.field(default_factory=CTBConfig)
    share_prefixes: bool = True
    """GRPO siblings on a rank share their common prefix's KV pages (copy-on-write): a
    group's prompt is prefilled once per rank, and CTB counts it once there
    (`rollout.ctb.shared_prompts`)."""
    prefill_batch: int = 32
    """Most tasks one rank prefills in one engine call (rows padded to a decode bucket)."""
    page_size: int = 16
    num_pages: int = 256
    """KV pages per rank (the token budget is num_pages × page_size); with
    `kv_memory_fraction` the least the pool may have."""
    kv_memory_fraction: float = 0.0
    """> 0: size each engine's KV pool from its device's free memory when the engine starts —
    this share of (allocator limit − bytes in use, the trainer's state included when it shares
    the device), capped at max_slots full contexts; `num_pages` is then a floor. Devices that
    report no memory (the CPU) keep `num_pages`. 0: exactly `num_pages`."""
    host_kv_pages: int = 0
    """> 0: a host-memory tier of this many KV pages per rank. An evicted task's pages (a CTB
    pause, an LRU eviction) are copied there (pinned host memory, copied in power-of-two page
    counts: an entry holds its pages rounded up so), and its next prefill copies them back
    instead of computing that context again; the oldest entries make room, a weight sync
    clears it. CTB then budgets the pool and the tier together (`kv_budget_tokens`). Host
    bytes: host_kv_pages × the device page size (2 × layers × kv heads × page_size × head_dim
    × dtype bytes). 0: off (an evicted context is computed again)."""
    max_slots: int = 32
    """Concurrent sequences resident per rank (the decode batch is bucketed up to this)."""
    max_context: int = 1024
    max_action_tokens: int = 16
    temperature: float = 1.0
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Decode batch sizes compiled (one trace each); the largest must be >= max_slots."""
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    """Prefill chunk lengths compiled (one trace each); longer appends run in chunks of the
    largest."""
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end an action (the engine reports StopReason.STOP_TOKEN). In a run these
    are extra stop ids: the turn template's own stop tokens (e.g. <|im_end|>) are always added."""
    top_k: int = 0
    """0 = off (default). When on, sampling is truncated and results are flagged `filtered`.
    Engine use only (evaluation, inference): a training run rejects it, since the behaviour
    logprobs stay full-vocabulary and truncated sampling would bias the GRPO ratios."""
    top_p: float = 1.0
    """1.0 = off (default). When on, sampling is truncated and results are flagged `filtered`.
    Engine use only, like top_k: a training run rejects it."""
    attention: Literal["auto", "reference", "pallas"] = "auto"
    """'reference': gather + jnp attention everywhere. 'pallas': Pallas paged attention for decode
    and gather + jax.nn.dot_product_attention for prefill. 'auto': pallas on GPU, else reference."""
    pallas_interpret: bool = False
    """Run the Pallas kernel in interpret mode (CPU checks); set automatically off-GPU."""

    def __post_init__(self):
        for name in ("ranks", "devices_per_rank", "page_size", "num_pages", "max_slots",
                     "max_context", "max_action_tokens", "prefill_batch"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'rollout.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        if self.host_kv_pages < 0:
            raise ConfigError(f"config key 'rollout.host_kv_pages'={self.host_kv_pages} must be "
                              ">= 0 (0: no host KV tier); e.g. 4 * rollout.num_pages")
        if self.temperature < 0:
            raise ConfigError("config key 'rollout.temperature' must be >= 0 (0 is greedy)")
        _check_buckets("decode_buckets", self.decode_buckets)
        _check_buckets("prefill_buckets", self.prefill_buckets)
        if self.decode_buckets[-1] < self.max_slots:
            raise ConfigError(
                f"config key 'rollout.decode_buckets' tops out at {self.decode_buckets[-1]} < "
                f"rollout.max_slots={self.max_slots}; add a bucket >= max_slots or lower max_slots")
        if any(t < 0 for t in self.stop_tokens):
            raise ConfigError(f"config key 'rollout.stop_tokens'={list(self.stop_tokens)}: token "
                              "ids must be >= 0")
        if not 0.0 <= self.kv_memory_fraction < 1.0:
            raise ConfigError(f"config key 'rollout.kv_memory_fraction'={self.kv_memory_fraction}"
                              " must lie in [0, 1) (0: exactly rollout.num_pages); e.g. 0.4")
        if self.top_k < 0:
            raise ConfigError(f"config key 'rollout.top_k'={self.top_k} must be >= 0 (0 is off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"config key 'rollout.top_p'={self.top_p} must be in (0, 1] "
                              "(1.0 is off)")

    @property
    def max_pages_per_slot(self) -> int:
        """Page-table width: pages one max_context-token sequence needs."""
        return -(-self.max_context // self.page_size)


def kv_budget_tokens(cfg: RolloutConfig) -> int:
    """The KV tokens a rank can keep, its scheduler's capacity: the device pool plus the host
    tier (`host_kv_pages`). With a tier, an evicted context costs a copy rather than a prefill,
    so CTB budgets tasks against both and the rank keeps the ones inside their turn on the
    device (a one-repeat look at the real model's deep step: 44 s against 65 s with the pool
    alone as CTB's budget)."""
    return (cfg.num_pages + cfg.host_kv_pages) * cfg.page_size


def page_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, page_size: int,
               dtype_bytes: int) -> int:
    """Device bytes of one KV page: K and V, every layer."""
    return 2 * n_layers * n_kv_heads * page_size * head_dim * dtype_bytes


def pages_for_memory(cfg: RolloutConfig, *, free_bytes: int, page_bytes: int) -> int:
    """KV pages for `rollout.kv_memory_fraction` of `free_bytes` (one page is kept for the
    engine's scratch page), capped at `max_slots` × pages per full context: more could never
    be used. A ConfigError names the keys when that is under `rollout.num_pages`."""
    fit = int(cfg.kv_memory_fraction * free_bytes) // page_bytes - 1
    cap = cfg.max_slots * cfg.max_pages_per_slot
    if fit < min(cfg.num_pages, cap):
        raise ConfigError(
            f"config key 'rollout.kv_memory_fraction'={cfg.kv_memory_fraction} of "
            f"{free_bytes / 2**30:.2f} GiB free device memory holds {max(fit, 0)} KV pages "
            f"({page_bytes / 2**20:.2f} MiB each), fewer than rollout.num_pages="
            f"{cfg.num_pages}; raise rollout.kv_memory_fraction or cluster.memory_fraction, or "
            "lower rollout.num_pages (or the model's footprint)")
    return min(fit, cap)
