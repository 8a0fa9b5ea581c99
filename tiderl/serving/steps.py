"""The engine's compiled device functions and where they run.

- `make_step`: the jitted forward-and-sample over the paged KV pools (prefill and decode), pools
  donated; cached on its static arguments, so engines of one model in a process share code.
- `make_sampler`: jitted sampling from given logits rows (a GRPO sibling's first token).
- `copy_pages_fn`: the jitted copy-on-write page copy, pools donated; `page_io_fns`: the host
  KV tier's page reads and writes; `tier_shardings`: where its entries live (pinned host
  memory, laid out as the pools).
- `cell_of`, `pool_sharding_for`: an engine's placement (one device, or a tensor-parallel cell
  with its KV pools sharded on kv heads).

Each jitted function counts its traces in `trace_counts` (`Engine.trace_counts`), and each new
trace checks the process's memory maps against the kernel's limit (`check_map_headroom`).
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tiderl.serving.kv import PagedKV, copy_pages, read_pages, write_pages
from tiderl.serving.sampling import sample, token_keys

log = logging.getLogger(__name__)
_maps_warned = False


def check_map_headroom(share: float = 0.75, limit_path: str = "/proc/sys/vm/max_map_count",
                       maps_path: str = "/proc/self/maps") -> tuple[int, int] | None:
    """Warns once per process when it holds `share` of the memory maps Linux allows one
    process (`vm.max_map_count`, 65,530 by default). XLA's CPU backend maps memory for every
    compiled executable (a 30-layer model's kernel: several hundred maps), so an engine that
    compiles many (rows, length, page-table width) shapes can reach the limit; past it LLVM
    cannot allocate ("LLVM compilation error: Cannot allocate memory") and the process dies
    with SIGSEGV. Returns (maps held, limit), or None where /proc does not tell (not Linux)."""
    global _maps_warned
    try:
        with open(limit_path) as f:
            limit = int(f.read())
        with open(maps_path, "rb") as f:
            held = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    if held >= share * limit and not _maps_warned:
        _maps_warned = True
        log.warning(
            "this process holds %d memory maps of the %d Linux allows (vm.max_map_count); "
            "compiling more kernels past it crashes the process (LLVM 'Cannot allocate "
            "memory', then SIGSEGV). Raise the limit (sudo sysctl -w "
            "vm.max_map_count=1048576) or compile fewer shapes (fewer rollout.prefill_buckets "
            "or rollout.decode_buckets, a smaller rollout.max_context)", held, limit)
    return held, limit


@functools.lru_cache(maxsize=32)  # bounded: a long-lived process must not pile up executables
def make_step(graphdef: nnx.GraphDef, *, kind: str, impl: str, interpret: bool, top_k: int,
              top_p: float, keep_logits: bool, pool_sharding: Any = None,
              banned: tuple[int, ...] = ()):
    """Jitted forward-and-sample over pages; pools donated. Retraces only on a new (B, T) or
    page-table width (the engine passes a few widths: `Engine._table_width`).

    Cached on its static arguments so engines of one model in one process share compiled code;
    the returned function's `trace_counts` counts traces per (kind, B, T, W). `pool_sharding`
    (a tensor-parallel engine's pool sharding over its cell) pins the donated pools' output
    sharding to their input's, so XLA cannot hand back another layout (a recompile per call).
    """
    trace_counts: collections.Counter = collections.Counter()

    def step(params, pools, run_key, tokens_bt, start_b, n_new_b, page_table_bp, task_ids_b,
             temperature_b, delta_b, positions_bt3=None, inputs=None):
        # Python side effect: runs once per trace.
        name = kind if positions_bt3 is None else kind + "+image"
        trace_counts[(name, *tokens_bt.shape, page_table_bp.shape[1])] += 1
        check_map_headroom()
        model = nnx.merge(graphdef, params)
        # Text at token index + the task's M-RoPE delta (0 without images, as plain RoPE); a
        # chunk holding image placeholders comes with its [B, T, 3] positions and embeddings.
        positions_bt = ((start_b + delta_b)[:, None] + jnp.arange(tokens_bt.shape[1])
                        if positions_bt3 is None else positions_bt3)
        cache = PagedKV(pools, page_table_bp, start_b, n_new_b, impl=impl, interpret=interpret)
        last_b = jnp.maximum(n_new_b - 1, 0)
        if hasattr(model, "hidden_states") and hasattr(model, "logits"):
            kw = {} if inputs is None else {"inputs_btd": inputs[0], "layer_adds": inputs[1]}
            # The head only where a token is sampled: B×V logits, never B×T×V.
            h_btd, cache = model.hidden_states(tokens_bt, positions_bt, jnp.ones_like(tokens_bt),
                                               cache=cache, **kw)
            h_b1d = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)
            logits_bv = model.logits(h_b1d)[:, 0]
        else:  # a custom policy: full logits, then the sampled position's
            logits_btv, cache = model(tokens_bt, positions_bt, jnp.ones_like(tokens_bt),
                                      cache=cache)
            logits_bv = jnp.take_along_axis(logits_btv, last_b[:, None, None], axis=1)[:, 0]
        logits_bv = logits_bv.astype(jnp.float32)
        # The sampled token's position is the one after the last token fed.
        keys_b = token_keys(run_key, task_ids_b, start_b + n_new_b)
        tokens_b, logprob_b = sample(logits_bv, keys_b, temperature_b, top_k=top_k, top_p=top_p,
                                     banned=banned)
        # Token and logprob bits in one int32 array: one device→host copy per step.
        packed_b2 = jnp.stack([tokens_b, jax.lax.bitcast_convert_type(logprob_b, jnp.int32)], 1)
        # Prefill keeps its logits on the device: siblings with the same context sample from
        # them (prefix sharing) instead of recomputing the last token.
        return cache.pools, packed_b2, (logits_bv if keep_logits or kind == "prefill" else None)

    out = None if pool_sharding is None else (pool_sharding, replicated(pool_sharding), None)
    jitted = jax.jit(step, donate_argnums=(1,), out_shardings=out)
    jitted.trace_counts = trace_counts
    return jitted


@functools.lru_cache(maxsize=8)
def make_sampler(*, top_k: int, top_p: float, banned: tuple[int, ...] = ()):
    """Jitted sampling from given logits rows: a sibling whose context another task's prefill
    just computed samples its own first token (its own key) from those logits."""
    trace_counts: collections.Counter = collections.Counter()

    def sample_rows(logits_nv, run_key, task_ids_n, positions_n, temperature_n):
        trace_counts[("sample", logits_nv.shape[0])] += 1
        keys_n = token_keys(run_key, task_ids_n, positions_n)
        tokens_n, logprob_n = sample(logits_nv.astype(jnp.float32), keys_n, temperature_n,
                                     top_k=top_k, top_p=top_p, banned=banned)
        return jnp.stack([tokens_n, jax.lax.bitcast_convert_type(logprob_n, jnp.int32)], 1)

    jitted = jax.jit(sample_rows)
    jitted.trace_counts = trace_counts
    return jitted


def replicated(sharding: NamedSharding) -> NamedSharding:
    """The same mesh, every device holding the whole array."""
    return NamedSharding(sharding.mesh, PartitionSpec())


@functools.lru_cache(maxsize=32)
def copy_pages_fn(pool_sharding: Any = None):
    """`kv.copy_pages` jitted, pools donated (and kept at `pool_sharding` on a cell)."""
    return jax.jit(copy_pages, donate_argnums=(0,), out_shardings=pool_sharding)


@functools.lru_cache(maxsize=32)
def page_io_fns(pool_sharding: Any = None, host_sharding: Any = None):
    """The host KV tier's jitted page reads (`kv.read_pages`, written straight to
    `host_sharding`'s host memory when given) and writes (`kv.write_pages`, pools donated,
    kept at `pool_sharding` on a cell)."""
    return (jax.jit(read_pages, out_shardings=host_sharding),
            jax.jit(write_pages, donate_argnums=(0,), out_shardings=pool_sharding))


def tier_shardings(device: Any, pool_sharding: Any = None) -> tuple[Any, Any]:
    """Where a host-tier entry (`[n_layers, 2, K, N, S, Dh]`, kv heads placed as the pools')
    lives: (on the devices, in the backend's `pinned_host` memory). The second is None on a
    backend without pinned host memory (the entry is then copied to a NumPy array). Pinned
    memory is what a GPU's DMA engines copy from and to without staging, and a read into it
    is queued like any kernel: the engine does not wait for it."""
    if pool_sharding is None:
        dev = jax.sharding.SingleDeviceSharding(device)
        kinds = {m.kind for m in device.addressable_memories()}
    else:
        dev = NamedSharding(pool_sharding.mesh, PartitionSpec(None, None, *pool_sharding.spec))
        kinds = set.intersection(*({m.kind for m in d.addressable_memories()}
                                   for d in pool_sharding.mesh.devices.flat))
    return dev, (dev.with_memory_kind("pinned_host") if "pinned_host" in kinds else None)


def cell_of(params: Any) -> tuple[Any, Any]:
    """(device, None) for params on one device, (None, mesh) for params sharded over one mesh
    (a tensor-parallel rank's cell); anything else is an error naming the fix."""
    leaves = jax.tree_util.tree_leaves(params)
    devices = {d for x in leaves for d in x.devices()}
    if len(devices) == 1:
        return devices.pop(), None
    meshes = {getattr(x.sharding, "mesh", None) for x in leaves}
    if len(meshes) != 1 or None in meshes or set(next(iter(meshes)).devices.flat) != devices:
        raise ValueError(
            f"Engine params span {len(devices)} devices but not one mesh over exactly those "
            "devices; place them with jax.device_put(params, device) for one device, or with "
            "NamedShardings of the rank's mesh (rollout.devices_per_rank > 1)")
    mesh = meshes.pop()
    if "model" not in mesh.shape or mesh.shape["model"] != len(devices):
        raise ValueError(f"a tensor-parallel engine needs a mesh whose 'model' axis spans its "
                         f"{len(devices)} devices; got mesh axes {dict(mesh.shape)}")
    return None, mesh


def pool_sharding_for(mesh: Any, n_kv_heads: int) -> NamedSharding:
    """KV pools `[K, P+1, S, Dh]` sharded on kv heads over the cell's 'model' axis (as the
    k/v projections are), replicated when the heads do not divide."""
    n = mesh.shape["model"]
    if n_kv_heads % n:
        log.warning("model.n_kv_heads=%d does not divide over rollout.devices_per_rank=%d: the "
                    "KV pools are replicated on every device of the rank", n_kv_heads, n)
    return NamedSharding(mesh, PartitionSpec("model" if n_kv_heads % n == 0 else None))
