"""Elastic scaling across processes: cells of a multi-host world change roles at one point of
the trainer's plan stream, on every process.

The cells are those of one process's elastic scaling (`tiderl.runtime.devices.cell_layout`), laid over
the world's device plan (`tiderl.runtime.cells.host_plan`: every host's rollout devices, then every
host's trainer devices), so a cell never spans processes: cell c of `layout.cells` sits on the
process that owns its devices, and serves rollout ranks c·k … c·k + k − 1 when in rollout.

A role change is the `remesh` unit of `tiderl.train.spmd.SpmdTrainer`, published by process 0
and replayed by every follower between the same two units (after the update, before the sync
that follows it). On every process it

1. rebuilds the Actor mesh over the trainer cells, grouped by process (the trainer's `data`
   axis spans processes, and each process's batch rows stay one block);
2. moves params and optimizer state there (`move_replicated`): they are replicated across
   cells, so a cell that stays keeps its buffers and a cell joining gets an in-process copy
   of its own process's replica. No state crosses processes: every process keeps a trainer
   cell (`WorldCells.problem`; the planner is wrapped so it never takes a process's last
   one, `KeepTrainerPerProcess`). A `jax.device_put` between meshes spanning processes is
   not an option: JAX refuses a cross-process reshard whose device sets differ;
3. derives the role map of the new epoch and the weight sync's plan for the new rollout ranks,
   and runs that sync for the ranks of cells joining rollout only: their engines start on the
   weights of this boundary. The process owning such a cell starts its ranks (process 0 its
   own; a follower's `HostAgent` its, answering the controller's `RemoteRank.start` once
   live). Ranks of cells leaving rollout were drained by the controller before the unit was
   published (their tasks migrate through CTB; a follower's agent drops the drained rank).

No process decides anything here: every step is a function of the published cell roles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from tiderl.control.plans import CellMap, RoleChange, RoleChangeResult
from tiderl.models.sharding import make_mesh
from tiderl.runtime.cells import Cell, RoleMap
from tiderl.runtime.devices import CellLayout
from tiderl.train.ref_actor import dp_size

log = logging.getLogger(__name__)


class WorldCells:
    """The world's cells (global device indices) and what each role map makes of them."""

    def __init__(self, layout: CellLayout, devices: Sequence[jax.Device], *, local_devices: int,
                 fsdp: int, model_parallel: int):
        self.layout = layout
        self.devices = list(devices)
        self.local = local_devices
        self.fsdp, self.model_parallel = fsdp, model_parallel
        for c, devs in enumerate(layout.cells):
            if len({d // local_devices for d in devs}) != 1:
                raise ValueError(f"cell {c} spans processes; give every host whole cells")

    @property
    def initial(self) -> CellMap:
        return CellMap(self.layout.roles)

    def process(self, cell: int) -> int:
        return self.layout.cells[cell][0] // self.local

    def rank_process(self, rank_id: int) -> int:
        return self.process(rank_id // self.layout.ranks_per_cell)

    def trainer_cells(self, cells: CellMap) -> list[int]:
        """The trainer cells in mesh order: by process, then cell id."""
        return sorted(cells.cells("trainer"), key=lambda c: (self.process(c), c))

    def actor_mesh(self, cells: CellMap) -> Mesh:
        order = self.trainer_cells(cells)
        if not order:
            raise ValueError("a cell map without trainer cells; keep one")
        devs = [self.devices[d] for c in order for d in self.layout.cells[c]]
        return make_mesh(devs, data=len(order), fsdp=self.fsdp, model=self.model_parallel)

    def role_map(self, cells: CellMap, epoch: int) -> RoleMap:
        """Cell roles as the plan stream's `RoleMap`: one entry per rollout rank (rank id as
        above) and per trainer cell (its data index)."""
        k = self.layout.ranks_per_cell
        out: list[Cell] = []
        for c in cells.cells("rollout"):
            for j, d in enumerate(self.layout.cells[c]):
                out.append(Cell(d // self.local, (d % self.local,), "rollout", c * k + j))
        for i, c in enumerate(self.trainer_cells(cells)):
            devs = self.layout.cells[c]
            out.append(Cell(devs[0] // self.local, tuple(d % self.local for d in devs),
                            "actor", i))
        return RoleMap(epoch, tuple(out))

    def problem(self, cells: CellMap) -> str | None:
        """Why `cells` cannot be taken across processes, or None: every process keeps a
        trainer cell (the trainer's SPMD step reads its metrics on every process, and a cell
        joining the trainer copies a replica of its own process: no cross-process move)."""
        if cells.count("ref"):
            return "a Ref cell (a decoupled Ref is not supported on several processes)"
        have = {self.process(c) for c in cells.cells("trainer")}
        if lost := sorted(set(range(self.processes)) - have):
            return f"no trainer cell left on process(es) {lost}"
        return None

    @property
    def processes(self) -> int:
        return len({self.process(c) for c in range(len(self.layout.cells))})

    def last_trainer_cells(self, cells: CellMap) -> frozenset[int]:
        """Trainer cells that are the only one of their process (they stay)."""
        by_proc: dict[int, list[int]] = {}
        for c in cells.cells("trainer"):
            by_proc.setdefault(self.process(c), []).append(c)
        return frozenset(v[0] for v in by_proc.values() if len(v) == 1)

    def rank_mesh(self, cell: Cell) -> Mesh:
        devs = [self.devices[cell.process * self.local + i] for i in cell.local]
        return make_mesh(devs, model=len(devs))


def _sub_mesh(mesh: Mesh, d: int) -> Mesh:
    return Mesh(mesh.devices[d:d + 1], mesh.axis_names)


def _holds(mesh: Mesh, d: int, process: int) -> bool:
    return all(x.process_index == process for x in mesh.devices[d].flat)


def move_replicated(tree: Any, shardings: Any, *, process: int) -> tuple[Any, dict]:
    """`tree` (arrays replicated on a mesh's `data` axis, sharded inside each data slice) into
    `shardings` on another such mesh of the same slice shape, across processes (see the
    module docstring): no cross-process traffic, as every process holds a trainer cell
    before and after. Every process calls it with the same arguments, in the same order.
    Returns the moved tree and {"cells_kept", "cells_copied"}."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    if not leaves:
        return tree, {}
    for x, t in zip(leaves, targets, strict=True):
        for s in (x.sharding, t):
            if not isinstance(s, NamedSharding) or "data" in jax.tree.leaves(tuple(s.spec)):
                raise ValueError(f"cannot move {s}: state moved between trainer cells must be "
                                 "replicated on the 'data' axis")
    old, new = leaves[0].sharding.mesh, targets[0].mesh
    if old.devices.shape[1:] != new.devices.shape[1:]:
        raise ValueError(f"trainer cells of shape {old.devices.shape[1:]} cannot become "
                         f"{new.devices.shape[1:]}; only the data axis may change")
    old_slices = {tuple(x.id for x in old.devices[d].flat): d for d in range(old.shape["data"])}
    procs = sorted({x.process_index for x in old.devices.flat})
    holders = [p for p in procs if any(_holds(old, d, p) for d in range(old.shape["data"]))]

    def replica_of(p: int) -> list[Any]:
        """Process p's replica of every leaf, on its first whole slice (no copy)."""
        d = next(i for i in range(old.shape["data"]) if _holds(old, i, p))
        sub = _sub_mesh(old, d)
        out = []
        for x in leaves:
            by_dev = {s.device: s.data for s in x.addressable_shards}
            sh = NamedSharding(sub, x.sharding.spec)
            out.append(jax.make_array_from_single_device_arrays(
                x.shape, sh, [by_dev[dev] for dev in sub.devices.flat] if p == process else [],
                dtype=x.dtype))
        return out

    mine: list[dict] = [{} for _ in leaves]  # per leaf: device → single-device array
    counts = {"cells_kept": 0, "cells_copied": 0}
    local_replica: list[Any] | None = None
    for d in range(new.shape["data"]):
        ids = tuple(x.id for x in new.devices[d].flat)
        owner = new.devices[d].flat[0].process_index
        sub = _sub_mesh(new, d)
        if ids in old_slices:  # the cell stays: its buffers are already there
            counts["cells_kept"] += 1
            if owner == process:
                for i, x in enumerate(leaves):
                    for s in x.addressable_shards:
                        if s.device.id in ids:
                            mine[i][s.device] = s.data
            continue
        subs = [NamedSharding(sub, t.spec) for t in targets]
        if owner in holders:  # a replica on the same process: an in-process copy
            counts["cells_copied"] += 1
            if owner != process:
                continue
            if local_replica is None:
                local_replica = replica_of(process)
            moved = jax.device_put(local_replica, subs)
        else:
            raise ValueError(f"process {owner} holds no trainer cell to copy from; every "
                             "process keeps one (WorldCells.problem)")
        for i, y in enumerate(moved):
            for s in y.addressable_shards:
                mine[i][s.device] = s.data
    out = [jax.make_array_from_single_device_arrays(
        x.shape, t, [m[dev] for dev in t.addressable_devices_indices_map(x.shape)],
        dtype=x.dtype) for x, t, m in zip(leaves, targets, mine, strict=True)]
    jax.block_until_ready(out)
    return jax.tree_util.tree_unflatten(treedef, out), counts


class KeepTrainerPerProcess:
    """A planner that never takes a process's last trainer cell away (`WorldCells.problem`):
    those cells are pinned in the signals the inner planner (ERS's rules) sees."""

    def __init__(self, inner: Any, cells: WorldCells):
        self.inner, self.cells = inner, cells

    def plan(self, signals: Any, cells: CellMap) -> Any:
        pinned = signals.pinned | self.cells.last_trainer_cells(cells)
        return self.inner.plan(dataclasses.replace(signals, pinned=pinned), cells)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


MakeRank = Callable[[int, Any, int], Awaitable[Any]]
"""(rank id, weights already in the rank's layout, version) -> a started RolloutRank."""


class WorldCellRuntime:
    """Process 0's `Hooks.apply_roles` for a multi-host world (module docstring)."""

    def __init__(self, cells: WorldCells, *, trainer: Any, batcher: Any, make_rank: MakeRank,
                 remote_rank: Callable[[int, int], Any]):
        self.cells = cells
        self.trainer = trainer
        self.batcher = batcher
        self.make_rank = make_rank
        self.remote_rank = remote_rank
        self.epoch = 0

    @property
    def initial(self) -> CellMap:
        return self.cells.initial

    async def apply_roles(self, change: RoleChange, weights: Any) -> RoleChangeResult:
        if change.ref_mode == "decoupled" or change.after.count("ref"):
            raise ValueError("a decoupled Ref across processes is not supported; keep "
                             "controller.elastic.max_ref_cells=0 on several hosts")
        if why := self.cells.problem(change.after):  # refused before any process moves
            raise ValueError(f"role change refused: {why}")
        t0 = time.perf_counter()
        tr = self.trainer
        joining = [r for c in change.joining_rollout() for r in change.rank_ids(c)]
        # Remote ranks exist (and listen) before their agent can say they are live.
        remote = {r: self.remote_rank(r, self.cells.rank_process(r)) for r in joining
                  if self.cells.rank_process(r) != 0}
        self.epoch += 1
        trees, cost = await asyncio.wrap_future(tr.spmd_call(
            "remesh", cells=list(change.after.roles), epoch=self.epoch,
            version=change.version, joining=joining))
        self.batcher.n_ranks = dp_size(tr.actor_mesh)
        self.batcher.order = "colocated"
        cost["trainer_data"] = int(tr.actor_mesh.shape["data"])
        t1 = time.perf_counter()
        ranks = []
        for r in joining:
            try:
                if r in remote:
                    await remote[r].start()
                    if remote[r].failed is not None:  # its host could not start it
                        raise remote[r].failed
                    ranks.append(remote[r])
                else:
                    ranks.append(await self.make_rank(r, trees[r], change.version))
            except Exception:  # a device failure must not stop the run
                log.exception("rollout rank %d (process %d) failed to start; its slot stays "
                              "empty", r, self.cells.rank_process(r))
        cost["join_s"] = time.perf_counter() - t1
        cost["hook_s"] = time.perf_counter() - t0
        return RoleChangeResult(ranks, cost)
