"""Builds one run from a RunConfig — engines, rollout ranks, trainer backend, env endpoint, task
streams, checkpoints — and runs the controller. The JAX side of `python -m tiderl.launch`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.agents.runner import episode_backend
from tiderl.config import VISION_PROCESSES, RunConfig
from tiderl.configlib import ConfigError, to_dict
from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.controller import Controller, Hooks, NonFiniteStop, StarvedStop
from tiderl.control.ers import make_planner
from tiderl.control.metrics import MetricsSink
from tiderl.control.plans import CellMap, initial_cells
from tiderl.control.progress import starvation_advice
from tiderl.control.samples import SampleWriter
from tiderl.envs.config import with_default_token
from tiderl.envs.health import env_url_error
from tiderl.envs.tasks import system_prompt as suite_system_prompt
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import load_tokenizer
from tiderl.models.vision_inputs import image_prompt_for
from tiderl.runtime.build import build_policy, start_devices
from tiderl.runtime.devices import cell_layout
from tiderl.runtime.parts import (
    MicroBatcher,
    WeightPlacer,
    rollout_config_for,
    trainer_config_for_mode,
)
from tiderl.runtime.taskstream import task_streams
from tiderl.serving.config import kv_budget_tokens
from tiderl.serving.ctb import make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.serving.weights import serving_weights
from tiderl.train.advantages import step_credit
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.ref_actor import dp_size

if TYPE_CHECKING:
    from tiderl.runtime.elastic import CellRuntime
    from tiderl.train.backend import TrainerBackend

log = logging.getLogger(__name__)


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """A new run (not `--resume`) in a folder that holds one: the old run moves to
    `<run_dir>.<k>` (first free k) instead of mixing metrics and checkpoints. Returns where."""
    if not ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        return None
    k = 1
    while run_dir.with_name(f"{run_dir.name}.{k}").exists():
        k += 1
    dest = run_dir.rename(run_dir.with_name(f"{run_dir.name}.{k}"))
    log.warning("%s held a previous run: moved it to %s (to continue a run, pass --resume %s)",
                run_dir, dest, run_dir)
    return dest


def trim_metrics(run_dir: Path, step: int) -> int:
    """Resuming from the checkpoint of `step`: records logged after it (steps > `step`, and
    evaluations of step ≥ `step`, which run again) move from `metrics.jsonl` to
    `metrics.discarded.jsonl`, so every step appears once. Returns how many moved."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, drop = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            drop.append(line)
            continue
        s = r.get("step", 0)
        late = s > step if r.get("kind") == "step" else r.get("kind") == "eval" and s >= step
        (drop if late else keep).append(line)
    if drop:
        with (run_dir / "metrics.discarded.jsonl").open("a") as f:
            f.write("".join(x + "\n" for x in drop))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)
    return len(drop)


async def run_job(cfg: RunConfig, *, resume: bool = False,
                  overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Runs the configured job to the end; returns the final summary.

    A new run writes its resolved `config.yaml`; a resumed one keeps it and appends the
    `overrides` it was resumed with to `resumes.jsonl`."""
    from tiderl.runtime.hosts import site_for

    site = site_for(cfg)  # this process alone, or process 0 of several (tiderl.runtime.hosts)
    if site.follower:  # another process of a multi-host world: its host agent, to the end
        return await site.follow(resume)
    if why := await asyncio.to_thread(env_url_error, cfg.env):  # before any device work
        raise ConfigError(why)
    # JAX starts and the device plan is checked before the run folder is touched: a command
    # line the devices cannot hold fails with the previous run where it was.
    devices, plan = start_devices(cfg)
    run_dir = prepare_run_dir(cfg, site, resume)
    await site.ready()
    job = _Job(cfg, site, run_dir, devices, plan)
    job.build(resume, overrides)
    await job.place_ranks()
    summary = await job.run(job.scheduler())
    return write_outputs(run_dir, summary)


def prepare_run_dir(cfg: RunConfig, site: Any, resume: bool) -> Path:
    """The run folder, made; a new run sets a previous one aside and writes its config.yaml."""
    run_dir = Path(cfg.run_dir)
    if not resume:
        set_aside_previous_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(site.config_yaml(cfg))
    return run_dir


def write_outputs(run_dir: Path, summary: dict) -> dict:
    """summary.json, and for a run that trained, its plots and report.md."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary.get("steps"):
        from tiderl.report import write_plots, write_report

        plots = write_plots(run_dir)
        summary["plots"] = [str(p) for p in plots]
        summary["report"] = str(write_report(run_dir, plots))
    return summary


class _Job:
    """One run assembled on process 0 (or the only process), phase by phase: `build` (policy,
    trainer, checkpoints), `place_ranks` (engines on cells or the site's ranks),
    `scheduler`, then `run` (hooks, planner, buffer, metrics, the controller, the close).
    Each phase leaves what the later ones use as attributes."""

    def __init__(self, cfg: RunConfig, site: Any, run_dir: Path, devices: list, plan: Any):
        self.cfg, self.site, self.run_dir = cfg, site, run_dir
        self.devices, self.plan = devices, plan
        self.manager: RolloutManager | None = None
        self.runtime: CellRuntime | None = None  # cells in this process (tiderl.runtime.elastic)
        self.world_rt: Any = None  # cells across processes (tiderl.runtime.worldcells)
        self.pending_start: list[Any] = []  # ranks `run` starts (and its close closes)
        self.site_sync: Any = None
        self.apply_roles: Any = None

    # -- build: the policy, the trainer, its checkpoints -----------------------------------

    def build(self, resume: bool, overrides: list[str] | tuple[str, ...]) -> None:
        cfg = self.cfg
        if cfg.model.vision is not None and self.site.world.size > 1:
            # The config refuses it when --num-processes says so; coordinator=auto learns the
            # count only here. Later every turn and step would refuse the images one by one.
            raise ConfigError(VISION_PROCESSES.format(n=self.site.world.size))
        self.t0 = time.monotonic()
        self.meshes, graphdef, params = build_policy(cfg, self.devices, self.plan)
        log.info("starting: %s × %d devices, policy built (%.1fs)", self.devices[0].platform,
                 len(self.devices), time.monotonic() - self.t0)
        self.tok = load_tokenizer(cfg.model.tokenizer)
        self.template = template_for(self.tok, "auto")
        self.rcfg = rollout_config_for(cfg, self.template)
        ref_mesh = self.meshes["ref"] if self.plan.ref else None
        self.trainer = self.site.trainer(
            trainer_config_for_mode(cfg), cfg.model, actor_mesh=self.meshes["actor"],
            ref_mesh=ref_mesh, temperature=self.rcfg.temperature, seed=cfg.seed,
            policy=(graphdef, params))
        # Cells' syncs (`sync_weights`): device to device; LoRA keeps a base per device.
        self.placer = WeightPlacer(cfg.model, self.trainer.serving_abstract)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints",
                                 keep=cfg.controller.keep_checkpoints)
        self.start_step, self.data_state = 0, {"next_index": 0, "pending": []}
        if resume:
            self._restore(overrides)

    def _restore(self, overrides: list[str] | tuple[str, ...]) -> None:
        run_dir = self.run_dir
        restored = self.ckpt.restore(self.trainer)
        if restored is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {run_dir}/checkpoints;"
                                    " start without --resume")
        self.start_step, self.data_state = restored
        log.info("resuming at step %d, version %d", self.start_step, self.trainer.version)
        if n := trim_metrics(run_dir, self.start_step):
            log.warning("%d metrics records logged after the checkpoint of step %d moved to "
                        "metrics.discarded.jsonl (those steps run again)", n, self.start_step)
        with (run_dir / "resumes.jsonl").open("a") as f:
            f.write(json.dumps({"from_step": self.start_step, "at": time.time(),
                                "overrides": list(overrides)}) + "\n")

    # -- place_ranks: rollout engines on cells, or the site's ranks ------------------------

    async def make_rank(self, rank_id: int, device: Any, weights: Any,
                        version: int) -> RolloutRank:
        # The cast, the weight copy and the engine's setup run off the event loop. Engines
        # serve the weights in the compute dtype (bf16 runs: half the bytes per decode step,
        # same values; serving/weights.py).
        import jax

        cfg, rcfg, trainer = self.cfg, self.rcfg, self.trainer

        def build_engine() -> Engine:
            served = jax.device_put(serving_weights(weights, cfg.model), device)
            return Engine(trainer.serving_graphdef, served, cfg.model, rcfg, seed=cfg.seed,
                          version=version)

        rank = RolloutRank(rank_id, await asyncio.to_thread(build_engine),
                           max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots),
                           share_prefixes=rcfg.share_prefixes)
        await rank.start()
        return rank

    async def place_ranks(self) -> None:
        cfg, plan, trainer = self.cfg, self.plan, self.trainer
        order = "decoupled" if trainer.mode == "decoupled" else "colocated"
        self.batcher = MicroBatcher(cfg, dp_size(self.meshes["actor"]), order)
        colocated = bool({d for r in plan.rollout for d in r} & set(plan.actor))
        self.ers_on, why_off = cfg.ers_enabled(colocated=colocated)
        self.multi = self.site.world.size > 1
        self.runtime = None if colocated or self.multi else cells_for(
            cfg, plan, self.devices, trainer=trainer, batcher=self.batcher,
            make_rank=self.make_rank)
        if self.ers_on and self.runtime is None and not self.multi:
            # nothing to move (the checks above name why)
            self.ers_on, why_off = False, "no cells"
        if self.runtime is not None:
            await self._cell_ranks()
        else:
            why_off = await self._site_ranks(why_off)
        if not self.ers_on:
            log.info("elastic scaling off: %s", why_off)
        self.ranks = [r for r in self.slots if r is not None]
        log.info("starting: trainer and %d rollout rank(s) ready (%.1fs); the first turns and "
                 "the first step compile", len(self.ranks), time.monotonic() - self.t0)

    async def _cell_ranks(self) -> None:
        # Cells: one rank slot per device any cell may serve; slots no rank serves yet are
        # dead in the scheduler. New weights go to every live rank (`sync_weights`).
        runtime, trainer = self.runtime, self.trainer
        assert runtime is not None
        self.apply_roles = runtime.apply_roles
        weights = await asyncio.to_thread(serving_weights, await trainer.export_weights_async(),
                                          self.cfg.model)
        self.cells, self.per_cell = runtime.initial, runtime.layout.ranks_per_cell
        self.slots: list[Any] = [None] * (len(self.cells.roles) * self.per_cell)
        for rank in await runtime.start_ranks(self.cells.cells("rollout"), weights,
                                              trainer.version):
            self.slots[rank.rank_id] = rank

    async def _site_ranks(self, why_off: str) -> str:
        # Engines on each rank's device or tensor-parallel cell; on several processes, remote
        # ranks for the others' (tiderl.runtime.hosts). `sync_weights` moves new weights to
        # all of them. The engines run the trainer's serving layout (per layer under
        # model.scan_layers).
        cfg, site, trainer = self.cfg, self.site, self.trainer
        site_ranks, self.site_sync = await site.ranks(cfg, trainer, trainer.serving_graphdef,
                                                      self.meshes, self.rcfg)
        # A copy: the site's sync keeps its own list (slots is cleared once the manager holds
        # the ranks).
        self.slots, self.pending_start = list(site_ranks), list(site_ranks)
        self.cells = initial_cells([("rollout", len(self.slots)), ("trainer", 1)])
        self.per_cell = 1
        if self.multi and self.ers_on:
            self.world_rt = site.elastic(cfg, self.plan, trainer, self.batcher,
                                         trainer.serving_graphdef, self.rcfg)
            if self.world_rt is None:
                if cfg.controller.ers == "on":
                    raise ConfigError(
                        f"config key 'controller.ers'='on' on {site.world.size} processes needs "
                        "whole cells on every host (rollout.devices_per_rank=1, no trainer."
                        "ref_devices, each host's rollout ranks and trainer devices multiples "
                        "of trainer.fsdp × trainer.model_parallel); fix those or set "
                        "controller.ers=off")
                self.ers_on, why_off = False, "no cells on every host"
        if self.world_rt is not None:
            self._world_slots(site_ranks)
        return why_off

    def _world_slots(self, site_ranks: list[Any]) -> None:
        # Cells across processes (tiderl.runtime.worldcells): a slot per rank id any cell may
        # serve, the site's ranks (own and remote) in theirs.
        world_rt = self.world_rt
        self.cells, self.per_cell = world_rt.initial, world_rt.cells.layout.ranks_per_cell
        self.slots = [None] * (len(self.cells.roles) * self.per_cell)
        for r in site_ranks:
            self.slots[r.rank_id] = r
        want = [c * self.per_cell + j for c in self.cells.cells("rollout")
                for j in range(self.per_cell)]
        if sorted(r.rank_id for r in site_ranks) != want:
            raise RuntimeError(f"rollout ranks {[r.rank_id for r in site_ranks]} do not "
                               f"match the cells' rank slots {want}")
        self.site.live = lambda: [r for r in (self.manager.ranks if self.manager is not None
                                              else ()) if r is not None and r.live]
        self.apply_roles = world_rt.apply_roles

    def scheduler(self) -> Any:
        cfg, rcfg = self.cfg, self.rcfg
        sched_kind = cfg.rollout.scheduler if cfg.controller.mode == "tiderl" else "vanilla"
        # Each engine's own pool (rollout.kv_memory_fraction sizes it from free device memory)
        # and its host KV tier (rollout.host_kv_pages);
        # a rank on another process, or a slot no rank serves yet, is budgeted at the
        # configured rollout.num_pages (a rank that joins later brings its own:
        # RolloutManager.add_rank).
        capacities = [kv_budget_tokens(r.engine.cfg if r is not None and hasattr(r, "engine")
                                       else rcfg) for r in self.slots]
        # Prompts count once per rank only where ranks share them.
        ctb_cfg = dataclasses.replace(
            cfg.rollout.ctb,
            shared_prompts=cfg.rollout.ctb.shared_prompts and rcfg.share_prefixes)
        sched = make_scheduler(sched_kind, ctb_cfg, capacities,
                               max_context=rcfg.max_context, max_tasks_per_rank=rcfg.max_slots,
                               page_size=rcfg.page_size)
        for i, rank in enumerate(self.slots):
            if rank is None:
                sched.remove_rank(i)
        sched.cfg.check_group_size(cfg.env.group_size)
        return sched

    # -- run: the controller, and the close ------------------------------------------------

    async def sync_weights(self, exported: Any, version: int) -> Any:
        if self.runtime is None:
            return await self.site_sync(exported, version)
        trainer = self.trainer
        live = [r for r in (self.manager.ranks if self.manager is not None else self.slots)
                if r is not None and r.live and r.version != version]

        def put() -> tuple[list[Any], Any]:
            # The compute dtype, as make_rank; LoRA: the adapters alone (runtime/parts.py).
            return self.placer(exported, [r.engine.device for r in live])

        # On the trainer's worker thread, one cast and copy after another: all cross-device
        # work is issued from one thread in one order (and off the event loop: env I/O keeps
        # flowing).
        copies, stats = await asyncio.wrap_future(trainer.call(put))
        await asyncio.gather(*(r.update_weights(w, version)
                               for r, w in zip(live, copies, strict=True)))
        return stats.metrics()

    def planner(self) -> Any:
        cfg = self.cfg
        elastic = cfg.controller.elastic
        if self.multi:  # a decoupled Ref would have to reshard across processes: never plan one
            elastic = dataclasses.replace(elastic, max_ref_cells=0)
        planner = make_planner(self.ers_on, elastic, ra2p_live=cfg.controller.mode == "tiderl"
                               and cfg.trainer.mode == "auto")
        if self.ers_on and hasattr(planner, "check"):  # a scripted planner: one role per cell
            planner.check(self.cells, ref_ok=not self.multi)
            for step, roles in planner.steps.items():
                if self.world_rt is not None and (
                        why := self.world_rt.cells.problem(CellMap(roles))):
                    raise ConfigError(f"config key 'controller.elastic.script' step {step}: "
                                      f"{why}; on several processes every process keeps a "
                                      "trainer cell")
        if self.ers_on and self.world_rt is not None:
            from tiderl.runtime.worldcells import KeepTrainerPerProcess

            planner = KeepTrainerPerProcess(planner, self.world_rt.cells)
        return planner

    async def run(self, sched: Any) -> dict:
        from tiderl.runtime.elastic import CompileWatch

        cfg, c = self.cfg, self.cfg.controller
        streams = task_streams(cfg.env, self.data_state)
        checkpoint = self.site.checkpoint(self.trainer, self.ckpt)
        hooks = Hooks(sync_weights=self.sync_weights, make_microbatches=self.batcher,
                      checkpoint=checkpoint, apply_roles=self.apply_roles,
                      compile_stats=CompileWatch.stats)
        planner = self.planner()
        buffer = ReadinessBuffer(groups_per_microbatch=c.groups_per_microbatch,
                                 max_staleness=c.max_staleness,
                                 min_ok_per_group=c.min_ok_per_group,
                                 zero_var=cfg.trainer.zero_var_groups,
                                 adv_eps=cfg.trainer.adv_eps,
                                 step_credit=step_credit(cfg.trainer))
        metrics = MetricsSink(self.run_dir, console=c.console, prometheus_port=c.prometheus_port,
                              prometheus_host=c.prometheus_host,
                              prometheus_token=c.prometheus_token, total_steps=c.steps,
                              loggers=c.loggers, progress_every_s=c.progress_every_s,
                              wandb_project=c.wandb_project, wandb_mode=c.wandb_mode,
                              run_config=to_dict(cfg))
        error: BaseException | None = None
        try:
            for r in self.pending_start:
                await r.start()
            return await self._control(sched, hooks, planner, buffer, metrics, streams)
        except BaseException as e:
            error = e
            raise
        finally:
            metrics.close()
            await self._close(error)

    async def _control(self, sched: Any, hooks: Hooks, planner: Any, buffer: ReadinessBuffer,
                       metrics: MetricsSink, streams: tuple[Any, Any]) -> dict:
        cfg, c, rcfg = self.cfg, self.cfg.controller, self.rcfg
        system = c.system_prompt or suite_system_prompt(cfg.env)
        env_cfg, _ = with_default_token(cfg.env)  # an exposed in-process server gets a token
        async with episode_backend(env_cfg, self.template,
                                   max_action_tokens=rcfg.max_action_tokens,
                                   temperature=rcfg.temperature, system=system) as (env, runner):
            self.manager = RolloutManager(self.slots, sched, env, self.template,
                                          max_turns=cfg.env.max_turns, system=system,
                                          eval_temperature=c.eval_temperature, runner=runner,
                                          images=image_prompt_for(cfg.model),
                                          image_window=cfg.env.image_window,
                                          image_keep=cfg.env.image_keep)
            self.slots.clear()  # the manager holds the ranks now: a drained one is freed
            controller = Controller(
                c, manager=self.manager, trainer=self.trainer, hooks=hooks,
                train_stream=streams[0], eval_groups=streams[1], metrics=metrics,
                buffer=buffer, planner=planner, cells=self.cells, ranks_per_cell=self.per_cell,
                ref_mode=self.trainer.mode, start_step=self.start_step,
                pending=self.data_state.get("pending", []),
                samples=SampleWriter(self.run_dir, self.tok.decode, c.eval_samples),
                advice=starvation_advice(cfg))
            try:
                summary = await controller.run()
            except (StarvedStop, NonFiniteStop) as e:
                # Stopped on purpose: the folder still says why (summary.json) before launch
                # prints the one-line reason.
                summary = {"ended": str(e), **getattr(e, "summary", {})}
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2,
                                                                      default=str))
                raise
            summary["rollout"] = {k: v for k, v in self.manager.stats().items()
                                  if k != "per_rank"}
            self.site.annotate(summary, self.ranks)
        return summary

    async def _close(self, error: BaseException | None) -> None:
        for r in (self.manager.ranks if self.manager is not None else self.slots):
            if r is not None:
                await r.close()
        await self.site.finish(self.trainer, error)  # several processes: theirs end here
        self.ckpt.wait()
        self.ckpt.close()
        self.trainer.close()
        await self.site.leave()


def cells_for(cfg: RunConfig, plan: Any, devices: list, *, trainer: TrainerBackend,
              batcher: MicroBatcher, make_rank: Any) -> CellRuntime | None:
    """The run's cells (None in sync mode, or when the roles are not whole cells: then
    nothing can move and the RA2P mode stays fixed). The caller has ruled out a plan whose
    rollout and training share devices."""
    from tiderl.runtime.elastic import CellRuntime

    if cfg.controller.mode == "sync":
        return None
    if cfg.rollout.devices_per_rank != 1:  # a cell's ranks are one device each
        log.info("no cells: rollout.devices_per_rank=%d (tensor-parallel ranks stay put)",
                 cfg.rollout.devices_per_rank)
        return None
    t = cfg.trainer
    try:
        layout = cell_layout(plan, t.fsdp * t.model_parallel)
    except ConfigError as e:
        log.info("no cells: %s", e)
        return None
    return CellRuntime(layout, devices, trainer=trainer, batcher=batcher, make_rank=make_rank,
                       fsdp=t.fsdp, model_parallel=t.model_parallel)

