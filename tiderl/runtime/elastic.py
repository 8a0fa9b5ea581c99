"""The JAX side of elastic scaling: cells become meshes and rollout ranks, role changes move them.

`CellRuntime.apply_roles` is the real `Hooks.apply_roles` (contract in `tiderl.control.plans`):

- the Actor's mesh is `(data = trainer cells, fsdp, model)` over the trainer cells' devices in
  cell order; params and optimizer state are sharded on fsdp/model and replicated on data, so a
  cell joining the trainer receives one replica's shards (`jax.device_put` into the wider
  shardings; shard shapes do not change) and a cell leaving it takes nothing with it. The
  micro-batcher packs for the new data width; the global batch stays the same;
- the Ref sits on the ref cells when the plan's RA2P mode is decoupled, else on the Actor's;
- a cell joining rollout gets one engine per device (`make_rank`), loaded with the weights
  being broadcast at this boundary, and joins the sync (the controller drained the ranks of
  cells leaving rollout before this runs);
- every move runs on the trainer's worker thread (`TrainerBackend.call`), after the work queued
  before it: one control thread issues all cross-device work, in one order.

Costs come back per change: `move_s` (state device_put, blocked until done), `kernels`
(`cached` when the mesh pair was seen before: nothing compiles; `built`: its kernels compile on
first use, counted in the record's next-step compilations), `join_s` (new ranks: weights, KV
pool, start). `CompileWatch` counts XLA compilations process-wide through `jax.monitoring`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from tiderl.control.plans import CellMap, RoleChange, RoleChangeResult
from tiderl.models.sharding import make_mesh
from tiderl.runtime.devices import CellLayout
from tiderl.train.ref_actor import dp_size

log = logging.getLogger(__name__)


class CompileWatch:
    """Process-wide XLA compilation counters (backend compiles, seconds, persistent-cache hits)."""

    _lock = threading.Lock()
    _installed = False
    _counts = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0}

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True
        from jax import monitoring

        def on_duration(event: str, duration: float, **_: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._counts["compiles"] += 1
                    cls._counts["compile_s"] += float(duration)

        def on_event(event: str, **_: Any) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                with cls._lock:
                    cls._counts["cache_hits"] += 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    @classmethod
    def stats(cls) -> dict[str, float]:
        cls.install()
        with cls._lock:
            return dict(cls._counts)


MakeRank = Callable[[int, jax.Device, Any, int], Awaitable[Any]]
"""(rank id, device, weights, version) -> a started RolloutRank serving that device."""


class CellRuntime:
    """Meshes and rollout ranks for a cell map, and the role-change hook (module docstring)."""

    def __init__(self, layout: CellLayout, devices: Sequence[jax.Device], *, trainer: Any,
                 batcher: Any, make_rank: MakeRank, fsdp: int = 1, model_parallel: int = 1):
        self.layout = layout
        self.devices = list(devices)
        self.trainer = trainer
        self.batcher = batcher
        self.make_rank = make_rank
        self.fsdp, self.model_parallel = fsdp, model_parallel

    @property
    def initial(self) -> CellMap:
        return CellMap(self.layout.roles)

    def _devs(self, cells: Sequence[int]) -> list[jax.Device]:
        return [self.devices[d] for d in self.layout.devices(list(cells))]

    def actor_mesh(self, cells: CellMap) -> Mesh:
        n = cells.count("trainer")
        if not n:
            raise ValueError("a cell map without trainer cells; keep controller.elastic."
                             "min_trainer_cells >= 1")
        return make_mesh(self._devs(cells.cells("trainer")), data=n, fsdp=self.fsdp,
                         model=self.model_parallel)

    def ref_mesh(self, cells: CellMap, ref_mode: str) -> Mesh | None:
        devs = self._devs(cells.cells("ref"))
        if ref_mode != "decoupled" or not devs:
            return None
        return make_mesh(devs, data=len(devs))

    def rank_device(self, cell: int, j: int) -> jax.Device:
        return self.devices[self.layout.cells[cell][j]]

    async def start_ranks(self, cells: Sequence[int], weights: Any, version: int) -> list[Any]:
        """Started ranks for `cells` (rank id cell·k + j on the cell's j-th device). A rank
        whose engine cannot be set up is left out (logged): the others serve."""
        k = self.layout.ranks_per_cell
        out = []
        for c in cells:
            for j in range(k):
                try:
                    out.append(await self.make_rank(c * k + j, self.rank_device(c, j), weights,
                                                    version))
                except Exception:  # a device failure must not stop the run
                    log.exception("rollout rank %d (cell %d) failed to start; its slot stays "
                                  "empty", c * k + j, c)
        return out

    async def apply_roles(self, change: RoleChange, weights: Any) -> RoleChangeResult:
        t0 = time.perf_counter()
        tr = self.trainer
        actor = self.actor_mesh(change.after)
        ref = self.ref_mesh(change.after, change.ref_mode)
        cost: dict[str, Any] = {"move_s": 0.0, "kernels": "unchanged"}
        now_ref = tr.ref_mesh if tr.mode == "decoupled" else None
        if actor != tr.actor_mesh or ref != now_ref:
            out = await asyncio.wrap_future(tr.call(lambda: tr.set_meshes(actor, ref)))
            cost.update(out)
        self.batcher.n_ranks = dp_size(actor)
        self.batcher.order = "decoupled" if tr.mode == "decoupled" else "colocated"
        cost["trainer_data"] = int(actor.shape["data"])
        t1 = time.perf_counter()
        ranks = await self.start_ranks(change.joining_rollout(), weights, change.version)
        cost["join_s"] = time.perf_counter() - t1
        cost["hook_s"] = time.perf_counter() - t0
        return RoleChangeResult(ranks, cost)
