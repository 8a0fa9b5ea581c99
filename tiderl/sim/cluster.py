"""A simulated job: the production control plane on cost-model backends at cluster scale.
No JAX.

`simulate_job(SimConfig(...))` builds exactly what `tiderl.runtime.job.run_job` builds — a `Controller`
over a `RolloutManager` of `RolloutRank`s under the CTB (or request-level) scheduler, a
`ReadinessBuffer`, the production micro-batch planner — but with `SimEngine`s, a `SimTrainer`
and a `SimAgentEnv` priced by one `SimCostModel`, and runs it on a virtual-time loop.

Every baseline is a configuration of the same code (the paper's §6 baselines), each modelling
the documented behaviour of its system:

| mode   | scheduler | trainer                                         | devices                        |
| ------ | --------- | ----------------------------------------------- | ------------------------------ |
| sync   | vanilla   | global batch, Ref colocated, aggregated         | all GPUs alternate (hybrid)    |
| async  | vanilla   | global batch, Ref colocated, aggregated         | fixed rollout ratio            |
| stream | vanilla   | streamed, Ref/Actor alternate per micro-batch   | fixed rollout ratio            |
| tiderl | CTB       | streamed, RA2P (aggregated colocated or decoupled) | fixed ratio until ERS plans |

- **sync = VeRL's hybrid engine** (Sheng et al., "HybridFlow", EuroSys'25; VeRL's
  `ActorRolloutRefWorker`): every GPU generates the whole global batch (the step waits for its
  slowest trajectory), then switches to training — the vLLM engine sleeps (weights to host
  memory, KV cache freed), the FSDP Actor and Ref train on all GPUs — and back: the new
  weights are gathered from the FSDP shards into the engine (`SimCostModel.reshard`) and the
  KV pool is re-allocated. Each switch costs what `tiderl.sim.memory.hybrid_switch_bytes`
  says moves over PCIe.
- **async = AReaL** (Fu et al., "AReaL", 2025): rollout and trainer on a fixed split of the
  GPUs; generation never stops for training but runs at most `max_staleness` versions ahead of
  the trainer (its staleness bound: rollout throttles, RWT); a weight update lands mid-rollout
  and the interrupted trajectories continue under the new weights with their KV recomputed
  (partial rollout, as APRIL); the trainer takes a full global batch, Ref then Actor over it.
- **stream = StreamRL** (Zhong et al., "StreamRL", 2025): the same fixed split, but
  trajectories stream to the trainer, which runs each micro-batch as it arrives on the Ref and
  then the Actor, colocated on the trainer's GPUs — an alternation per micro-batch, which
  costs a swap only when Ref and Actor do not both fit a device (`offload="auto"`).
- **tiderl**: CTB on rollout, RA2P on the trainer, ERS moving cells.

Rollout ratios of the fixed-split baselines are swept (`tiderl.sim.experiments fig8`), the best
one taken, as the paper does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
import time
from typing import Any

from tiderl.configlib import ConfigError
from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.config import ControllerConfig
from tiderl.control.controller import Controller, Hooks
from tiderl.control.metrics import MetricsSink
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.sim.clock import CpuMeter, run_virtual
from tiderl.sim.costs import SimCostModel, load_profile, model_shape
from tiderl.sim.envs import IMAGE, SimAgentEnv
from tiderl.sim.run import SeedStream
from tiderl.sim.trainer import SimMicroBatcher, SimTrainer
from tiderl.sim.virtual_engine import SimEngine
from tiderl.sim.virtual_ers import wire
from tiderl.sim.window import WindowedRollout
from tiderl.sim.workloads import Sampler, workload

MODES = ("sync", "async", "stream", "tiderl")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated job: cluster, model, workload, mode and batch shape."""

    mode: str = "tiderl"
    model: str = "qwen2.5-7b"
    profile: str = "h100"
    gpus: int = 32
    rollout_ratio: float = 0.25
    """Share of the GPUs that roll out (async, stream, tiderl); sync uses all of them."""
    gpus_per_rank: int = 1
    """Devices per rollout rank (tensor parallel)."""
    ref_gpus: int = 0
    """tiderl: GPUs of a dedicated Ref (decoupled RA2P), taken from the trainer's; 0: colocated."""
    offload: bool | str = "auto"
    """Colocated Ref and Actor: "auto" moves over PCIe only what does not fit one device
    (`tiderl.sim.memory`: nothing when both fit); True always keeps the idle model in host
    memory; False never does."""
    workloads: tuple[str, ...] = ("webshop", "alfworld")
    steps: int = 100
    groups_per_step: int = 32
    group_size: int = 8
    groups_per_microbatch: int = 2
    min_groups_per_step: int = 0
    """B_min of the elastic batch (`controller.min_groups_per_step`; 0: B_ideal, no early
    steps): a step holding B_min groups stops waiting for stragglers past τ·T_step."""
    max_staleness: int = 1
    eval_every: int = 20
    eval_groups: int = 200
    eval_group_size: int = 4
    """Samples per evaluation group: the paper's step has 200 eval groups of 4 beside 32
    training groups of 8 (arXiv 2608.10402, Table 3). They play only under a sampled
    evaluation (`eval_temperature` > 0); a greedy one plays one task per group."""
    eval_temperature: float = 0.0
    """`controller.eval_temperature`: 0 (greedy, the default) plays 200 evaluation tasks a
    round; > 0 plays `eval_groups × eval_group_size` (the paper's 800)."""
    seed: int = 0
    tokens_per_gpu: int = 16384
    """Trainer micro-batch budget per data-parallel rank (tokens)."""
    max_slots: int = 1024
    """Sequences a rollout rank holds at once (vLLM's max_num_seqs)."""
    prefill_batch: int = 64
    """Most tasks one rank prefills in one engine call (the rest wait for the next step)."""
    vanilla_concurrency: int = 0
    """Request-level baselines: tasks in flight across ranks (0: 1,024 per rank, the
    maximum the paper allows)."""
    env_concurrency: int = 100_000
    kv_tokens: int = 0
    """KV pool per rollout rank in tokens (0: from the profile's HBM, weights and model)."""
    page_size: int = 16
    scheduler: str = ""
    """Override the mode's scheduler ('ctb' or 'vanilla')."""
    drift_steps: int = 100
    time_limit_s: float = 0.0
    charge_cpu: bool = False
    planner: str = ""
    """The scaling planner the controller consults after each update: 'ers' (the production
    ERS planner), `module:Class` (any `tiderl.control.ers` planner), '' keeps the split."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"sim mode {self.mode!r}: use one of {', '.join(MODES)}")
        if not 0 < self.rollout_ratio < 1:
            raise ConfigError("sim rollout_ratio must be in (0, 1)")
        for w in self.workloads:
            workload(w)
        model_shape(self.model)

    @property
    def rollout_gpus(self) -> int:
        if self.mode == "sync":
            return self.gpus
        return max(self.gpus_per_rank, round(self.gpus * self.rollout_ratio))

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.mode == "sync" else self.gpus - self.rollout_gpus

    @property
    def ranks(self) -> int:
        return self.rollout_gpus // self.gpus_per_rank


class _Bytes(ByteTokenizer):
    """The byte tokenizer with a one-pass decode (the simulated env ignores action text)."""

    def decode(self, ids: Any, *, skip_special: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SimSource:
    """Groups of a workload mix (the suite of group k cycles through `workloads`)."""

    def __init__(self, workloads: tuple[str, ...], split: str, *, groups: int,
                 group_size: int):
        self.workloads, self.split = workloads, split
        self.groups, self.group_size = groups, group_size

    def epochs(self, num_epochs: int | None) -> int:
        return 1 if self.split == "eval" else (1 << 40) // self.groups

    def element(self, k: int) -> dict[str, Any]:
        suite = self.workloads[k % len(self.workloads)]
        gid = f"{self.split}/g{k}"
        tasks = [{"task_id": f"{gid}/m{m}", "group_id": gid, "member": m, "split": self.split,
                  "suite": suite} for m in range(self.group_size)]
        return {"group_id": gid, "split": self.split, "suite": suite, "epoch": 0,
                "env_seed": k, "tasks": tasks}


@dataclasses.dataclass
class SimRun:
    """What a simulated job leaves: the summary, every step record, and its parts."""

    cfg: SimConfig
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    controller: Controller
    trainer: SimTrainer
    ranks: list[RolloutRank]
    env: SimAgentEnv
    cpu: CpuMeter
    real_s: float
    process_s: float = 0.0
    """CPU seconds this process spent (the machine may be shared: wall time inflates)."""

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == "step"]


def build_costs(cfg: SimConfig) -> SimCostModel:
    return SimCostModel(load_profile(cfg.profile), model_shape(cfg.model))


def _scheduler(cfg: SimConfig, num_pages: int, n_slots: int, max_context: int) -> Any:
    """The rollout scheduler over `n_slots` rank slots (those past `cfg.ranks` start dead)."""
    kind = cfg.scheduler or ("ctb" if cfg.mode == "tiderl" else "vanilla")
    conc = cfg.vanilla_concurrency or 1024 * cfg.ranks
    ctb = CTBConfig(env_concurrency=cfg.env_concurrency, vanilla_concurrency=conc,
                    w_group=max(32.0, 4.0 * cfg.group_size))
    sched = make_scheduler(kind, ctb, [num_pages * cfg.page_size] * n_slots,
                           max_context=max_context, max_tasks_per_rank=cfg.max_slots)
    for i in range(cfg.ranks, n_slots):
        sched.remove_rank(i)
    ctb.check_group_size(cfg.group_size)
    return sched


def _trainer(cfg: SimConfig, costs: SimCostModel, colocated: bool) -> SimTrainer:
    """The virtual-time trainer: the Actor on the trainer GPUs a decoupled Ref leaves."""
    actor_gpus = cfg.trainer_gpus - (0 if colocated else cfg.ref_gpus)
    if actor_gpus <= 0:
        raise ConfigError(f"sim ref_gpus={cfg.ref_gpus} leaves no trainer GPU of "
                          f"{cfg.trainer_gpus}; lower it or the rollout ratio")
    return SimTrainer(costs, actor_gpus=actor_gpus, ref_gpus=0 if colocated else cfg.ref_gpus,
                      aggregate=cfg.mode != "stream",
                      offload=cfg.offload if cfg.mode != "sync" else False,
                      colocated_rollout=cfg.mode == "sync", tokens_per_gpu=cfg.tokens_per_gpu,
                      rollout_gpus_per_rank=cfg.gpus_per_rank)


def _layout(cfg: SimConfig, costs: SimCostModel, trainer: SimTrainer, batcher: Any,
            new_rank: Any, colocated: bool) -> tuple[dict[str, Any], Any]:
    """The controller's layout arguments and role-change hook (ERS's cells where it runs)."""
    if cfg.mode == "sync":  # every GPU alternates: no split to change
        return {}, None
    return wire(
        planner=cfg.planner, n_cells=cfg.gpus // cfg.gpus_per_rank, rollout_cells=cfg.ranks,
        ref_cells=0 if colocated else cfg.ref_gpus // cfg.gpus_per_rank,
        gpus_per_cell=cfg.gpus_per_rank, actor_gpus=trainer.actor_gpus,
        ref_gpus=0 if colocated else cfg.ref_gpus, trainer=trainer, batcher=batcher,
        new_rank=new_rank,
        join_cost_s=costs.weight_sync(cross_node=False, gpus_per_rank=cfg.gpus_per_rank))


def _image_window(wl: dict[str, Any]) -> tuple[int, int] | None:
    """The job's sliding image window (window, keep), None without one: a mix of windowed
    workloads must agree on it (checked before any rank starts)."""
    windows = {(w.image_window, w.image_keep) for w in wl.values() if w.image_window}
    if not windows:
        return None
    if len(windows) > 1 or any(w.image_tokens and not w.image_window for w in wl.values()):
        raise ConfigError(f"sim workloads {sorted(wl)} mix image windows {sorted(windows)}; "
                          "simulate workloads of one window together")
    return next(iter(windows))


def _manager(window: tuple[int, int] | None, ranks: list, sched: Any, env: Any, tmpl: Any,
             max_turns: int) -> RolloutManager:
    """The rollout loop: with the sliding image window where the workload has one."""
    if window is None:
        return RolloutManager(ranks, sched, env, tmpl, max_turns=max_turns)
    return WindowedRollout(ranks, sched, env, tmpl, max_turns=max_turns, window=window[0],
                           keep=window[1], image_token=ord(IMAGE))


def _stamped_metrics(run_dir: str) -> MetricsSink:
    """The run's metrics sink; each record also says the real and CPU seconds since now."""
    metrics = MetricsSink(run_dir, console=False)
    log, t_real, c_real = metrics.log, time.perf_counter(), time.process_time()

    def stamped(record: dict[str, Any]) -> None:
        log({**record, "real_s": time.perf_counter() - t_real,
             "process_s": time.process_time() - c_real})

    metrics.log = stamped  # type: ignore[method-assign]  # instance-level wrapper
    return metrics


async def _simulate(cfg: SimConfig, run_dir: str) -> dict[str, Any]:
    costs = build_costs(cfg)
    wl = {w: dataclasses.replace(workload(w), drift_steps=cfg.drift_steps)
          for w in cfg.workloads}
    window = _image_window(wl)
    max_context = max(w.max_context for w in wl.values())
    max_turns = max(w.max_turns for w in wl.values())
    sampler = Sampler(wl, seed=cfg.seed)
    tmpl = template_for(_Bytes(), "byte")
    kv = cfg.kv_tokens or costs.kv_capacity_tokens(cfg.gpus_per_rank)
    num_pages = kv // cfg.page_size
    # GUI workloads: screenshots are image-token runs (the vision tower's, if the model has one)
    image_token = ord(IMAGE) if any(w.image_tokens for w in wl.values()) else None

    def make_engine() -> SimEngine:
        return SimEngine(seed=cfg.seed, max_action_tokens=max_context, max_context=max_context,
                         stop_tokens=tuple(sorted(tmpl.stop_ids)), costs=costs,
                         num_pages=num_pages, page_size=cfg.page_size,
                         max_slots=cfg.max_slots, actions=sampler, gpus=cfg.gpus_per_rank,
                         image_token=image_token)

    made: list[RolloutRank] = []

    async def new_rank(rank_id: int, weights: Any = None, version: int = 0) -> RolloutRank:
        eng = make_engine()
        if version:
            eng.update_weights(weights, version=version)
        rank = RolloutRank(rank_id, eng, max_prefills_per_step=min(cfg.prefill_batch,
                                                                   cfg.max_slots))
        await rank.start()
        made.append(rank)
        return rank

    # With ERS every cell has a rank slot (slot = cell id); cells outside rollout start dead.
    elastic = cfg.mode != "sync"
    n_slots = cfg.gpus // cfg.gpus_per_rank if elastic else cfg.ranks
    sched = _scheduler(cfg, num_pages, n_slots, max_context)
    colocated = cfg.mode in ("sync", "async", "stream") or not cfg.ref_gpus
    trainer = _trainer(cfg, costs, colocated)
    try:  # from here the ranks that start are closed however the run ends
        actor_gpus = trainer.actor_gpus
        env = SimAgentEnv(sampler, step_of=lambda: trainer.version)
        # Rollout and trainer on different nodes unless the job fits one node (or alternates).
        per_node = costs.profile.device.gpus_per_node if costs.profile.device else cfg.gpus
        cross = cfg.mode != "sync" and cfg.gpus > per_node

        async def sync_weights(weights: Any, version: int) -> None:
            # sync (hybrid engine): every device gathers the full weights from the FSDP shards;
            # else a broadcast from the trainer to the rollout ranks.
            await asyncio.sleep(costs.reshard(cfg.gpus) if cfg.mode == "sync" else
                                costs.weight_sync(cross_node=cross,
                                                  gpus_per_rank=cfg.gpus_per_rank))
            await asyncio.gather(*(r.update_weights(weights, version) for r in manager.ranks
                                   if r is not None))

        order = "colocated" if colocated else "decoupled"
        batcher = SimMicroBatcher(n_ranks=actor_gpus, rank_budget=cfg.tokens_per_gpu,
                                  order=order, image_token=image_token)
        layout, apply_roles = _layout(cfg, costs, trainer, batcher, new_rank, colocated)
        ccfg = ControllerConfig(mode=cfg.mode, steps=cfg.steps,
                                groups_per_step=cfg.groups_per_step,
                                groups_per_microbatch=cfg.groups_per_microbatch,
                                max_staleness=cfg.max_staleness, eval_every=cfg.eval_every,
                                console=False, checkpoint_every=0, min_ok_per_group=1,
                                min_groups_per_step=cfg.min_groups_per_step,
                                eval_temperature=cfg.eval_temperature,
                                time_limit_s=cfg.time_limit_s)
        train = SeedStream(SimSource(cfg.workloads, "train", groups=1 << 20,
                                     group_size=cfg.group_size))
        evals = SimSource(cfg.workloads, "eval", groups=max(1, cfg.eval_groups),
                          group_size=cfg.eval_group_size)
        ranks: list[RolloutRank | None] = [await new_rank(i) for i in range(cfg.ranks)]
        ranks += [None] * (n_slots - cfg.ranks)
        manager = _manager(window, ranks, sched, env, tmpl, max_turns)
        metrics = _stamped_metrics(run_dir)
        controller = Controller(
            ccfg, manager=manager, trainer=trainer,
            hooks=Hooks(sync_weights=sync_weights, make_microbatches=batcher,
                        **({"apply_roles": apply_roles} if apply_roles else {})),
            train_stream=train,
            eval_groups=([evals.element(k) for k in range(cfg.eval_groups)]
                         if cfg.eval_every else []),
            metrics=metrics,
            buffer=ReadinessBuffer(groups_per_microbatch=cfg.groups_per_microbatch,
                                   max_staleness=cfg.max_staleness, min_ok_per_group=1,
                                   zero_var="keep"),
            **layout)
        summary = await controller.run()
    finally:
        trainer.close()
        for r in made:
            await r.close()
    summary["rollout"] = {k: v for k, v in manager.stats().items() if k != "per_rank"}
    return {"summary": summary, "records": list(metrics.records), "controller": controller,
            "trainer": trainer, "ranks": made, "env": env}


def simulate_job(cfg: SimConfig, *, run_dir: str | None = None) -> SimRun:
    """Runs `cfg` on virtual time; returns its `SimRun` (seconds in records are virtual)."""
    meter = CpuMeter()
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_virtual(_simulate(cfg, run_dir or tmp), charge_cpu=cfg.charge_cpu,
                          meter=meter)
    return SimRun(cfg=cfg, summary=out["summary"], records=out["records"],
                  controller=out["controller"], trainer=out["trainer"], ranks=out["ranks"],
                  env=out["env"], cpu=meter, real_s=time.perf_counter() - t0,
                  process_s=time.process_time() - c0)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
