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
from typing import Any

import jax

from tiderl.config import RunConfig
from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.controller import Controller, Hooks
from tiderl.control.ers import Roles
from tiderl.control.metrics import MetricsSink
from tiderl.envs.client import EnvClient
from tiderl.envs.server import endpoint
from tiderl.envs.tasks import TaskSource, TaskStream
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import load_tokenizer
from tiderl.serving.ctb import make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.train.backend import TrainerBackend
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.dispatch import microbatches
from tiderl.train.ref_actor import dp_size

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


async def run_job(cfg: RunConfig, *, resume: bool = False,
                  overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Runs the configured job to the end; returns the final summary.

    A new run writes its resolved `config.yaml`; a resumed one keeps it and appends the
    `overrides` it was resumed with to `resumes.jsonl`."""
    from tiderl.launch import build

    run_dir = Path(cfg.run_dir)
    if not resume:
        set_aside_previous_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    devices, plan, meshes, graphdef, params = build(cfg)
    tok = load_tokenizer(cfg.model.tokenizer)
    template = template_for(tok, "auto")
    rcfg = rollout_config_for(cfg, template)
    tcfg = trainer_config_for_mode(cfg)
    ref_mesh = meshes["ref"] if plan.ref else None
    trainer = TrainerBackend(tcfg, cfg.model, actor_mesh=meshes["actor"], ref_mesh=ref_mesh,
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
    rank_devices = [devices[r[0]] for r in plan.rollout]
    weights = await trainer.export_weights_async()
    engines = [Engine(trainer.serving_graphdef, jax.device_put(weights, d), cfg.model, rcfg,
                      seed=cfg.seed, version=trainer.version) for d in rank_devices]
    ranks = [RolloutRank(i, e, max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots))
             for i, e in enumerate(engines)]
    sched_kind = cfg.rollout.scheduler if cfg.controller.mode == "tiderl" else "vanilla"
    capacity = rcfg.num_pages * rcfg.page_size
    sched = make_scheduler(sched_kind, cfg.rollout.ctb, [capacity] * len(ranks),
                           max_context=rcfg.max_context, max_tasks_per_rank=rcfg.max_slots)
    sched.cfg.check_group_size(cfg.env.group_size)

    async def sync_weights(exported: Any, version: int) -> None:
        async def one(rank: RolloutRank, device: Any) -> None:
            # The copy runs off the event loop: env I/O keeps flowing during a sync.
            await rank.update_weights(await asyncio.to_thread(jax.device_put, exported, device),
                                      version)

        await asyncio.gather(*(one(r, d) for r, d in zip(ranks, rank_devices, strict=True)))

    train_stream = TaskStream(TaskSource.from_config(cfg.env, "train"))
    train_stream.set_state({"next_index": int(data_state.get("next_index", 0))})
    eval_src = TaskSource.from_config(cfg.env, "eval")
    eval_groups = [eval_src.element(k) for k in range(eval_src.groups)]  # env.eval_groups

    async def checkpoint(step: int, state: dict) -> None:
        # On the trainer's worker thread: the save's device→host copy (and a swap back from
        # host memory) must neither block the event loop nor race the trainer's own work.
        await asyncio.wrap_future(trainer.call(lambda: ckpt.save(trainer, data_state=state)))

    order = "decoupled" if trainer.mode == "decoupled" else "colocated"
    hooks = Hooks(sync_weights=sync_weights,
                  make_microbatches=MicroBatcher(cfg, dp_size(meshes["actor"]), order),
                  checkpoint=checkpoint)
    buffer = ReadinessBuffer(groups_per_microbatch=cfg.controller.groups_per_microbatch,
                             max_staleness=cfg.controller.max_staleness,
                             min_ok_per_group=cfg.controller.min_ok_per_group,
                             zero_var=cfg.trainer.zero_var_groups, adv_eps=cfg.trainer.adv_eps)
    metrics = MetricsSink(run_dir, console=cfg.controller.console,
                          prometheus_port=cfg.controller.prometheus_port,
                          total_steps=cfg.controller.steps)
    summary: dict = {}
    try:
        for r in ranks:
            await r.start()
        async with endpoint(cfg.env) as url, EnvClient(url, cfg.env) as env:
            manager = RolloutManager(ranks, sched, env, template,
                                     max_turns=cfg.env.max_turns,
                                     system=cfg.controller.system_prompt or None,
                                     eval_temperature=cfg.controller.eval_temperature)
            controller = Controller(
                cfg.controller, manager=manager, trainer=trainer, hooks=hooks,
                train_stream=train_stream, eval_groups=eval_groups, metrics=metrics,
                buffer=buffer, roles=Roles(len(ranks), len(plan.actor), len(plan.ref)),
                start_step=start_step, pending=data_state.get("pending", []))
            summary = await controller.run()
            summary["rollout"] = {k: v for k, v in manager.stats().items() if k != "per_rank"}
    finally:
        metrics.close()
        for r in ranks:
            await r.close()
        ckpt.wait()
        ckpt.close()
        trainer.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary.get("steps"):
        from tiderl.report import write_plots

        summary["plots"] = [str(p) for p in write_plots(run_dir)]
    return summary
