"""`python -m tiderl.sim.validate`: the same job for real on this CPU and in the simulator with
the `cpu-fitted` profile, for all four modes and several seeds, compared step by step.

The job is the embedded default (the default task, the tiny policy trained from scratch) with
the overrides of `tiderl.sim.calibrate.VALIDATION_OVERRIDES` (a Ref phase, a heavy-tailed
environment). Real runs go through `tiderl.runtime.job.run_job`, modes interleaved and rotated per seed
(machine load drifts hit every mode alike), after one untimed warm-up run per mode (JIT
compilation is not modelled). Simulated runs build the same controller, scheduler, ranks,
buffer and micro-batch planner from the same `RunConfig`, over `SimEngine`, `SimTrainer` and
the default task's adapter with the server's injected latencies (same seeds, same delays).

Compared per mode (medians over seeds): goodput, mean step time, RWT, TWT, KV hit rate,
prefill tokens computed (which include recomputation) and the engines' device rounds and
their mean time, and per step the step time's error.
Acceptance: simulated goodput within 15% of real for every mode, and the same ranking of modes
(`same_ranking`; `same_ranking_resolved` checks only the pairs of modes the real runs order:
their per-seed goodputs do not overlap, or, paired by seed (each seed plays the same tasks and
environment latencies in every mode), a paired t-test puts one above the other at the 5%
level; `unresolved_pairs` names the others, `overlapping_pairs` the pairs whose ranges
overlap).
The machine's speed drifts (a shared VM), so each real run is bracketed by the speed probe
(`tiderl.sim.speed`, `probe_s` in the saved run) and the simulated side is priced by the
profile scaled by the runs' median probe over the calibration's (`speed_factor` in the
output; `--no-speed` leaves the profile as fitted; runs or profiles without a probe are not
scaled).
With `--calibrate` the profile is refitted first, under the machine's current load, and
the engine's lock wait in the job measured (`--measure-lock-wait` alone: `measure_lock_wait`). The last
stdout line is one JSON object (`max_goodput_rel_error`, `same_ranking`, ...).

The real run's parts share this machine's cores (engine, trainer, env server and controller):
the simulator models that as processor sharing on one host (`tiderl.sim.host`), the env
calls' client and server work as time held on the event loop (`tiderl.sim.hostcost`), and the
control plane's own CPU as measured; what it leaves out shows as error here. The `served` job
runs the env server in a process of its own (`tiderl.sim.served`), as a deployed environment
runs: the loop then holds only the client's half of each call, and the server's half is work
on the shared host, one call at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.configlib import ConfigError
from tiderl.sim.calibrate import VALIDATION_OVERRIDES
from tiderl.sim.clock import CpuMeter, run_virtual
from tiderl.sim.costs import PROFILES, SimCostModel, load_profile, model_shape
from tiderl.sim.speed import speed_factor

MODES = ("sync", "async", "stream", "tiderl")
METRICS = ("goodput", "step_time_s", "rwt_s", "twt_s", "kv_hit_rate", "prefill_computed",
           "engine_steps", "engine_round_ms")
"""Compared per mode; `engine_steps` (the ranks' device rounds) and `engine_round_ms` (their
mean time on the loop's clock: the device work, its wait for the interpreter lock and, in
the real job, the loop's delay in taking the result) are missing (nan) from runs recorded
before the step records carried them."""


@dataclasses.dataclass(frozen=True)
class Job:
    """A validation job: overrides on top of `VALIDATION_OVERRIDES`, and where its env server
    runs."""

    overrides: tuple[str, ...] = ()
    served: bool = False
    """The env server in a process of its own (`tiderl.sim.served`), as a deployed environment
    runs, instead of on the job's event loop; the simulator then charges the loop only the
    client's half of each call and the server's half to the host (`tiderl.sim.envs`)."""


# Where the modes differ: the KV pool holds 96 pages of 16 tokens (1,536 tokens) against 64
# tasks of up to 128 tokens in flight (two steps of 8 groups of 8 under the staleness bound),
# so the request-level scheduler evicts and recomputes where CTB pauses and parks; 8 groups a
# step in micro-batches of one group, so several micro-batches are ready at once (tiderl's
# trainer aggregates them, stream's alternates per micro-batch); and environment latency at a
# tenth of the default's scale (2 ms), so the engine, not the environment, sets the pace
# (engines busy 72-84% simulated; at the default scale stream and tiderl simulated within the
# seeds' spread).
_PRESSURE = ("controller.groups_per_step=8", "controller.groups_per_microbatch=1",
             "rollout.num_pages=96", "env.latency.scale_s=0.002")
JOBS: dict[str, Job] = {
    "default": Job(),
    "pressure": Job(_PRESSURE),
    # The pressure job with its env served by another process: the job's one interpreter no
    # longer runs the server's half of every env call (in the pressure job it is ~half of the
    # loop's ~1 ms per call, thousands of calls a run), so the modes' differences come from
    # scheduling more than from that interpreter's contention.
    "served": Job(_PRESSURE, served=True),
}
"""Validation jobs (`--job`)."""


def run_config(mode: str, steps: int, seed: int, run_dir: str, job: str = "default") -> Any:
    from tiderl.config import load_config

    if job not in JOBS:
        raise ValueError(f"validation job {job!r} is unknown; use one of {', '.join(JOBS)}")
    return load_config(None, [*VALIDATION_OVERRIDES, *JOBS[job].overrides,
                              f"controller.mode={mode}",
                              f"controller.steps={steps}", f"seed={seed}",
                              f"env.latency.seed={seed}", f"run_dir={run_dir}",
                              "controller.time_limit_s=0"])


def server_overrides(seed: int, job: str) -> list[str] | None:
    """The env server's own overrides (its `EnvConfig`'s: latency and seed) when `job` serves
    its env in another process; None when the job serves it in-process."""
    if not JOBS[job].served:
        return None
    return [o.removeprefix("env.") for o in (*VALIDATION_OVERRIDES, *JOBS[job].overrides,
                                             f"env.latency.seed={seed}")
            if o.startswith("env.")]


# -- the simulated twin of tiderl.runtime.job.run_job -------------------------------------------------
async def _simulate(cfg: Any, costs: SimCostModel, run_dir: str,
                    trace: dict[tuple[str, int], str] | None = None,
                    served: bool = False) -> dict[str, Any]:
    from tiderl.control.buffer import ReadinessBuffer
    from tiderl.control.controller import Controller, Hooks
    from tiderl.control.metrics import MetricsSink
    from tiderl.envs.tasks import TaskSource
    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import load_tokenizer
    from tiderl.serving.ctb import make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager
    from tiderl.sim.envs import SimSuiteEnv
    from tiderl.sim.host import SharedHost
    from tiderl.sim.run import SeedStream
    from tiderl.sim.trainer import SimMicroBatcher, SimTrainer
    from tiderl.sim.virtual_engine import DigitActions, SimEngine
    from tiderl.sim.virtual_ers import wire

    r, t, c = cfg.rollout, cfg.trainer, cfg.controller
    # The engines' steps and the trainer's phases share the host. The control plane's CPU
    # time is charged by the virtual loop instead (it blocks the loop, as the real event loop
    # does), not as work on this host: what it measures includes the simulated backends' own
    # bookkeeping (this host's rate updates among it), which would slow the device work it
    # models.
    host = SharedHost(**costs.profile.host) if costs.profile.host else None
    template = template_for(load_tokenizer(cfg.model.tokenizer), "auto")
    stops = tuple(sorted(set(r.stop_tokens) | set(template.stop_ids)))
    plan = cfg.device_plan(cfg.cluster.fake_cpu_devices or 1)
    engines = [SimEngine(seed=cfg.seed, max_action_tokens=r.max_action_tokens,
                         max_context=r.max_context, stop_tokens=stops, costs=costs,
                         num_pages=r.num_pages, page_size=r.page_size, max_slots=r.max_slots,
                         actions=DigitActions(cfg.seed, r.max_action_tokens), host=host)
               for _ in plan.rollout]
    ranks = [RolloutRank(i, e, max_prefills_per_step=min(r.prefill_batch, r.max_slots))
             for i, e in enumerate(engines)]
    for rank in ranks:
        await rank.start()
    kind = r.scheduler if c.mode == "tiderl" else "vanilla"
    sched = make_scheduler(kind, r.ctb, [r.num_pages * r.page_size] * len(ranks),
                           max_context=r.max_context, max_tasks_per_rank=r.max_slots)
    colocated = not plan.ref
    trainer = SimTrainer(costs, actor_gpus=len(plan.actor), ref_gpus=len(plan.ref),
                         aggregate=c.mode != "stream", max_aggregate=t.max_aggregate,
                         offload=t.offload == "always", uses_ref=t.kl_coef != 0,
                         row_len=t.row_len, host=host)

    async def sync_weights(weights: Any, version: int) -> None:
        if host is not None:  # a device copy on a worker thread: it takes the lock back
            await host.device_call(costs.profile.op("weight_sync")())
        else:
            await asyncio.sleep(costs.profile.op("weight_sync")())
        await asyncio.gather(*(rank.update_weights(weights, version) for rank in ranks))

    batcher = SimMicroBatcher(n_ranks=len(plan.actor), rank_budget=t.rows_per_rank * t.row_len,
                              order="colocated" if colocated else "decoupled",
                              balance=t.balance)
    client_s, server_s = costs.env_served() if served else (costs.env_call(), 0.0)
    env = SimSuiteEnv(cfg.env, overhead_s=client_s, server_s=server_s, trace=trace, host=host)
    eval_src = TaskSource.from_config(cfg.env, "eval")
    manager = RolloutManager(ranks, sched, env, template, max_turns=cfg.env.max_turns,
                             eval_temperature=c.eval_temperature)
    metrics = MetricsSink(run_dir, console=False)
    layout, _ = wire(planner="", n_cells=len(ranks) + len(plan.actor) + len(plan.ref),
                     rollout_cells=len(ranks), ref_cells=len(plan.ref), gpus_per_cell=1,
                     actor_gpus=len(plan.actor), ref_gpus=len(plan.ref), trainer=trainer,
                     batcher=batcher, new_rank=None, join_cost_s=0.0)  # the split stays
    controller = Controller(
        c, manager=manager, trainer=trainer,
        hooks=Hooks(sync_weights=sync_weights, make_microbatches=batcher),
        train_stream=SeedStream(TaskSource.from_config(cfg.env, "train")),
        eval_groups=[eval_src.element(k) for k in range(eval_src.groups)], metrics=metrics,
        buffer=ReadinessBuffer(groups_per_microbatch=c.groups_per_microbatch,
                               max_staleness=c.max_staleness, min_ok_per_group=c.min_ok_per_group,
                               zero_var=t.zero_var_groups, adv_eps=t.adv_eps),
        **layout)
    try:
        summary = await controller.run()
    finally:
        trainer.close()
        for rank in ranks:
            await rank.close()
    summary["rollout"] = {k: v for k, v in manager.stats().items() if k != "per_rank"}
    return {"summary": summary, "records": list(metrics.records), "replayed": env.replayed}


def simulate(cfg: Any, profile: str = "cpu-fitted",
             trace: dict[tuple[str, int], str] | None = None, *,
             charge_cpu: bool = True, served: bool = False, speed: float = 1.0
             ) -> dict[str, Any]:
    """The simulated twin of `run_real(cfg)`; `trace` replays a real run's actions. With
    `charge_cpu` the control plane's own host time (measured per loop iteration) is charged
    to the virtual clock, as the real run's event loop spends it; `served`: the env served by
    another process, as `run_real(cfg, served=...)` serves it; `speed`: the profile's timed
    costs scaled by it (`Profile.scaled`: the machine that many times slower than at its
    fit, `tiderl.sim.speed`)."""
    costs = SimCostModel(load_profile(profile).scaled(speed), model_shape("tiny"))
    meter = CpuMeter(clock=time.thread_time)  # this process's CPU, not the machine's load
    with tempfile.TemporaryDirectory() as tmp:
        out = run_virtual(_simulate(cfg, costs, tmp, trace, served), meter=meter,
                          charge_cpu=charge_cpu)
    out["cpu_s"] = meter.cpu_s
    return out


def prime_compiles(cfg: Any) -> int:
    """Compiles every kernel shape the job can use, untimed: each prefill (rows, length,
    page-table width) bucket and decode bucket of the engine, and the trainer's kernels at
    every row bucket.
    (Compiled kernels are shared by later jobs of the same model and meshes in this process.)
    The simulator does not model compilation, so the timed runs must not pay for it."""
    import jax

    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import load_tokenizer
    from tiderl.runtime.build import build
    from tiderl.runtime.parts import rollout_config_for, trainer_config_for_mode
    from tiderl.serving.engine import Engine
    from tiderl.serving.warmup import prime_engine
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    devices, plan, meshes, graphdef, params = build(cfg)
    rcfg = rollout_config_for(cfg, template_for(load_tokenizer(cfg.model.tokenizer), "auto"))
    eng = Engine(graphdef, jax.device_put(params, devices[plan.rollout[0][0]]), cfg.model, rcfg)
    eng.init_decode_state()
    n = prime_engine(eng, rcfg)
    t = trainer_config_for_mode(cfg)
    be = TrainerBackend(t, cfg.model, actor_mesh=meshes["actor"],
                        ref_mesh=meshes["ref"] if plan.ref else None,
                        temperature=rcfg.temperature, policy=(graphdef, params))
    rows = 1
    # Packing a full budget of short sequences can take up to twice rows_per_rank rows.
    while rows <= 2 * t.rows_per_rank:
        trajs = synthetic_trajectories(rows * len(plan.actor), vocab=cfg.model.vocab_size,
                                       min_len=t.row_len - 8, max_len=t.row_len, seed=rows)
        mbs, _ = microbatches(trajs, n_ranks=len(plan.actor), row_len=t.row_len,
                              rows_per_rank=2 * t.rows_per_rank)
        be.train_step(mbs * 2)  # a second micro-batch: the accumulating backward compiles too
        rows *= 2
        n += 1
    be.close()
    return n


def run_real(cfg: Any, served: list[str] | None = None) -> dict[str, Any]:
    """The job `cfg` run for real, its policy's actions recorded; with `served` (the server's
    overrides, `server_overrides`) its env served by another process (`tiderl.sim.served`),
    whose CPU seconds come back as `server_cpu_s`."""
    from tiderl.control.metrics import read_metrics
    from tiderl.runtime.job import run_job
    from tiderl.sim.served import ActionRecorder, ServedEnv

    if cfg.env.suite_name != "default" or cfg.env.kind != "env":
        raise ValueError(f"validation records the default task's actions; env.suite="
                         f"{cfg.env.suite!r} is not supported here")
    server = ServedEnv(served) if served is not None else None
    with ActionRecorder() as trace, server or contextlib.nullcontext():
        if server is not None:
            cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, url=server.url))
        t0, c0 = time.perf_counter(), time.process_time()
        summary = asyncio.run(run_job(cfg))
        real_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    # The machine may be shared: the CPU this run got and the load beside it say how far the
    # simulator's host model (calibrated effective cores) applies to it.
    out = {"summary": summary, "records": read_metrics(cfg.run_dir), "real_s": real_s,
           "cpu_s": cpu_s, "loadavg": os.getloadavg()[0],
           "trace": dict(server.trace if server is not None else trace)}
    if server is not None:
        out["server_cpu_s"] = server.cpu_s
    return out


def measure_lock_wait(profile_path: Path, *, steps: int = 8, seed: int = 1000,
                      job: str = "pressure", modes: Sequence[str] = MODES) -> dict[str, Any]:
    """The engine's wait for the interpreter lock in the job (`tiderl.sim.lockwait`): each
    mode's job run for real at `seed` (after its kernels are compiled and an untimed warm-up
    run) with its engine calls recorded, then replayed alone; writes the pooled
    `host.lock_wait_s` and the runs' figures (`notes.lock_wait`) into the profile."""
    import threading

    import yaml

    from tiderl.sim import lockwait
    from tiderl.sim.hostcost import write_profile

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            warm = run_config(mode, 2, seed, f"{tmp}/warm-{mode}", job)
            prime_compiles(warm)
            run_real(warm, server_overrides(seed, job))
            cfg = run_config(mode, steps, seed, f"{tmp}/{mode}", job)
            with lockwait.recorded_calls() as calls, \
                    lockwait.LoopCpu(threading.get_ident()) as cpu:
                r = run_real(cfg, server_overrides(seed, job))
            u = cpu.share(step_records(r)[-1]["wall_s"])
            runs.append({"mode": mode, **{k: round(v, 4) if isinstance(v, float) else v
                                          for k, v in lockwait.in_job_calls(calls, u).items()}})
    note = {"seconds": lockwait.lock_wait_s(runs), "runs": runs,
            "measured_by": "python -m tiderl.sim.validate --measure-lock-wait: prefill device "
                           "calls in the real job vs the same calls replayed alone, times "
                           f"(1 - u) / u at the loop thread's CPU share u; {job} job, seed "
                           f"{seed}, {steps} steps, modes {', '.join(modes)}",
            "date": time.strftime("%Y-%m-%d %H:%M")}
    d = yaml.safe_load(profile_path.read_text())
    d.setdefault("host", {})["lock_wait_s"] = note["seconds"]
    d.setdefault("notes", {})["lock_wait"] = note
    write_profile(profile_path, d)
    return note


def save_real(r: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({"summary": r["summary"], "records": r["records"],
                                "real_s": r["real_s"], "cpu_s": r.get("cpu_s"),
                                "loadavg": r.get("loadavg"),
                                "server_cpu_s": r.get("server_cpu_s"),
                                "probe_s": r.get("probe_s"),
                                "trace": [[t, k, a] for (t, k), a in r["trace"].items()]},
                               default=str))


def load_real(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    d["trace"] = {(t, k): a for t, k, a in d["trace"]}
    return d


# -- comparison -------------------------------------------------------------------------------
def step_records(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in out["records"] if r.get("kind") == "step"]


def run_metrics(out: dict[str, Any]) -> dict[str, float]:
    steps = step_records(out)
    if not steps:
        return dict.fromkeys(METRICS, float("nan"))
    last = steps[-1]
    n, busy = last.get("engine_steps"), last.get("engine_busy_s")
    return {"goodput": last["goodput"],
            "engine_steps": float(n) if n is not None else float("nan"),
            "engine_round_ms": 1e3 * busy / n if n and busy is not None else float("nan"),
            "step_time_s": statistics.fmean(r["step_time_s"] for r in steps),
            "rwt_s": sum(r["rwt_s"] for r in steps), "twt_s": sum(r["twt_s"] for r in steps),
            "kv_hit_rate": last["kv_hit_rate"], "prefill_computed": last["prefill_computed"]}


def _median(xs: Any) -> float:
    """The median of the values that are not nan (nan if none is)."""
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def rel_err(sim: float, real: float) -> float:
    return abs(sim - real) / abs(real) if real else float("nan")


def ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda m: -values[m])


def paired_above(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> bool:
    """Whether the real runs put mode `a` above mode `b` seed by seed: every seed plays the
    same tasks and environment latencies in every mode, so the runs pair up by seed, and a
    paired t-test (two-sided, level `alpha`) on the per-seed differences decides. Two seeds
    at least; fewer order nothing."""
    if len(a) != len(b) or len(a) < 2:
        return False
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if statistics.fmean(diffs) <= 0:
        return False
    if min(diffs) > 0 and statistics.pstdev(diffs) == 0:
        return True  # the same positive gap in every seed (the t statistic is infinite)
    from scipy.stats import ttest_rel  # not at import: scipy is slow to load

    return float(ttest_rel(a, b).pvalue) < alpha


def compare(real: dict[str, list], sim: dict[str, list]) -> dict[str, Any]:
    """Per-mode medians over seeds, relative errors, step-time MAPE step by step."""
    out: dict[str, Any] = {"modes": {}}
    for mode in real:
        rm = [run_metrics(o) for o in real[mode]]
        sm = [run_metrics(o) for o in sim[mode]]
        med = {k: (_median(m[k] for m in rm), _median(m[k] for m in sm)) for k in METRICS}
        errs = []
        for ro, so in zip(real[mode], sim[mode], strict=True):
            rs, ss = step_records(ro), step_records(so)
            errs += [rel_err(b["step_time_s"], a["step_time_s"]) for a, b in zip(rs, ss,
                                                                                 strict=False)]
        out["modes"][mode] = {"real": {k: v[0] for k, v in med.items()},
                              "sim": {k: v[1] for k, v in med.items()},
                              "rel_error": {k: rel_err(v[1], v[0]) for k, v in med.items()},
                              "step_time_mape": statistics.fmean(errs) if errs else float("nan")}
    g_real = {m: v["real"]["goodput"] for m, v in out["modes"].items()}
    g_sim = {m: v["sim"]["goodput"] for m, v in out["modes"].items()}
    out["ranking_real"], out["ranking_sim"] = ranking(g_real), ranking(g_sim)
    out["same_ranking"] = out["ranking_real"] == out["ranking_sim"]
    # The ranking check restricted to the pairs of modes the real runs themselves order:
    seeds = {m: [run_metrics(o)["goodput"] for o in real[m]] for m in real}
    resolved, unresolved, by_range = [], [], []
    for i, a in enumerate(out["ranking_real"]):
        for b in out["ranking_real"][i + 1:]:
            disjoint = min(seeds[a]) > max(seeds[b])
            if not disjoint:
                by_range.append(f"{a}~{b}")
            ordered = disjoint or paired_above(seeds[a], seeds[b])
            (resolved if ordered else unresolved).append((a, b))
    out["unresolved_pairs"] = [f"{a}~{b}" for a, b in unresolved]
    out["overlapping_pairs"] = by_range
    out["same_ranking_resolved"] = all(g_sim[a] > g_sim[b] for a, b in resolved)
    out["max_goodput_rel_error"] = max(v["rel_error"]["goodput"]
                                       for v in out["modes"].values())
    return out


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{'mode':7s} {'metric':17s} {'real':>11s} {'sim':>11s} {'error':>7s}")
    for mode, v in res["modes"].items():
        for k in METRICS:
            print(f"{mode:7s} {k:17s} {v['real'][k]:11.3f} {v['sim'][k]:11.3f} "
                  f"{v['rel_error'][k]:7.1%}")
        print(f"{mode:7s} {'step time MAPE':17s} {'':>11s} {'':>11s} "
              f"{v['step_time_mape']:7.1%}  (per step, paired by seed)")
    print(f"\nranking by goodput: real {' > '.join(res['ranking_real'])}; "
          f"sim {' > '.join(res['ranking_sim'])}; real seeds overlap for "
          f"{', '.join(res['overlapping_pairs']) or 'no pair'}; left unordered by the real "
          f"seeds (ranges and paired test): {', '.join(res['unresolved_pairs']) or 'no pair'}")


def plot(res: dict[str, Any], path: Path) -> None:
    """Step time per step, real against simulated, one panel per mode (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(14, 3), sharey=True)
    for ax, m in zip(axes, MODES, strict=True):
        for side, style in (("real", "-o"), ("sim", "--s")):
            runs = res["steps"][side][m]
            if runs:
                ax.plot([r["step"] for r in runs[0]], [r["step_time_s"] for r in runs[0]],
                        style, ms=3, label=side)
        e = res["modes"][m]["rel_error"]["goodput"]
        ax.set_title(f"{m} (goodput error {e:.0%})")
        ax.set_xlabel("step")
    axes[0].set_ylabel("step time (s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _real_runs(args: argparse.Namespace, keep: Path | None) -> dict[tuple[str, int], dict]:
    """The real runs by (mode, seed): run now (modes rotated per seed, after an untimed
    warm-up per mode; the speed probe timed before and after each run, `probe_s`), or with
    `--reuse-real` loaded from `--real-dir`."""
    runs: dict[tuple[str, int], dict] = {}
    probe = None
    with tempfile.TemporaryDirectory() as tmp:
        if not args.reuse_real:
            from tiderl.config import load_config
            from tiderl.sim.speed import SpeedProbe

            for mode in MODES:  # warm-up: compile every kernel the mode uses (untimed)
                warm = run_config(mode, 2, 1000, f"{tmp}/warm-{mode}", args.job)
                prime_compiles(warm)
                run_real(warm, server_overrides(1000, args.job))
            probe = SpeedProbe(load_config(None, VALIDATION_OVERRIDES + [f"run_dir={tmp}/p"]))
        for seed in range(args.seeds):
            order = MODES[seed % 4:] + MODES[:seed % 4]
            for mode in order:
                saved = keep / f"{mode}-{seed}.json" if keep is not None else None
                if args.reuse_real:
                    if saved is None or not saved.is_file():
                        raise SystemExit(f"--reuse-real: {saved} not found; run once with "
                                         "--real-dir to keep the real runs")
                    runs[mode, seed] = load_real(saved)
                    continue
                assert probe is not None
                cfg = run_config(mode, args.steps, seed, f"{tmp}/{mode}-{seed}", args.job)
                before = probe()
                r = run_real(cfg, server_overrides(seed, args.job))
                r["probe_s"] = [before, probe()]
                if saved is not None:
                    save_real(r, saved)
                runs[mode, seed] = r
        if probe is not None:
            probe.close()
    return runs


def _profile_notes(path: Path) -> dict[str, Any]:
    """A profile's notes; empty when it has none or is not there (`simulate` says so)."""
    try:
        return dict(load_profile(path).notes or {})
    except ConfigError:
        return {}


def _lock_wait(args: argparse.Namespace, profile_path: Path) -> dict[str, Any]:
    """`measure_lock_wait` for `main`, on the validated job (the served job's loop runs no env
    server); the default job's is measured on the pressure job, as it always was."""
    job = "pressure" if args.job == "default" else args.job
    note = measure_lock_wait(profile_path, steps=4 if args.quick else 8, job=job,
                             modes=MODES[:2] if args.quick else MODES)
    for r in note["runs"]:
        print(f"{r['mode']:7s} engine call in the job {r['in_job_ms']:.2f} ms vs alone "
              f"{r['alone_ms']:.2f} ms ({r['replayed']} of {r['calls']} calls), loop busy "
              f"{r['u']:.0%}")
    print(f"lock wait {note['seconds'] * 1e3:.3f} ms per u/(1-u); wrote {profile_path}")
    return note


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiderl.sim.validate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--profile", default="cpu-fitted")
    p.add_argument("--calibrate", action="store_true", help="refit the profile first")
    p.add_argument("--quick", action="store_true", help="4 steps, 1 seed (a smoke run)")
    p.add_argument("--job", default="default", choices=sorted(JOBS),
                   help="the validated job: 'default' (the embedded task), 'pressure' (KV "
                        "pressure and several ready micro-batches a step: the modes differ), "
                        "'served' (the pressure job with its env server in its own process)")
    p.add_argument("--out", default="", help="write the full comparison as JSON here")
    p.add_argument("--real-dir", default="",
                   help="keep each real run (records, summary, action trace) here as JSON; with "
                        "--reuse-real, simulate against the runs found there instead")
    p.add_argument("--reuse-real", action="store_true")
    p.add_argument("--no-speed", action="store_true",
                   help="do not scale the profile by the real runs' speed probe over the "
                        "calibration's (tiderl.sim.speed)")
    p.add_argument("--measure-lock-wait", action="store_true",
                   help="measure the engine's wait for the interpreter lock in the real job "
                        "(--job; the pressure job for the default one) (host.lock_wait_s; "
                        "tiderl.sim.lockwait) into the profile and stop")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 4, 1
    logging.disable(logging.WARNING)
    profile_path = PROFILES / f"{args.profile}.yaml"
    if args.calibrate:
        from tiderl.sim import calibrate

        calibrate.main(["--out", str(profile_path)] + (["--quick"] if args.quick else []))
    if args.calibrate or args.measure_lock_wait:
        note = _lock_wait(args, profile_path)
        if args.measure_lock_wait:
            print(json.dumps({"profile": str(profile_path), "lock_wait_s": note["seconds"]}))
            return 0
    keep = Path(args.real_dir) if args.real_dir else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    runs = _real_runs(args, keep)
    factor = None if args.no_speed else speed_factor(
        _profile_notes(profile_path), [p for r in runs.values() for p in r.get("probe_s") or ()])
    if factor is not None:
        print(f"speed: the real runs' probe is {factor:.3f}x the calibration's; the profile's "
              "timed costs are scaled by it (--no-speed: not)")
    real: dict[str, list] = {m: [] for m in MODES}
    sim: dict[str, list] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for (mode, seed), r in runs.items():
            cfg = run_config(mode, args.steps, seed, f"{tmp}/{mode}-{seed}", args.job)
            s = simulate(cfg, args.profile, r["trace"], served=JOBS[args.job].served,
                         speed=factor or 1.0)
            real[mode].append(r)
            sim[mode].append(s)
            print(f"seed {seed} {mode:7s} real goodput {r['summary']['goodput']:7.2f} "
                  f"({r['real_s']:5.1f} s)  sim {s['summary']['goodput']:7.2f} "
                  f"({s['cpu_s']:4.1f} s cpu); real run got {r.get('cpu_s') or 0:5.1f} s "
                  f"cpu, load average {r.get('loadavg') or 0:4.1f}", flush=True)
    res = compare(real, sim)
    print_table(res)
    if args.out:
        keep = ("step", "wall_s", "step_time_s", "rwt_s", "twt_s", "goodput", "kv_hit_rate",
                "prefill_computed", "consumed_tokens", "generated_tokens", "step_time",
                "time_ref", "time_actor_fwd", "time_actor_bwd", "time_apply", "time_wait",
                "sync_s", "engine_busy", "engine_steps", "engine_busy_s", "tasks_executing",
                "tasks_waiting")
        res["steps"] = {side: {m: [[{k: r.get(k) for k in keep} for r in step_records(o)]
                                   for o in runs[m]] for m in MODES}
                        for side, runs in (("real", real), ("sim", sim))}
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
        plot(res, Path(args.out).with_suffix(".png"))
    head = {"max_goodput_rel_error": res["max_goodput_rel_error"],
            "same_ranking": res["same_ranking"],
            "same_ranking_resolved": res["same_ranking_resolved"],
            "unresolved_pairs": res["unresolved_pairs"],
            "overlapping_pairs": res["overlapping_pairs"],
            **{f"goodput_rel_error_{m}": v["rel_error"]["goodput"]
               for m, v in res["modes"].items()},
            **{f"step_time_mape_{m}": v["step_time_mape"] for m, v in res["modes"].items()},
            # The engines' device rounds, simulated over real (medians over seeds).
            **{f"engine_steps_sim_over_real_{m}": v["sim"]["engine_steps"]
               / v["real"]["engine_steps"] for m, v in res["modes"].items()
               if v["real"]["engine_steps"] > 0},
            "speed_factor": factor, "steps": args.steps, "seeds": args.seeds,
            "profile": args.profile, "job": args.job}
    print(json.dumps(head, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
