"""Weight sync: trainer params → every rollout rank's layout, shard to shard.

The trainer's params are sharded on `fsdp`/`model` inside each trainer cell and replicated
across cells (the `data` axis), so every process with a trainer cell holds one whole replica.
A sync takes that replica as it lies (`local_replica`: the cell's own shards, no copy), then

- in-process: `jax.device_put` to the rank's sharding (one device, or its tensor-parallel
  cell): device-to-device copies and the reshard inside the process;
- cross-process (a rank whose process holds no replica, or `distributed.weight_source=process0`):
  the source process first puts the weights in the rank's layout on a cell of its own with the
  same mesh shape (its own rollout rank's fresh weights when it has one), then both processes
  call `jax.device_put` from that cell to the rank's: matching shard shapes, which is what
  JAX's cross-process transfer requires (a reshard across processes is not supported). Both
  sides issue it from their control thread in the plan's order; a barrier afterwards keeps the
  source buffers alive until every receiver has its copy.

Staging through host memory (`jax.device_get` + `device_put`) is never used: others measured
1–7 GB/s for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from tiderl.models.sharding import state_shardings


def tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def rank_shardings(abstract_params: Any, mesh: Mesh) -> Any:
    """A rollout rank's param shardings: its one device, or its cell's 'model'-axis layout."""
    devices = list(mesh.devices.flat)
    if len(devices) == 1:
        one = SingleDeviceSharding(devices[0])
        return jax.tree.map(lambda _: one, abstract_params)
    return state_shardings(abstract_params, mesh)


def _replica_index(mesh: Mesh, process: int) -> int | None:
    """The first `data` slice of a trainer mesh whose devices all belong to `process`."""
    for d in range(mesh.shape["data"]):
        if all(dev.process_index == process for dev in mesh.devices[d].flat):
            return d
    return None


def holds_replica(mesh: Mesh, process: int) -> bool:
    return _replica_index(mesh, process) is not None


def local_replica(params: Any, process: int | None = None) -> Any:
    """One data-parallel replica of `params` held by `process` (default: this one), as arrays
    over that replica's sub-mesh built from the existing shards (no copy)."""
    process = jax.process_index() if process is None else process

    def one(x: jax.Array) -> jax.Array:
        sh = x.sharding
        if not isinstance(sh, NamedSharding) or "data" not in sh.mesh.shape:
            return x
        d = _replica_index(sh.mesh, process)
        if d is None:
            raise ValueError(f"process {process} holds no trainer replica of this array")
        sub = Mesh(sh.mesh.devices[d:d + 1], sh.mesh.axis_names)
        target = NamedSharding(sub, sh.spec)
        by_device = {s.device: s.data for s in x.addressable_shards}
        shards = [by_device[dev] for dev in sub.devices.flat]
        return jax.make_array_from_single_device_arrays(x.shape, target, shards)

    return jax.tree.map(one, params)


@dataclasses.dataclass
class SyncStats:
    """Bytes and seconds of one sync, split by path (GB/s per path for metrics.jsonl)."""

    local_bytes: int = 0
    local_s: float = 0.0
    cross_bytes: int = 0
    cross_s: float = 0.0
    full_bytes: int = 0
    """What whole serving weights for the same ranks would be (LoRA moves adapters only;
    set by `tiderl.runtime.parts.WeightPlacer`; 0: not known)."""

    def add(self, other: SyncStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"sync_bytes": float(self.local_bytes + self.cross_bytes)}
        if self.full_bytes:
            out["sync_full_bytes"] = float(self.full_bytes)
        if self.local_bytes:
            out["sync_local_gbps"] = self.local_bytes / max(self.local_s, 1e-9) / 1e9
        if self.cross_bytes:
            out["sync_cross_gbps"] = self.cross_bytes / max(self.cross_s, 1e-9) / 1e9
        total_s = self.local_s + self.cross_s
        if total_s:
            out["sync_gbps"] = (self.local_bytes + self.cross_bytes) / total_s / 1e9
        return out

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


def put_local(replica: Any, targets: Sequence[Any]) -> tuple[list[Any], SyncStats]:
    """In-process: the replica into each rank's shardings (one batched device_put per rank)."""
    stats, out = SyncStats(), []
    for target in targets:
        t0 = time.perf_counter()
        out.append(jax.block_until_ready(jax.device_put(replica, target)))
        stats.local_s += time.perf_counter() - t0
        stats.local_bytes += tree_bytes(replica)
    return out, stats


def same_shape_on(target: Any, devices: Sequence[jax.Device]) -> Any:
    """`target`'s shardings with its mesh's devices replaced by `devices` (same mesh shape)."""

    def one(s: Any) -> Any:
        if isinstance(s, SingleDeviceSharding):
            return SingleDeviceSharding(devices[0])
        mesh = Mesh(np.asarray(devices, dtype=object).reshape(s.mesh.devices.shape),
                    s.mesh.axis_names)
        return NamedSharding(mesh, s.spec)

    return jax.tree.map(one, target, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def cross_put(staged: Any | None, staging: Any, target: Any, abstract: Any,
              receiver: bool) -> tuple[Any, SyncStats]:
    """Cross-process: every process calls this for the same transfer in the same order.

    The sender passes `staged` (the weights already in `staging`, on its devices); others pass
    None and get a handle to them (no local shards). Returns the destination arrays (only the
    receiver has shards of them) and, on the receiver, the bytes and seconds it took."""
    stats = SyncStats()
    t0 = time.perf_counter()
    if staged is None:
        staged = jax.tree.map(
            lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [],
                                                                  dtype=a.dtype),
            abstract, staging)
    out = jax.device_put(staged, target)
    if receiver:
        jax.block_until_ready(out)
        stats.cross_s = time.perf_counter() - t0
        stats.cross_bytes = tree_bytes(abstract)
    return out, stats


class SyncPlan:
    """Which process sends each rollout rank its weights, and how; the same on every process
    (computed from the role map), run by every process at the same point of the plan stream."""

    def __init__(self, *, process: int, size: int, rank_meshes: list[Mesh], rank_process: list[int],
                 trainer_mesh: Mesh, abstract: Any, weight_source: str = "local",
                 barrier: Any = None, rank_ids: Sequence[int] | None = None, tag: str = ""):
        self.me, self.size = process, size
        self.ids = list(rank_ids) if rank_ids is not None else list(range(len(rank_meshes)))
        """The global id of each rank (its position in `rank_meshes` by default)."""
        self.tag = tag
        self.abstract = abstract
        self.barrier = barrier
        self.targets = [rank_shardings(abstract, m) for m in rank_meshes]
        holders = [p for p in range(size) if holds_replica(trainer_mesh, p)]
        if not holders:
            raise ValueError("no process holds a whole trainer replica; give every trainer "
                             "cell all of its devices on one process")
        self.source = [q if weight_source == "local" and q in holders else holders[0]
                       for q in rank_process]
        self.rank_process = rank_process
        self.holds = self.me in holders
        n = len(rank_meshes)
        self.local = [r for r in range(n) if rank_process[r] == self.me == self.source[r]]
        # Cross-process: stage on a cell of the source process with the destination's mesh
        # shape: its own rollout rank's fresh weights when one has that shape (no extra copy),
        # else the first devices of its trainer replica.
        self.cross: list[tuple[int, int | None, Any]] = []
        for r in range(n):
            p = self.source[r]
            if p == rank_process[r]:
                continue
            size_r = rank_meshes[r].devices.size
            via = next((k for k in range(n) if rank_process[k] == p == self.source[k]
                        and rank_meshes[k].devices.shape == rank_meshes[r].devices.shape), None)
            if via is not None:
                staging = self.targets[via]
            else:
                d = next(i for i in range(trainer_mesh.shape["data"])
                         if all(x.process_index == p for x in trainer_mesh.devices[i].flat))
                staging = same_shape_on(self.targets[r],
                                        list(trainer_mesh.devices[d].flat)[:size_r])
            self.cross.append((r, via, staging))
        self._syncs = 0

    def describe(self) -> str:
        kinds = ["in-process" if self.source[r] == q else f"from process {self.source[r]}"
                 for r, q in enumerate(self.rank_process)]
        return ", ".join(f"rank {self.ids[r]}: {k}" for r, k in enumerate(kinds))

    def run(self, params: Any, only: Sequence[int] | None = None
            ) -> tuple[dict[int, Any], dict[int, SyncStats]]:
        """New weights for this process's ranks (rank id → params) and per-rank stats;
        `only`: just these rank ids (the ranks joining rollout at a role change)."""
        want = set(self.ids) if only is None else set(only)
        replica = local_replica(params, self.me) if self.holds else None
        trees: dict[int, Any] = {}
        stats: dict[int, SyncStats] = {}
        for r in self.local:
            if self.ids[r] in want:
                (trees[r],), stats[r] = put_local(replica, [self.targets[r]])
        cross = [x for x in self.cross if self.ids[x[0]] in want]
        for r, via, staging in cross:
            sender = self.source[r] == self.me
            staged = None
            if sender:
                staged = trees[via] if via in trees else jax.device_put(replica, staging)
            out, st = cross_put(staged, staging, self.targets[r], self.abstract,
                                receiver=self.rank_process[r] == self.me)
            if self.rank_process[r] == self.me:
                trees[r], stats[r] = out, st
        if cross and self.barrier is not None:
            # The senders' staged buffers stay referenced until every receiver has its copy.
            self.barrier(f"sync/{self.tag}{self._syncs}")
        self._syncs += 1
        return ({self.ids[r]: t for r, t in trees.items()},
                {self.ids[r]: st for r, st in stats.items()})
