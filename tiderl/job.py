"""Builds one run from a RunConfig — engines, rollout ranks, trainer backend, env endpoint, task
streams, checkpoints — and runs the controller. The JAX side of `python -m tiderl.launch`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.agents.runner import episode_backend
from tiderl.cluster import cell_layout
from tiderl.config import RunConfig
from tiderl.configlib import ConfigError, to_dict
from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.controller import Controller, Hooks, NonFiniteStop, StarvedStop
from tiderl.control.ers import CellMap, initial_cells, make_planner
from tiderl.control.metrics import MetricsSink
from tiderl.control.progress import starvation_advice
from tiderl.control.samples import SampleWriter
from tiderl.data import task_streams
from tiderl.envs.config import with_default_token
from tiderl.envs.health import env_url_error
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import load_tokenizer
from tiderl.serving.ctb import make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.serving.weights import serving_weights
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.dispatch import microbatches
from tiderl.train.ref_actor import dp_size

if TYPE_CHECKING:
    from tiderl.elastic import CellRuntime
    from tiderl.train.backend import TrainerBackend

log = logging.getLogger(__name__)


def trainer_config_for_mode(cfg: RunConfig):
    """The baselines' trainer settings: stream alternates Ref/Actor per micro-batch,
    async and sync aggregate a whole global batch, tiderl lets RA2P decide."""
    t = cfg.trainer
    mode = cfg.controller.mode
    if mode == "stream":
        return dataclasses.replace(t, aggregate=False)
    return t


def rollout_config_for(cfg: RunConfig, template: Any):
    """The engines' rollout config: `rollout.stop_tokens` are extra stop ids, added to the turn
    template's own (which always end an action)."""
    stops = set(cfg.rollout.stop_tokens) | set(template.stop_ids)
    return dataclasses.replace(cfg.rollout, stop_tokens=tuple(sorted(stops)))


class MicroBatcher:
    """Packs ready sequences; what does not fill a micro-batch waits for the next call."""

    def __init__(self, cfg: RunConfig, n_ranks: int, order: str):
        # ERS changes `n_ranks` (the Actor's data-parallel width) and `order` between steps,
        # when nothing waits here (a step's last call packs everything).
        self.cfg, self.n_ranks, self.order = cfg, n_ranks, order
        self.waiting: list[Any] = []

    def __call__(self, seqs: list[Any], final: bool) -> list[Any]:
        t = self.cfg.trainer
        mbs, self.waiting = microbatches(self.waiting + list(seqs), n_ranks=self.n_ranks,
                                         row_len=t.row_len, rows_per_rank=t.rows_per_rank,
                                         order=self.order, balance=t.balance, final=final)
        return mbs


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


async def local_ranks(cfg: RunConfig, trainer: Any, graphdef: Any, meshes: dict,
                      rcfg: Any) -> tuple[list[RolloutRank], Any]:
    """One process's rollout ranks, an engine each on its device or tensor-parallel cell
    (`rollout.devices_per_rank`), and the sync hook: one trainer replica resharded into each
    rank's layout device to device (`tiderl.weightsync`), off the event loop so env I/O keeps
    flowing; it returns the sync's bytes and GB/s for the step's record."""
    from tiderl.weightsync import local_replica, put_local, rank_shardings

    targets = [rank_shardings(trainer.serving_abstract, m) for m in meshes["rollout"]]
    # Engines serve the weights in the compute dtype (bf16 runs: half the bytes per decode
    # step, same values; serving/weights.py); the cast runs off the event loop too.
    def place(exported: Any) -> Any:
        return put_local(local_replica(serving_weights(exported, cfg.model)), targets)

    first, _ = await asyncio.to_thread(place, await trainer.export_weights_async())
    engines = [Engine(graphdef, w, cfg.model, rcfg, seed=cfg.seed, version=trainer.version)
               for w in first]
    ranks = [RolloutRank(i, e, max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots),
                         share_prefixes=rcfg.share_prefixes)
             for i, e in enumerate(engines)]

    async def sync_weights(exported: Any, version: int) -> dict:
        trees, stats = await asyncio.to_thread(place, exported)
        await asyncio.gather(*(r.update_weights(t, version)
                               for r, t in zip(ranks, trees, strict=True)))
        return stats.metrics()

    return ranks, sync_weights


async def run_job(cfg: RunConfig, *, resume: bool = False,
                  overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Runs the configured job to the end; returns the final summary.

    A new run writes its resolved `config.yaml`; a resumed one keeps it and appends the
    `overrides` it was resumed with to `resumes.jsonl`."""
    from tiderl.hosts import site_for
    from tiderl.launch import build

    site = site_for(cfg)  # this process alone, or process 0 of several (tiderl.hosts)
    if site.follower:  # another process of a multi-host world: its host agent, to the end
        return await site.follow(resume)
    if why := await asyncio.to_thread(env_url_error, cfg.env):  # before any device work
        raise ConfigError(why)
    run_dir = Path(cfg.run_dir)
    if not resume:
        set_aside_previous_run(run_dir)
    # Blocking file work is fine here: nothing else runs on the loop before the job starts.
    run_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
    if not resume:
        (run_dir / "config.yaml").write_text(site.config_yaml(cfg))
    await site.ready()
    t0 = time.monotonic()
    devices, plan, meshes, graphdef, params = build(cfg)  # bad device plans fail in here, first
    log.info("starting: %s × %d devices, policy built (%.1fs)", devices[0].platform,
             len(devices), time.monotonic() - t0)
    tok = load_tokenizer(cfg.model.tokenizer)
    template = template_for(tok, "auto")
    rcfg = rollout_config_for(cfg, template)
    tcfg = trainer_config_for_mode(cfg)
    ref_mesh = meshes["ref"] if plan.ref else None
    trainer = site.trainer(tcfg, cfg.model, actor_mesh=meshes["actor"], ref_mesh=ref_mesh,
                           temperature=rcfg.temperature, seed=cfg.seed,
                           policy=(graphdef, params))
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.controller.keep_checkpoints)
    start_step, data_state = 0, {"next_index": 0, "pending": []}
    if resume:
        restored = ckpt.restore(trainer)
        if restored is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {run_dir}/checkpoints;"
                                    " start without --resume")
        start_step, data_state = restored
        log.info("resuming at step %d, version %d", start_step, trainer.version)
        if n := trim_metrics(run_dir, start_step):
            log.warning("%d metrics records logged after the checkpoint of step %d moved to "
                        "metrics.discarded.jsonl (those steps run again)", n, start_step)
        with (run_dir / "resumes.jsonl").open("a") as f:
            f.write(json.dumps({"from_step": start_step, "at": time.time(),
                                "overrides": list(overrides)}) + "\n")

    async def make_rank(rank_id: int, device: Any, weights: Any, version: int) -> RolloutRank:
        # The cast, the weight copy and the engine's setup run off the event loop. Engines
        # serve the weights in the compute dtype (bf16 runs: half the bytes per decode step,
        # same values; serving/weights.py).
        import jax

        def build_engine() -> Engine:
            served = jax.device_put(serving_weights(weights, cfg.model), device)
            return Engine(trainer.serving_graphdef, served, cfg.model, rcfg, seed=cfg.seed,
                          version=version)

        rank = RolloutRank(rank_id, await asyncio.to_thread(build_engine),
                           max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots),
                           share_prefixes=rcfg.share_prefixes)
        await rank.start()
        return rank

    order = "decoupled" if trainer.mode == "decoupled" else "colocated"
    batcher = MicroBatcher(cfg, dp_size(meshes["actor"]), order)
    colocated = bool({d for r in plan.rollout for d in r} & set(plan.actor))
    ers_on, why_off = cfg.ers_enabled(colocated=colocated)
    multi = site.world.size > 1
    runtime = None if colocated or multi else cells_for(
        cfg, plan, devices, trainer=trainer, batcher=batcher, make_rank=make_rank)
    if ers_on and runtime is None and not multi:  # nothing to move (the checks above name why)
        ers_on, why_off = False, "no cells"
    apply_roles = runtime.apply_roles if runtime is not None else None
    world_rt = None  # cells across processes (tiderl.worldcells), set below
    pending_start: list[Any] = []  # ranks started inside the try below (closed by its finally)
    if runtime is not None:
        # Cells: one rank slot per device any cell may serve; slots no rank serves yet are
        # dead in the scheduler. New weights go to every live rank (`sync_weights` below).
        weights = await asyncio.to_thread(serving_weights, await trainer.export_weights_async(),
                                          cfg.model)
        cells, per_cell = runtime.initial, runtime.layout.ranks_per_cell
        slots: list[Any] = [None] * (len(cells.roles) * per_cell)
        for rank in await runtime.start_ranks(cells.cells("rollout"), weights, trainer.version):
            slots[rank.rank_id] = rank
        del weights
    else:
        # Engines on each rank's device or tensor-parallel cell; on several processes, remote
        # ranks for the others' (tiderl.hosts). `sync_weights` moves new weights to all of them.
        # The engines run the trainer's serving layout (per layer under model.scan_layers).
        site_ranks, site_sync = await site.ranks(cfg, trainer, trainer.serving_graphdef, meshes,
                                                 rcfg)
        # A copy: the site's sync keeps its own list (slots is cleared once the manager holds
        # the ranks).
        slots, pending_start = list(site_ranks), list(site_ranks)
        cells, per_cell = initial_cells([("rollout", len(slots)), ("trainer", 1)]), 1
        world_rt = site.elastic(cfg, plan, trainer, batcher, trainer.serving_graphdef,
                                rcfg) if multi and ers_on else None
        if multi and ers_on and world_rt is None:
            if cfg.controller.ers == "on":
                raise ConfigError(
                    f"config key 'controller.ers'='on' on {site.world.size} processes needs "
                    "whole cells on every host (rollout.devices_per_rank=1, no trainer."
                    "ref_devices, each host's rollout ranks and trainer devices multiples of "
                    "trainer.fsdp × trainer.model_parallel); fix those or set controller.ers=off")
            ers_on, why_off = False, "no cells on every host"
        if world_rt is not None:
            # Cells across processes (tiderl.worldcells): a slot per rank id any cell may
            # serve, the site's ranks (own and remote) in theirs.
            cells, per_cell = world_rt.initial, world_rt.cells.layout.ranks_per_cell
            slots = [None] * (len(cells.roles) * per_cell)
            for r in site_ranks:
                slots[r.rank_id] = r
            want = [c * per_cell + j for c in cells.cells("rollout") for j in range(per_cell)]
            if sorted(r.rank_id for r in site_ranks) != want:
                raise RuntimeError(f"rollout ranks {[r.rank_id for r in site_ranks]} do not "
                                   f"match the cells' rank slots {want}")
            site.live = lambda: [r for r in (manager.ranks if manager is not None else ())
                                 if r is not None and r.live]
            apply_roles = world_rt.apply_roles
    if not ers_on:
        log.info("elastic scaling off: %s", why_off)
    ranks = [r for r in slots if r is not None]
    log.info("starting: trainer and %d rollout rank(s) ready (%.1fs); the first turns and the "
             "first step compile", len(ranks), time.monotonic() - t0)
    sched_kind = cfg.rollout.scheduler if cfg.controller.mode == "tiderl" else "vanilla"
    # Each engine's own pool (rollout.kv_memory_fraction sizes it from free device memory); a
    # rank on another process, or a slot no rank serves yet, is budgeted at the configured
    # rollout.num_pages (a rank that joins later brings its own: RolloutManager.add_rank).
    capacities = [(r.engine.cfg if r is not None and hasattr(r, "engine") else rcfg).num_pages
                  * rcfg.page_size for r in slots]
    # Prompts count once per rank only where ranks share them.
    ctb_cfg = dataclasses.replace(
        cfg.rollout.ctb, shared_prompts=cfg.rollout.ctb.shared_prompts and rcfg.share_prefixes)
    sched = make_scheduler(sched_kind, ctb_cfg, capacities,
                           max_context=rcfg.max_context, max_tasks_per_rank=rcfg.max_slots,
                           page_size=rcfg.page_size)
    for i, rank in enumerate(slots):
        if rank is None:
            sched.remove_rank(i)
    sched.cfg.check_group_size(cfg.env.group_size)
    manager: RolloutManager | None = None

    async def sync_weights(exported: Any, version: int) -> Any:
        if runtime is None:
            return await site_sync(exported, version)
        import jax

        live = [r for r in (manager.ranks if manager is not None else slots)
                if r is not None and r.live and r.version != version]

        def put() -> list[Any]:
            served = serving_weights(exported, cfg.model)  # the compute dtype, as make_rank
            return [jax.device_put(served, r.engine.device) for r in live]

        # On the trainer's worker thread, one cast and copy after another: all cross-device
        # work is issued from one thread in one order (and off the event loop: env I/O keeps
        # flowing).
        copies = await asyncio.wrap_future(trainer.call(put))
        await asyncio.gather(*(r.update_weights(w, version)
                               for r, w in zip(live, copies, strict=True)))
        return None

    train_stream, eval_groups = task_streams(cfg.env, data_state)

    checkpoint = site.checkpoint(trainer, ckpt)

    from tiderl.elastic import CompileWatch

    hooks = Hooks(sync_weights=sync_weights, make_microbatches=batcher, checkpoint=checkpoint,
                  apply_roles=apply_roles, compile_stats=CompileWatch.stats)
    elastic = cfg.controller.elastic
    if multi:  # a decoupled Ref would have to reshard across processes: never plan one
        elastic = dataclasses.replace(elastic, max_ref_cells=0)
    planner = make_planner(ers_on, elastic,
                           ra2p_live=cfg.controller.mode == "tiderl" and cfg.trainer.mode == "auto")
    if ers_on and hasattr(planner, "check"):  # a scripted planner: one role per cell
        planner.check(cells, ref_ok=not multi)
        for step, roles in planner.steps.items():
            if world_rt is not None and (why := world_rt.cells.problem(CellMap(roles))):
                raise ConfigError(f"config key 'controller.elastic.script' step {step}: "
                                  f"{why}; on several processes every process keeps a "
                                  "trainer cell")
    if ers_on and world_rt is not None:
        from tiderl.worldcells import KeepTrainerPerProcess

        planner = KeepTrainerPerProcess(planner, world_rt.cells)
    buffer = ReadinessBuffer(groups_per_microbatch=cfg.controller.groups_per_microbatch,
                             max_staleness=cfg.controller.max_staleness,
                             min_ok_per_group=cfg.controller.min_ok_per_group,
                             zero_var=cfg.trainer.zero_var_groups, adv_eps=cfg.trainer.adv_eps)
    c = cfg.controller
    metrics = MetricsSink(run_dir, console=c.console, prometheus_port=c.prometheus_port,
                          prometheus_host=c.prometheus_host, prometheus_token=c.prometheus_token,
                          total_steps=c.steps, loggers=c.loggers,
                          progress_every_s=c.progress_every_s, wandb_project=c.wandb_project,
                          wandb_mode=c.wandb_mode, run_config=to_dict(cfg))
    summary: dict = {}
    try:
        for r in pending_start:
            await r.start()
        system = cfg.controller.system_prompt or None
        env_cfg, _ = with_default_token(cfg.env)  # an exposed in-process server gets a token
        async with episode_backend(env_cfg, template, max_action_tokens=rcfg.max_action_tokens,
                                   temperature=rcfg.temperature, system=system) as (env, runner):
            manager = RolloutManager(slots, sched, env, template,
                                     max_turns=cfg.env.max_turns, system=system,
                                     eval_temperature=cfg.controller.eval_temperature,
                                     runner=runner)
            slots.clear()  # the manager holds the ranks now: a drained one is freed
            controller = Controller(
                cfg.controller, manager=manager, trainer=trainer, hooks=hooks,
                train_stream=train_stream, eval_groups=eval_groups, metrics=metrics,
                buffer=buffer, planner=planner, cells=cells, ranks_per_cell=per_cell,
                ref_mode=trainer.mode, start_step=start_step,
                pending=data_state.get("pending", []),
                samples=SampleWriter(run_dir, tok.decode, c.eval_samples),
                advice=starvation_advice(cfg))
            try:
                summary = await controller.run()
            except (StarvedStop, NonFiniteStop) as e:
                # Stopped on purpose: the folder still says why (summary.json) before launch
                # prints the one-line reason.
                summary = {"ended": str(e), **getattr(e, "summary", {})}
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=2,
                                                                 default=str))
                raise
            summary["rollout"] = {k: v for k, v in manager.stats().items() if k != "per_rank"}
            site.annotate(summary, ranks)
    finally:
        metrics.close()
        for r in (manager.ranks if manager is not None else slots):
            if r is not None:
                await r.close()
        await site.finish(trainer, sys.exc_info()[1])  # several processes: theirs end here
        ckpt.wait()
        ckpt.close()
        trainer.close()
        await site.leave()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary.get("steps"):
        from tiderl.report import write_plots, write_report

        plots = write_plots(run_dir)
        summary["plots"] = [str(p) for p in plots]
        summary["report"] = str(write_report(run_dir, plots))
    return summary


def cells_for(cfg: RunConfig, plan: Any, devices: list, *, trainer: TrainerBackend,
              batcher: MicroBatcher, make_rank: Any) -> CellRuntime | None:
    """The run's cells (None in sync mode, or when the roles are not whole cells: then
    nothing can move and the RA2P mode stays fixed). The caller has ruled out a plan whose
    rollout and training share devices."""
    from tiderl.elastic import CellRuntime

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

