"""Where a job runs: this process alone, or one JAX world of several (one process per host).

`tiderl.runtime.job.run_job` asks its site for the few things that differ (`site_for(cfg)`):

- `LocalSite` (one process): today's `TrainerBackend`, an engine per rollout rank, weights
  resharded in-process, checkpoints on the trainer's worker thread.
- `LeaderSite` (process 0 of several): the same job with `SpmdTrainer` (each unit of device
  work published on the plan stream before it runs, `tiderl.train.spmd`), a rank list mixing
  its own `RolloutRank`s with `RemoteRank`s of the other processes (`tiderl.runtime.remote_rank`), weight
  syncs and checkpoints as plan units, and at the end the other processes' plan closed and
  the world left in order. The controller, the env client, metrics and the run folder are
  process 0's alone.
- `FollowerSite` (every other process): `follow` runs its whole part — the same prologue as
  process 0 (every step of it spans processes), then its `HostAgent` (its ranks' turns) on the
  event loop and the trainer's plan, replayed unit by unit on one control thread, until process
  0 says stop.

With elastic scaling on, `LeaderSite.elastic` gives the job the role-change hook across
processes (`tiderl.runtime.worldcells.WorldCellRuntime`): each change is a `remesh` plan unit; a
follower's agent starts the ranks of its cells joining rollout and drains those leaving.

The contract that keeps the world in step: every JAX call in `run_job` that spans processes,
before the controller starts, has its twin in `FollowerSite.prologue`, in the same order
(build the policy, the trainer, the checkpointer and its restore, the first weight sync). After
that, only plan units span processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.config import RunConfig
from tiderl.configlib import ConfigError
from tiderl.runtime.cells import RoleMap, role_map
from tiderl.runtime.remote_rank import HostAgent, RemoteRank, Router
from tiderl.runtime.world import DistributedConfig, StoppedByLeader, World, initialize

log = logging.getLogger(__name__)


class LocalSite:
    """One process: the job exactly as it runs without a world."""

    follower = False

    def __init__(self, cfg: RunConfig, world: World):
        self.cfg, self.world = cfg, world

    def config_yaml(self, cfg: RunConfig) -> str:
        # Where a run's processes sit is not part of the run: a resume may use other hosts or
        # another process count, so config.yaml keeps no addresses.
        return dataclasses.replace(cfg, distributed=DistributedConfig()).to_yaml()

    async def ready(self) -> None:
        pass

    def trainer(self, *args: Any, **kw: Any) -> Any:
        from tiderl.train.backend import TrainerBackend

        return TrainerBackend(*args, **kw)

    async def ranks(self, cfg: RunConfig, trainer: Any, graphdef: Any, meshes: dict,
                    rcfg: Any) -> tuple[list[Any], Any]:
        from tiderl.runtime.parts import local_ranks

        return await local_ranks(cfg, trainer, graphdef, meshes, rcfg)

    def checkpoint(self, trainer: Any, ckpt: Any) -> Any:
        async def checkpoint(step: int, state: dict) -> None:
            # On the trainer's worker thread: the save's device→host copy (and a swap back
            # from host memory) must neither block the event loop nor race the trainer's work.
            await asyncio.wrap_future(trainer.call(lambda: ckpt.save(trainer,
                                                                     data_state=state)))

        return checkpoint

    def annotate(self, summary: dict, ranks: list[Any]) -> None:
        pass

    async def finish(self, trainer: Any, error: BaseException | None) -> None:
        pass

    async def leave(self) -> None:
        pass


def _rank_cells(cfg: RunConfig, plan: Any, local_devices: int) -> RoleMap:
    return role_map(plan, local_devices=local_devices, fsdp=cfg.trainer.fsdp,
                    model_parallel=cfg.trainer.model_parallel)


def _sync_plan(cfg: RunConfig, world: World, trainer: Any, roles: RoleMap,
               rank_meshes: Sequence[Any], tag: str = ""):
    """The weight sync from the trainer's current mesh to the rollout ranks of `roles`
    (`rank_meshes` in their order; `tag` keeps a later epoch's transfers apart)."""
    from tiderl.runtime.weightsync import SyncPlan

    ranks = roles.rollout()
    return SyncPlan(process=world.process_id, size=world.size, rank_meshes=list(rank_meshes),
                    rank_process=[c.process for c in ranks], rank_ids=[c.index for c in ranks],
                    trainer_mesh=trainer.actor_mesh, abstract=trainer._abstract,
                    weight_source=cfg.distributed.weight_source, barrier=world.barrier, tag=tag)


def _new_rank(cfg: RunConfig, graphdef: Any, rcfg: Any, rank_id: int, tree: Any,
              version: int) -> Any:
    """A rollout rank (not started) on weights a sync put in its layout."""
    from tiderl.serving.engine import Engine
    from tiderl.serving.rank import RolloutRank

    return RolloutRank(rank_id, Engine(graphdef, tree, cfg.model, rcfg, seed=cfg.seed,
                                       version=version),
                       max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots),
                       share_prefixes=rcfg.share_prefixes)


def _own_ranks(cfg: RunConfig, trainer: Any, graphdef: Any, rcfg: Any, trees: dict) -> dict:
    """This process's ranks (global ids) on the weights the first sync put in their layout."""
    return {r: _new_rank(cfg, graphdef, rcfg, r, tree, trainer.version)
            for r, tree in sorted(trees.items())}


def world_cells(cfg: RunConfig, plan: Any, world: World) -> Any:
    """The world's cells for elastic scaling (`tiderl.runtime.worldcells`), or None (with the reason
    logged) when the roles are not whole cells inside each process."""
    import jax

    from tiderl.runtime.devices import cell_layout
    from tiderl.runtime.worldcells import WorldCells

    t = cfg.trainer
    if cfg.rollout.devices_per_rank != 1 or plan.ref:
        return None
    try:
        layout = cell_layout(plan, t.fsdp * t.model_parallel)
        return WorldCells(layout, jax.devices(), local_devices=jax.local_device_count(),
                          fsdp=t.fsdp, model_parallel=t.model_parallel)
    except (ConfigError, ValueError) as e:
        log.info("no cells across processes: %s", e)
        return None


def _bind_cells(cfg: RunConfig, world: World, trainer: Any, cells: Any) -> None:
    """Lets the trainer's `remesh` unit rebuild the sync plan for each new role map."""
    from tiderl.runtime.weightsync import SyncPlan

    trainer.cells = cells
    if cells is None:
        return

    def make_syncer(rm: RoleMap) -> SyncPlan:
        return _sync_plan(cfg, world, trainer, rm, [cells.rank_mesh(c) for c in rm.rollout()],
                          tag=f"e{rm.epoch}/")

    trainer.make_syncer = make_syncer


class LeaderSite(LocalSite):
    """Process 0 of a world: runs the controller over every process's ranks."""

    def __init__(self, cfg: RunConfig, world: World):
        super().__init__(cfg, world)
        self.trainer_obj: Any = None
        self.router = Router(world)
        self.remote: list[RemoteRank] = []
        self.live: Any = None
        """() -> the ranks a sync reaches (set by the job when cells move; default: the
        ranks this site started with)."""

    async def ready(self) -> None:
        run_dir = Path(self.cfg.run_dir)
        self.world.hint = (f"the checkpoints in {run_dir / 'checkpoints'} are intact: restart "
                           f"every process with --resume {run_dir}")
        # Stopped by a dead peer (the watchdog exits at once): the run folder still says why.
        self.world.on_lost(lambda why: (run_dir / "summary.json").write_text(
            json.dumps({"ended": f"stopped: {why}", "processes": self.world.size})))
        # The others touch the run folder only after process 0 set it up (it may move an old
        # run aside).
        await asyncio.to_thread(self.world.barrier, "run_dir")

    def trainer(self, *args: Any, **kw: Any) -> Any:
        from tiderl.train.spmd import SpmdTrainer

        self.trainer_obj = SpmdTrainer(*args, world=self.world, **kw)
        return self.trainer_obj

    async def ranks(self, cfg: RunConfig, trainer: Any, graphdef: Any, meshes: dict,
                    rcfg: Any) -> tuple[list[Any], Any]:
        import jax

        from tiderl.runtime.cells import device_plan_for
        from tiderl.runtime.weightsync import SyncStats

        local = jax.local_device_count()
        roles = _rank_cells(cfg, device_plan_for(cfg, self.world.size, local), local)
        trainer.roles = roles
        trainer.syncer = _sync_plan(cfg, self.world, trainer, roles, meshes["rollout"])
        # The first sync spans processes (the followers run it in their prologue).
        trees, _ = await asyncio.to_thread(trainer.syncer.run, trainer.state["params"])
        own = _own_ranks(cfg, trainer, graphdef, rcfg, trees)
        log.info("%d processes; ranks here %s; weights %s", self.world.size, sorted(own),
                 trainer.syncer.describe())
        ranks: list[Any] = []
        for c in roles.rollout():
            if c.index in own:
                ranks.append(own[c.index])
            else:
                ranks.append(RemoteRank(c.index, c.process, self.router))
                self.remote.append(ranks[-1])

        async def sync_weights(_token: Any, version: int) -> dict:
            trees, stats = await asyncio.wrap_future(trainer.spmd_call(
                "sync", version=version, roles=trainer.roles.to_wire()))
            now = list(self.live()) if self.live is not None else ranks
            acks = await asyncio.gather(*(r.update_weights(trees.get(r.rank_id), version)
                                          for r in now))
            total = SyncStats()
            for r, ack in zip(now, acks, strict=True):
                part = stats.get(r.rank_id) if r.rank_id in trees else ack
                if part:
                    total.add(SyncStats(**part))
            return total.metrics()

        return ranks, sync_weights

    def elastic(self, cfg: RunConfig, plan: Any, trainer: Any, batcher: Any, graphdef: Any,
                rcfg: Any) -> Any:
        """The role-change hook across processes (`tiderl.runtime.worldcells.WorldCellRuntime`), or
        None when the roles are not whole cells. Every process binds the same cells (the
        followers in `prologue`)."""
        from tiderl.runtime.worldcells import WorldCellRuntime

        cells = world_cells(cfg, plan, self.world)
        _bind_cells(cfg, self.world, trainer, cells)
        if cells is None:
            return None

        async def make_rank(rank_id: int, tree: Any, version: int) -> Any:
            rank = await asyncio.to_thread(_new_rank, cfg, graphdef, rcfg, rank_id, tree,
                                           version)
            await rank.start()
            return rank

        def remote_rank(rank_id: int, process: int) -> RemoteRank:
            return RemoteRank(rank_id, process, self.router)

        return WorldCellRuntime(cells, trainer=trainer, batcher=batcher, make_rank=make_rank,
                                remote_rank=remote_rank)

    def checkpoint(self, trainer: Any, ckpt: Any) -> Any:
        trainer.ckpt = ckpt

        async def checkpoint(step: int, state: dict) -> None:
            # A plan unit: every process writes its shards of the same checkpoint.
            await asyncio.wrap_future(trainer.spmd_call("save", data_state=state))

        return checkpoint

    def annotate(self, summary: dict, ranks: list[Any]) -> None:
        summary["processes"] = self.world.size
        summary.setdefault("rollout", {})["turns_per_rank"] = [r.stats.turns for r in ranks]

    async def finish(self, trainer: Any, error: BaseException | None) -> None:
        """After the ranks closed: the other processes' plan streams end (with the reason when
        process 0 failed), after every unit queued before."""
        reason = "" if error is None else f"{type(error).__name__}: " + \
            " ".join(str(error).split())[:300]
        stop = trainer.call(lambda: trainer.stop_followers(reason))
        try:
            await asyncio.wait_for(asyncio.wrap_future(stop),
                                   self.cfg.distributed.barrier_timeout_s)
        except TimeoutError:  # the worker is stuck: tell them directly
            trainer.stop_followers(reason)

    async def leave(self) -> None:
        self.router.close()
        await asyncio.to_thread(self.world.shutdown)


class FollowerSite(LocalSite):
    """Another process of a world: a host agent and the trainer's plan (see `follow`)."""

    follower = True

    async def follow(self, resume: bool) -> dict:
        from tiderl.runtime.build import start_devices

        world, cfg = self.world, self.cfg
        # JAX starts on every process before process 0 touches the run folder (it checks the
        # device plan first), so this process's backend joins the world's before the barrier.
        devices, plan = start_devices(cfg)
        await asyncio.to_thread(world.barrier, "run_dir")
        world.hint = (f"the checkpoints in {Path(cfg.run_dir) / 'checkpoints'} are intact: "
                      f"restart every process with --resume {cfg.run_dir}")
        trainer, ckpt, ranks = self.prologue(resume, devices, plan)
        agent = HostAgent(world, list(ranks.values()), make_rank=self._make_rank)
        trainer.on_synced = agent.weights
        trainer.on_joined = agent.join
        out: dict[str, str] = {}

        def control() -> None:
            try:
                out["reason"] = trainer.follow()
            except BaseException as e:  # noqa: BLE001 - this process can no longer follow
                world.stop(f"process {world.process_id} failed in the trainer's plan: "
                           f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", code=1)
            finally:
                agent.stop()

        thread = threading.Thread(target=control, name="tiderl-control", daemon=True)
        thread.start()
        await agent.serve()
        await asyncio.to_thread(thread.join)
        ckpt.wait()
        ckpt.close()
        await asyncio.to_thread(world.shutdown)
        if out.get("reason"):
            raise StoppedByLeader(f"process 0 stopped the run: {out['reason']}")
        return {"process": world.process_id, "ended": "completed (host agent)"}

    def prologue(self, resume: bool, devices: list, plan: Any) -> tuple[Any, Any, dict]:
        """`run_job`'s steps that span processes, in its order (see the module docstring)."""
        import jax

        from tiderl.envs.templates import template_for
        from tiderl.models.tokenizer import load_tokenizer
        from tiderl.runtime.build import build_policy
        from tiderl.runtime.parts import rollout_config_for, trainer_config_for_mode
        from tiderl.train.checkpoint import Checkpointer
        from tiderl.train.spmd import SpmdTrainer

        cfg = self.cfg
        meshes, graphdef, params = build_policy(cfg, devices, plan)
        rcfg = rollout_config_for(cfg, template_for(load_tokenizer(cfg.model.tokenizer),
                                                    "auto"))
        trainer = SpmdTrainer(trainer_config_for_mode(cfg), cfg.model,
                              actor_mesh=meshes["actor"],
                              ref_mesh=meshes["ref"] if plan.ref else None,
                              temperature=rcfg.temperature, seed=cfg.seed,
                              policy=(graphdef, params), world=self.world)
        ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints",
                            keep=cfg.controller.keep_checkpoints)
        trainer.ckpt = ckpt
        if resume and ckpt.restore(trainer) is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {cfg.run_dir}/"
                                    "checkpoints; start without --resume")
        roles = _rank_cells(cfg, plan, jax.local_device_count())
        trainer.roles = roles
        trainer.syncer = _sync_plan(cfg, self.world, trainer, roles, meshes["rollout"])
        trees, _ = trainer.syncer.run(trainer.state["params"])
        ranks = _own_ranks(cfg, trainer, graphdef, rcfg, trees)
        # The cells process 0 moves when elastic scaling is on (LeaderSite.elastic); unused
        # otherwise (no remesh unit arrives).
        _bind_cells(cfg, self.world, trainer, world_cells(cfg, plan, self.world))
        self._make_rank = lambda rid, tree, version: _new_rank(cfg, graphdef, rcfg, rid, tree,
                                                               version)
        log.info("process %d: ranks here %s", self.world.process_id, sorted(ranks))
        return trainer, ckpt, ranks


def site_for(cfg: RunConfig) -> LocalSite:
    """The site of this process: joins the world `cfg.distributed` describes (one process
    unless configured)."""
    world = initialize(cfg.distributed)
    if world.size == 1:
        return LocalSite(cfg, world)
    if cfg.model.scan_layers:  # the cross-process weight sync moves the trainer's own layout
        raise ConfigError("config key 'model.scan_layers'=true runs on one process only for "
                          f"now (this world has {world.size}); set model.scan_layers=false")
    return LeaderSite(cfg, world) if world.is_leader else FollowerSite(cfg, world)
