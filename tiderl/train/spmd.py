"""The trainer across processes: one SPMD program stream, issued in the same order everywhere.

`SpmdTrainer` is the `TrainerBackend` whose Actor/Ref meshes span the devices of several
processes. Process 0 runs the real executor (its worker thread decides aggregation, order and
when to apply); before each unit of device work it publishes that unit on the plan stream, and
every other process runs exactly that unit on its own control thread (`follow`). Units:

    group   micro-batches to run through Ref and Actor (the host arrays travel; each process
            puts only its own rows on its devices: `jax.make_array_from_process_local_data`)
    finish  normalise, clip, AdamW update (version + 1)
    sync    weights to the rollout ranks (`tiderl.runtime.weightsync`; the plan carries the role map)
    remesh  an elastic role change (`tiderl.runtime.worldcells`): the Actor mesh over the new trainer
            cells, the state moved there, the role map's next epoch, the sync plan for the new
            rollout ranks and their first weights (ranks of cells joining rollout)
    save    an orbax checkpoint (every process writes its shards; multi-host save)
    stop    the end of the run

No process ever decides on its own to run a collective (no `if process_index() == 0:` around
one): the leader's decisions arrive as data, and followers only replay them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tiderl.runtime.cells import RoleMap
from tiderl.train.backend import TrainerBackend
from tiderl.train.dispatch import MicroBatch
from tiderl.train.ref_actor import batch_sharding, dp_size

log = logging.getLogger(__name__)

PLAN = "plan"


def mb_to_wire(mb: MicroBatch) -> dict:
    return {**mb.arrays(), "uids": list(mb.uids)}


def mb_from_wire(d: dict) -> MicroBatch:
    d = dict(d)
    uids = tuple(d.pop("uids"))
    return MicroBatch(**d, uids=uids)


def local_rows(sharding: Any, shape: tuple[int, ...]) -> slice:
    """The rows of a batch-sharded array this process holds (one contiguous block: a
    process's devices form whole `data` slices)."""
    idx = [i[0] for i in sharding.addressable_devices_indices_map(shape).values()]
    starts = sorted({(s.start or 0, shape[0] if s.stop is None else s.stop) for s in idx})
    lo, hi = starts[0][0], starts[-1][1]
    if sum(b - a for a, b in starts) != hi - lo:
        raise ValueError(f"this process's batch rows {starts} are not one block; lay the "
                         "trainer out with whole cells per process")
    return slice(lo, hi)


class SpmdTrainer(TrainerBackend):
    """TrainerBackend over meshes spanning processes (see the module docstring)."""

    def __init__(self, *args: Any, world: Any, **kw: Any):
        self.world = world
        self.channel = world.channel()
        self.syncer: Any = None
        """`tiderl.runtime.hosts.SyncPlan` (set by the job): runs the `sync` unit."""
        self.ckpt: Any = None
        """`Checkpointer` (set by the job): runs the `save` unit."""
        self.on_synced: Callable[[dict, int, dict], None] | None = None
        """Follower side: hands each sync's rank weights to the host agent."""
        self.roles: RoleMap | None = None
        self.cells: Any = None
        """`tiderl.runtime.worldcells.WorldCells` (set by the site when cells can move)."""
        self.make_syncer: Callable[[RoleMap], Any] | None = None
        """Role map → the `SyncPlan` for its rollout ranks (set by the site)."""
        self.on_joined: Callable[[dict, int], None] | None = None
        """Follower side: hands the first weights of ranks joining rollout to the host agent."""
        cfg = args[0] if args else kw["cfg"]
        if cfg.lora_rank:
            from tiderl.configlib import ConfigError

            raise ConfigError(f"config key 'trainer.lora_rank'={cfg.lora_rank}: LoRA runs on "
                              "one process for now (its sync moves adapters in-process); set "
                              "trainer.lora_rank=0 or run on one process")
        super().__init__(*args, **kw)

    def _decide_offload(self) -> bool:
        # As the base class decides, from a device of this process (another's memory stats
        # cannot be read). Hosts of one world are alike, so every process decides the same,
        # which matters: offload adds device_puts to the plan.
        if self.cfg.offload != "auto":
            return self.cfg.offload == "always"
        mine = next(d for d in self.actor_mesh.devices.flat
                    if d.process_index == jax.process_index())
        stats = mine.memory_stats() or {}
        if "bytes_limit" not in stats:
            return False
        per_device = sum(x.addressable_shards[0].data.nbytes
                         for x in jax.tree.leaves((self.state, self.ref_params)))
        return per_device > self.cfg.offload_fraction * stats["bytes_limit"]

    # ---------------------------------------------------------------- leader: publish, then run
    def _publish(self, msg: dict) -> None:
        if self.world.is_leader:
            for k in range(1, self.world.size):
                self.channel.send(k, PLAN, msg)

    def _process(self, group: list[MicroBatch]) -> None:
        self._publish({"op": "group", "mbs": [mb_to_wire(mb) for mb in group]})
        super()._process(group)

    def _finish(self) -> dict:
        self._publish({"op": "finish"})
        return super()._finish()

    def put(self, mb: MicroBatch, role: str) -> dict:
        mesh = self.actor_mesh if role == "actor" else self.ref_mesh
        rows, n = mb.tokens_bt.shape[0], dp_size(mesh)
        if rows % n:
            raise ValueError(f"micro-batch has {rows} rows, not divisible by the {role} mesh's "
                             f"{n} data-parallel shards; pack with n_ranks={n}")
        if mb.images:
            raise ValueError(f"a micro-batch carries {len(mb.images)} images; the multi-process "
                             "trainer does not move images yet: train a vision-language "
                             "model on one host")
        sh = batch_sharding(mesh)
        arrays = mb.arrays()
        mine = local_rows(sh, arrays["tokens_bt"].shape)
        # Every process passes only the rows of its own devices: no collective, no host copy
        # of the whole batch on the device side.
        return {k: jax.make_array_from_process_local_data(sh, np.ascontiguousarray(v[mine]),
                                                          v.shape)
                for k, v in arrays.items()}

    def spmd_call(self, name: str, **args: Any):
        """Runs unit `name` on the worker thread after the work queued before it, on every
        process (published first). Returns a concurrent Future of the leader's result."""
        def run() -> Any:
            self._publish({"op": name, **args})
            return getattr(self, f"op_{name}")(**args)

        return self.call(run)

    async def export_weights_async(self) -> Any:
        # The sync unit reads the trainer's params in place (each process its own replica) and
        # copies them into the ranks' buffers before the next update can donate them, so no
        # separate export copy is made; the controller passes this token back to the sync hook.
        return {"version": self.version}

    def stop_followers(self, reason: str = "") -> None:
        """Ends every follower's plan stream (the run is over, or the leader failed)."""
        self._publish({"op": "stop", "reason": reason})

    # ---------------------------------------------------------------- the units
    def op_sync(self, version: int, roles: dict) -> tuple[dict, dict]:
        rm = RoleMap.from_wire(roles)
        if self.roles is not None and rm != self.roles:
            # Cells change roles only through the `remesh` unit, which moves the trainer state
            # and ranks and sets `self.roles` before the boundary's sync; a sync carrying
            # another map means the plan stream lost a unit: never run with a stale layout.
            raise RuntimeError(
                f"sync with role map epoch {rm.epoch}, but this process holds epoch "
                f"{self.roles.epoch}: a role change reached the sync without its remesh unit")
        self.roles = rm
        self.swap("actor", "device")  # an offloaded Actor comes back first (on every process)
        trees, stats = self.syncer.run(self.state["params"])
        wire_stats = {r: s.to_wire() for r, s in stats.items()}
        if self.on_synced is not None:
            self.on_synced(trees, version, wire_stats)
        return trees, wire_stats

    def _move_tree(self, tree: Any, shardings: Any) -> Any:
        from tiderl.runtime.worldcells import move_replicated

        moved, counts = move_replicated(tree, shardings, process=self.world.process_id)
        self._move_counts = counts  # the same for the state and the Ref (one mesh pair)
        return moved

    _move_counts: dict = {}

    def op_remesh(self, cells: list[str], epoch: int, version: int,
                  joining: list[int]) -> tuple[dict, dict]:
        """A role change (module docstring) to the cell roles `cells`; returns the weights of
        this process's ranks among `joining` (rank id → params in the rank's layout) and
        the change's costs."""
        from tiderl.control.plans import CellMap

        if self.cells is None or self.make_syncer is None:
            raise RuntimeError("a role change on a process without cells (controller.ers)")
        cm = CellMap(tuple(cells))
        if why := self.cells.problem(cm):
            raise ValueError(f"role change to {cells} refused: {why}")
        actor = self.cells.actor_mesh(cm)
        cost: dict[str, Any] = {"move_s": 0.0, "kernels": "unchanged"}
        self._move_counts = {}
        if actor != self.actor_mesh:
            cost.update(self.set_meshes(actor, None))
            cost.update(self._move_counts)
        self.roles = self.cells.role_map(cm, epoch)
        self.syncer = self.make_syncer(self.roles)
        t0 = time.perf_counter()
        trees, _ = self.syncer.run(self.state["params"], only=joining)
        cost["join_sync_s"] = time.perf_counter() - t0
        if self.on_joined is not None:
            self.on_joined(trees, version)
        return trees, cost

    def op_save(self, data_state: Any) -> int:
        return self.ckpt.save(self, data_state=data_state)

    # ---------------------------------------------------------------- followers
    def follow(self) -> str:
        """Replays the leader's units until `stop`; returns the leader's reason (if any)."""
        while True:
            msg = self.channel.recv(0, PLAN)
            op = msg.pop("op")
            if op == "group":
                self._process([mb_from_wire(m) for m in msg["mbs"]])
            elif op == "finish":
                self._finish()
            elif op == "stop":
                return str(msg.get("reason", ""))
            else:
                getattr(self, f"op_{op}")(**msg)
