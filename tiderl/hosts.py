"""One job on several hosts (one process each, one JAX world): what every process builds, what
process 0 runs (the controller), and what the others run (a host agent and the trainer's plan).

Every process runs the same prologue in the same order — build the policy on the world's
meshes, the SPMD trainer, the orbax checkpointer (and restore), the initial weight sync to its
own rollout ranks — because each step of it spans processes. Then:

- process 0: the controller, exactly as in one process, over a rank list that mixes its own
  `RolloutRank`s with `RemoteRank`s of the others (`tiderl.agent`); the trainer publishes each
  unit of device work before running it (`tiderl.train.spmd`), weight syncs and checkpoints are
  such units, and the env client, metrics, Prometheus and the run folder are its alone;
- every other process: its `HostAgent` on an event loop (its ranks' turns) and, on one control
  thread, the trainer's plan stream replayed unit by unit until process 0 says stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax

from tiderl.agent import HostAgent, RemoteRank, Router
from tiderl.cells import RoleMap, role_map
from tiderl.config import RunConfig
from tiderl.distributed import DistributedConfig, StoppedByLeader, World
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.spmd import SpmdTrainer
from tiderl.weightsync import SyncPlan, SyncStats

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Setup:
    """What the prologue built on this process."""

    plan: Any
    meshes: dict
    graphdef: Any
    template: Any
    rcfg: Any
    trainer: SpmdTrainer
    ckpt: Checkpointer
    roles: RoleMap
    ranks: dict[int, RolloutRank]
    """This process's rollout ranks by global rank id."""
    start_step: int
    data_state: dict


def prologue(cfg: RunConfig, world: World, resume: bool) -> Setup:
    """Everything that spans processes before the run, in the same order on every process."""
    from tiderl.envs.templates import template_for
    from tiderl.job import rollout_config_for, trainer_config_for_mode
    from tiderl.launch import build
    from tiderl.models.tokenizer import load_tokenizer

    devices, plan, meshes, graphdef, params = build(cfg)
    template = template_for(load_tokenizer(cfg.model.tokenizer), "auto")
    rcfg = rollout_config_for(cfg, template)
    trainer = SpmdTrainer(trainer_config_for_mode(cfg), cfg.model, actor_mesh=meshes["actor"],
                          ref_mesh=meshes["ref"] if plan.ref else None,
                          temperature=rcfg.temperature, seed=cfg.seed,
                          policy=(graphdef, params), world=world)
    ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", keep=cfg.controller.keep_checkpoints)
    trainer.ckpt = ckpt
    start_step, data_state = 0, {"next_index": 0, "pending": []}
    if resume:
        restored = ckpt.restore(trainer)
        if restored is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {cfg.run_dir}/"
                                    "checkpoints; start without --resume")
        start_step, data_state = restored
    local = jax.local_device_count()
    roles = role_map(plan, local_devices=local, fsdp=cfg.trainer.fsdp,
                     model_parallel=cfg.trainer.model_parallel)
    cells = roles.rollout()
    trainer.syncer = SyncPlan(process=world.process_id, size=world.size,
                              rank_meshes=list(meshes["rollout"]),
                              rank_process=[c.process for c in cells],
                              trainer_mesh=meshes["actor"], abstract=trainer._abstract,
                              weight_source=cfg.distributed.weight_source, barrier=world.barrier)
    trainer.roles = roles
    trees, _ = trainer.syncer.run(trainer.state["params"])
    ranks = {r: RolloutRank(r, Engine(graphdef, tree, cfg.model, rcfg, seed=cfg.seed,
                                      version=trainer.version),
                            max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots))
             for r, tree in sorted(trees.items())}
    log.info("process %d: ranks %s here; weights %s", world.process_id, sorted(ranks),
             trainer.syncer.describe())
    return Setup(plan, meshes, graphdef, template, rcfg, trainer, ckpt, roles, ranks,
                 start_step, data_state)


def _prepare(cfg: RunConfig, run_dir: Path, resume: bool) -> None:
    from tiderl.job import set_aside_previous_run

    if not resume:
        set_aside_previous_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        # Without the world's addresses: where a run's processes sit is not part of the run
        # (a resume may use other hosts, or another process count).
        placed = dataclasses.replace(cfg, distributed=DistributedConfig())
        (run_dir / "config.yaml").write_text(placed.to_yaml())


async def run_multihost(cfg: RunConfig, world: World, *, resume: bool,
                        overrides: tuple[str, ...] | list[str]) -> dict:
    run_dir = Path(cfg.run_dir)
    if world.is_leader:
        _prepare(cfg, run_dir, resume)
    # Nobody touches the run folder before process 0 has set it up (it may move an old run).
    await asyncio.to_thread(world.barrier, "run_dir")
    world.hint = (f"the checkpoints in {run_dir / 'checkpoints'} are intact: restart every "
                  f"process with --resume {run_dir}")
    setup = prologue(cfg, world, resume)
    if world.is_leader:
        return await _lead(cfg, world, setup, resume, overrides)
    return await _follow(world, setup)


async def _follow(world: World, s: Setup) -> dict:
    agent = HostAgent(world, list(s.ranks.values()))
    s.trainer.on_synced = agent.weights
    out: dict[str, str] = {}

    def control() -> None:
        try:
            out["reason"] = s.trainer.follow()
        except BaseException as e:  # noqa: BLE001 - this process can no longer follow the plan
            world.stop(f"process {world.process_id} failed in the trainer's plan: "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", code=1)
        finally:
            agent.stop()

    thread = threading.Thread(target=control, name="tiderl-control", daemon=True)
    thread.start()
    await agent.serve()
    await asyncio.to_thread(thread.join)
    s.ckpt.wait()
    s.ckpt.close()
    await asyncio.to_thread(world.shutdown)
    reason = out.get("reason", "")
    if reason:
        raise StoppedByLeader(f"process 0 stopped the run: {reason}")
    return {"process": world.process_id, "ended": "completed (host agent)"}


async def _lead(cfg: RunConfig, world: World, s: Setup, resume: bool,
                overrides: tuple[str, ...] | list[str]) -> dict:
    from tiderl.control.buffer import ReadinessBuffer
    from tiderl.control.controller import Controller, Hooks
    from tiderl.control.ers import Roles
    from tiderl.control.metrics import MetricsSink
    from tiderl.envs.client import EnvClient
    from tiderl.envs.config import with_default_token
    from tiderl.envs.server import endpoint
    from tiderl.envs.tasks import TaskSource, TaskStream
    from tiderl.job import MicroBatcher, trim_metrics
    from tiderl.serving.ctb import make_scheduler
    from tiderl.serving.rollout import RolloutManager
    from tiderl.train.ref_actor import dp_size

    run_dir = Path(cfg.run_dir)
    trainer, ckpt, rcfg = s.trainer, s.ckpt, s.rcfg
    data_state = s.data_state
    if resume:
        log.info("resuming at step %d, version %d", s.start_step, trainer.version)
        if n := trim_metrics(run_dir, s.start_step):
            log.warning("%d metrics records logged after the checkpoint of step %d moved to "
                        "metrics.discarded.jsonl (those steps run again)", n, s.start_step)
        with (run_dir / "resumes.jsonl").open("a") as f:
            f.write(json.dumps({"from_step": s.start_step, "at": time.time(),
                                "overrides": list(overrides), "processes": world.size}) + "\n")
    # Stopped by a dead peer (the watchdog exits at once): the run folder still says why.
    world.on_lost(lambda why: (run_dir / "summary.json").write_text(
        json.dumps({"ended": f"stopped: {why}", "processes": world.size})))
    router = Router(world)
    ranks: list[Any] = [s.ranks[c.index] if c.index in s.ranks
                        else RemoteRank(c.index, c.process, router) for c in s.roles.rollout()]
    sched_kind = cfg.rollout.scheduler if cfg.controller.mode == "tiderl" else "vanilla"
    sched = make_scheduler(sched_kind, cfg.rollout.ctb, [rcfg.num_pages * rcfg.page_size]
                           * len(ranks), max_context=rcfg.max_context,
                           max_tasks_per_rank=rcfg.max_slots)
    sched.cfg.check_group_size(cfg.env.group_size)

    async def sync_weights(_token: Any, version: int) -> dict:
        trees, stats = await asyncio.wrap_future(trainer.spmd_call(
            "sync", version=version, roles=trainer.roles.to_wire()))
        acks = await asyncio.gather(*(r.update_weights(trees.get(r.rank_id), version)
                                      for r in ranks))
        total = SyncStats()
        for r, ack in zip(ranks, acks, strict=True):
            part = stats.get(r.rank_id) if r.rank_id in trees else ack
            if part:
                total.add(SyncStats(**part))
        return total.metrics()

    async def checkpoint(step: int, state: dict) -> None:
        await asyncio.wrap_future(trainer.spmd_call("save", data_state=state))

    train_stream = TaskStream(TaskSource.from_config(cfg.env, "train"))
    train_stream.set_state({"next_index": int(data_state.get("next_index", 0))})
    eval_src = TaskSource.from_config(cfg.env, "eval")
    eval_groups = [eval_src.element(k) for k in range(eval_src.groups)]
    order = "decoupled" if trainer.mode == "decoupled" else "colocated"
    hooks = Hooks(sync_weights=sync_weights,
                  make_microbatches=MicroBatcher(cfg, dp_size(s.meshes["actor"]), order),
                  checkpoint=checkpoint)
    buffer = ReadinessBuffer(groups_per_microbatch=cfg.controller.groups_per_microbatch,
                             max_staleness=cfg.controller.max_staleness,
                             min_ok_per_group=cfg.controller.min_ok_per_group,
                             zero_var=cfg.trainer.zero_var_groups, adv_eps=cfg.trainer.adv_eps)
    metrics = MetricsSink(run_dir, console=cfg.controller.console,
                          prometheus_port=cfg.controller.prometheus_port,
                          prometheus_host=cfg.controller.prometheus_host,
                          prometheus_token=cfg.controller.prometheus_token,
                          total_steps=cfg.controller.steps)
    summary: dict = {}
    reason = "the run failed on process 0"
    try:
        for r in ranks:
            await r.start()
        env_cfg, _ = with_default_token(cfg.env)  # an exposed in-process server gets a token
        async with endpoint(env_cfg) as url, EnvClient(url, env_cfg) as env:
            manager = RolloutManager(ranks, sched, env, s.template, max_turns=cfg.env.max_turns,
                                     system=cfg.controller.system_prompt or None,
                                     eval_temperature=cfg.controller.eval_temperature)
            controller = Controller(
                cfg.controller, manager=manager, trainer=trainer, hooks=hooks,
                train_stream=train_stream, eval_groups=eval_groups, metrics=metrics,
                buffer=buffer, roles=Roles(len(ranks), len(s.plan.actor), len(s.plan.ref)),
                start_step=s.start_step, pending=data_state.get("pending", []))
            summary = await controller.run()
            summary["rollout"] = {k: v for k, v in manager.stats().items() if k != "per_rank"}
            summary["processes"] = world.size
            summary["rollout"]["turns_per_rank"] = [r.stats.turns for r in ranks]
            reason = ""
    except BaseException as e:
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        raise
    finally:
        metrics.close()
        for r in ranks:
            await r.close()
        # After everything queued on the worker: the followers' plan streams end here.
        stop = trainer.call(lambda: trainer.stop_followers(reason))
        try:
            await asyncio.wait_for(asyncio.wrap_future(stop), cfg.distributed.barrier_timeout_s)
        except TimeoutError:
            trainer.stop_followers(reason)
        ckpt.wait()
        ckpt.close()
        trainer.close()
        router.close()
        await asyncio.to_thread(world.shutdown)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary.get("steps"):
        from tiderl.report import write_plots

        summary["plots"] = [str(p) for p in write_plots(run_dir)]
    return summary
