"""Device side of the paged KV cache: page pools, KV write and attention over pages.

Pools are per layer `[K, P+1, S, Dh]` (kv heads, pages + 1 scratch page, page slots, head dim).
This is kv-head-major rather than `[P, S, K, Dh]` because it is the layout the Pallas GPU
paged-attention kernel reads; any other layout would cost a full-pool transpose per layer per
step. Page `P` is scratch ("trash"): padded tokens write there and padded page-table entries
point there, so kernels have no data-dependent branches (see pages.py).

`PagedKV` is the `AttentionCache` the decoder calls once per layer on the serving path. It is
a pytree (pools and tables are leaves, the kernel choice is static), so it flows through jit and
the pools it returns are the donated inputs updated in place.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from tiderl.models.layers import NEG_INF
from tiderl.models.layers import attend as reference_attend
from tiderl.serving.config import RolloutConfig, page_bytes, pages_for_memory

log = logging.getLogger(__name__)

AttnImpl = Literal["reference", "pallas"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPools:
    """Per-layer K and V page pools, each `[K, P+1, S, Dh]`; allocated once, donated per call."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def trash(self) -> int:
        return self.k[0].shape[1] - 1


def init_pools(*, n_layers: int, n_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
               dtype, device=None, sharding=None) -> KVPools:
    """Zeroed pools for `num_pages` real pages plus the scratch page, on `device` or in
    `sharding` (a tensor-parallel rank's: kv heads over its cell)."""
    shape = (n_kv_heads, num_pages + 1, page_size, head_dim)
    if sharding is None and device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)
    make = jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
                   out_shardings=sharding)
    return KVPools(k=make(), v=make())


def copy_pages(pools: KVPools, src_c: Int[Array, " C"], dst_c: Int[Array, " C"]) -> KVPools:
    """Copy-on-write: page dst ← page src in every layer (pad with trash → trash)."""
    return KVPools(k=tuple(p.at[:, dst_c].set(p[:, src_c]) for p in pools.k),
                   v=tuple(p.at[:, dst_c].set(p[:, src_c]) for p in pools.v))


def read_pages(pools: KVPools, idx_n: Int[Array, " N"]) -> Array:
    """Pages `idx_n` of every layer as one `[n_layers, 2 (K, V), K, N, S, Dh]` array (the
    host KV tier's offload; pad `idx_n` with trash)."""
    return jnp.stack([jnp.stack([k[:, idx_n], v[:, idx_n]])
                      for k, v in zip(pools.k, pools.v, strict=True)])


def write_pages(pools: KVPools, kv: Array, idx_n: Int[Array, " N"]) -> KVPools:
    """Pages `idx_n` of every layer ← `kv` as `read_pages` returns it (the host KV tier's
    restore; padded entries of `idx_n` point at trash)."""
    return KVPools(k=tuple(p.at[:, idx_n].set(kv[i, 0].astype(p.dtype))
                           for i, p in enumerate(pools.k)),
                   v=tuple(p.at[:, idx_n].set(kv[i, 1].astype(p.dtype))
                           for i, p in enumerate(pools.v)))


def gather_pages(pool_kpsd: Array, page_table_bp: Int[Array, "B Pm"]) -> Float[Array, "B L K Dh"]:
    """A batch's pages as contiguous `[B, Pm*S, K, Dh]` keys or values (L = Pm*S)."""
    return _gather_kbld(pool_kpsd, page_table_bp).transpose(1, 2, 0, 3)


def _gather_kbld(pool_kpsd: Array, page_table_bp: Array) -> Array:
    g_kbpsd = pool_kpsd[:, page_table_bp]
    k, b, pm, s, dh = g_kbpsd.shape
    return g_kbpsd.reshape(k, b, pm * s, dh)


def gather_attend(q_bthd: Float[Array, "B T H Dh"], k_pool, v_pool, page_table_bp,
                  mask_btl: Bool[Array, "B T L"]) -> Float[Array, "B T H Dh"]:
    """The pure-jnp reference: gather the pages, GQA attention with an explicit mask, fp32 softmax.

    Same math as `models.layers.attend`, but it contracts the gathered `[K, B, L, Dh]` pages
    directly: transposing them to `[B, L, K, Dh]` first costs a copy of the whole context per
    layer per step (~15-25% of a CPU decode step at B=32, 512 tokens).
    """
    b, t, h, dh = q_bthd.shape
    k_kbld = _gather_kbld(k_pool, page_table_bp).astype(q_bthd.dtype)
    v_kbld = _gather_kbld(v_pool, page_table_bp).astype(q_bthd.dtype)
    q_btkgd = q_bthd.reshape(b, t, k_kbld.shape[0], h // k_kbld.shape[0], dh)
    scores = jnp.einsum("btkgd,kbld->bkgtl", q_btkgd, k_kbld,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(mask_btl[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_kbld.dtype)
    return jnp.einsum("bkgtl,kbld->btkgd", probs, v_kbld).reshape(b, t, h, dh)


def append_mask(pos_bt: Int[Array, "B T"], kv_len_b: Int[Array, " B"],
                n_keys: int) -> Bool[Array, "B T L"]:
    """Bottom-right-aligned causal mask for tokens appended at `pos_bt` to a resident context."""
    s_l = jnp.arange(n_keys)
    return (s_l[None, None, :] < kv_len_b[:, None, None]) & (s_l[None, None, :] <= pos_bt[:, :, None])


def decode_splits(pages_per_seq: int, *, interpret: bool) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) of the Pallas decode kernel for a page table of
    `pages_per_seq` pages.

    The kernel splits each sequence's pages into `k_splits` partitions run in parallel (then
    merged flash-style) and walks a partition `pages_per_compute_block` pages at a time; it
    asserts pages_per_seq % k_splits == 0 and that the block divides a partition, and Triton
    tiles must be powers of two. Interpret mode runs the grid serially, so one split is
    cheapest there (tests pass `k_splits` explicitly to check the merge on the CPU)."""
    k_splits = 1 if interpret else next(d for d in (16, 8, 4, 2, 1) if pages_per_seq % d == 0)
    block = next(d for d in (8, 4, 2, 1) if (pages_per_seq // k_splits) % d == 0)
    return k_splits, block


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pallas_decode_unsupported(*, head_dim: int, page_size: int) -> str | None:
    """Why the Pallas (Triton) decode kernel cannot run this cache on a GPU, or None.

    Its tiles are [16 query heads, head_dim] and [pages × page_size, head_dim]: Triton needs
    power-of-two sizes of at least 16 for its dots."""
    if not (_pow2(head_dim) and head_dim >= 16):
        return f"model.head_dim={head_dim} is not a power of two >= 16"
    if not _pow2(page_size):
        return f"rollout.page_size={page_size} is not a power of two"
    return None


def resolve_decode_attention(setting: str, *, platform: str, head_dim: int,
                             page_size: int) -> str:
    """`rollout.attention` for an engine on `platform`: 'auto' is 'pallas' on a GPU where the
    kernel applies, 'reference' elsewhere; an explicit 'pallas' that cannot compile on this
    GPU is a ValueError naming the keys (off-GPU it runs in interpret mode)."""
    why = pallas_decode_unsupported(head_dim=head_dim, page_size=page_size)
    if setting == "auto":
        if platform == "gpu" and why:
            log.warning("rollout.attention=auto: gather reference decode on this GPU (%s)", why)
        return "pallas" if platform == "gpu" and not why else "reference"
    if setting == "pallas" and platform == "gpu" and why:
        raise ValueError(f"rollout.attention='pallas': {why}; use rollout.attention=reference "
                         "or a power-of-two page size")
    return setting


def pool_pages(cfg: RolloutConfig, *, n_layers: int, n_kv_heads: int, head_dim: int,
               dtype, device) -> int:
    """Pages of this engine's KV pool: `rollout.num_pages`, or with `rollout.kv_memory_fraction`
    > 0 that share of the device memory free now (`memory_stats()`: the allocator's limit
    minus what is in use — the trainer's state too, when it shares the device), capped at what
    `max_slots` full contexts can use. A device that reports no memory (the CPU) keeps
    `num_pages`. Fewer pages than `num_pages` is a ConfigError naming the keys."""
    if cfg.kv_memory_fraction <= 0:
        return cfg.num_pages
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        log.info("rollout.kv_memory_fraction: %s reports no memory limit; keeping "
                 "rollout.num_pages=%d", device.platform, cfg.num_pages)
        return cfg.num_pages
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    per_page = page_bytes(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          page_size=cfg.page_size, dtype_bytes=jnp.dtype(dtype).itemsize)
    pages = pages_for_memory(cfg, free_bytes=free, page_bytes=per_page)
    log.info("KV pool: %d pages of %d tokens (%.2f GiB) = rollout.kv_memory_fraction=%g of "
             "%.2f GiB free on %s", pages, cfg.page_size, pages * per_page / 2**30,
             cfg.kv_memory_fraction, free / 2**30, device)
    return pages


def pallas_paged_decode(q_bhd, k_pool, v_pool, page_table_bp, lengths_b, *, interpret: bool,
                        k_splits: int | None = None):
    """One query token per row through `jax.experimental.pallas.ops.gpu.paged_attention`.

    `k_splits` overrides `decode_splits` (tests run the GPU's split on the CPU)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pm = page_table_bp.shape[1]
    auto_splits, block = decode_splits(pm, interpret=interpret)
    if k_splits is None:
        k_splits = auto_splits
    else:
        block = next(d for d in (8, 4, 2, 1) if (pm // k_splits) % d == 0)
    scale = 1.0 / math.sqrt(q_bhd.shape[-1])  # the kernel does not scale scores itself
    return paged_attention(q_bhd * jnp.asarray(scale, q_bhd.dtype), k_pool, v_pool,
                           page_table_bp, lengths_b.astype(jnp.int32), k_splits=k_splits,
                           pages_per_compute_block=block, interpret=interpret)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """The serving-path `AttentionCache` over pages: writes new K/V, attends over the context.

    Row b appends `n_new_b[b]` tokens at positions `start_b[b]...` (tokens past `n_new_b` are
    padding and write to the scratch page); its pages are `page_table_bp[b]`.
    """

    pools: KVPools
    page_table_bp: Int[Array, "B Pm"]
    start_b: Int[Array, " B"]
    n_new_b: Int[Array, " B"]
    impl: AttnImpl = dataclasses.field(default="reference", metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def attend(self, layer: int, q_bthd, k_btkd, v_btkd):
        b, t = q_bthd.shape[:2]
        s, pm = self.pools.page_size, self.page_table_bp.shape[1]
        t_t = jnp.arange(t)
        pos_bt = self.start_b[:, None] + t_t
        valid_bt = t_t[None, :] < self.n_new_b[:, None]
        slot_bt = jnp.minimum(pos_bt // s, pm - 1)
        page_bt = jnp.where(valid_bt, jnp.take_along_axis(self.page_table_bp, slot_bt, axis=1),
                            self.pools.trash)
        off_bt = pos_bt % s
        k_pool = self.pools.k[layer]
        v_pool = self.pools.v[layer]
        k_pool = k_pool.at[:, page_bt, off_bt].set(k_btkd.transpose(2, 0, 1, 3).astype(k_pool.dtype))
        v_pool = v_pool.at[:, page_bt, off_bt].set(v_btkd.transpose(2, 0, 1, 3).astype(v_pool.dtype))
        kv_len_b = self.start_b + self.n_new_b
        if t == 1 and self.impl == "pallas":
            out = pallas_paged_decode(q_bthd[:, 0], k_pool, v_pool, self.page_table_bp, kv_len_b,
                                      interpret=self.interpret)[:, None]
        elif self.impl == "pallas":
            k_blkd = gather_pages(k_pool, self.page_table_bp).astype(q_bthd.dtype)
            v_blkd = gather_pages(v_pool, self.page_table_bp).astype(q_bthd.dtype)
            mask_btl = append_mask(pos_bt, kv_len_b, pm * s)
            # Explicit mask: is_causal would be top-left aligned, wrong for appended tokens.
            out = jax.nn.dot_product_attention(q_bthd, k_blkd, v_blkd, mask=mask_btl[:, None])
        else:
            out = gather_attend(q_bthd, k_pool, v_pool, self.page_table_bp,
                                append_mask(pos_bt, kv_len_b, pm * s))
        k_all = self.pools.k[:layer] + (k_pool,) + self.pools.k[layer + 1:]
        v_all = self.pools.v[:layer] + (v_pool,) + self.pools.v[layer + 1:]
        return out, dataclasses.replace(self, pools=KVPools(k=k_all, v=v_all))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKV:
    """A dense per-row cache `[B, L, K, Dh]` per layer: the baseline paged KV is measured against."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    start_b: Int[Array, " B"]
    n_new_b: Int[Array, " B"]

    def attend(self, layer: int, q_bthd, k_btkd, v_btkd):
        b, t = q_bthd.shape[:2]
        n_keys = self.k[layer].shape[1]
        t_t = jnp.arange(t)
        pos_bt = self.start_b[:, None] + t_t
        # Out-of-range rows are dropped: padding tokens never land in the cache.
        idx_bt = jnp.where(t_t[None, :] < self.n_new_b[:, None], pos_bt, n_keys)
        b_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        k_c = self.k[layer].at[b_bt, idx_bt].set(k_btkd, mode="drop")
        v_c = self.v[layer].at[b_bt, idx_bt].set(v_btkd, mode="drop")
        mask_btl = append_mask(pos_bt, self.start_b + self.n_new_b, n_keys)
        out = reference_attend(q_bthd, k_c, v_c, mask_btl)
        k_all = self.k[:layer] + (k_c,) + self.k[layer + 1:]
        v_all = self.v[:layer] + (v_c,) + self.v[layer + 1:]
        return out, dataclasses.replace(self, k=k_all, v=v_all)
