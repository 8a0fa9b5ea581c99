"""The host cost of an environment call, measured where a job spends it. No JAX.

In a job on one machine (the `cpu-fitted` profile) the env server runs in-process: the
client's request, the server's handler and the reply are all work of the job's one event
loop, the thread that also runs the controller, the scheduler and the ranks' loops. While it
runs, nothing else on the loop does, and it takes a share of the cores the engine and the
trainer run on (`tiderl.sim.host`). The simulator charges it as the profile's `env_call`
(`tiderl.sim.envs.SimSuiteEnv`: held on the loop, on the shared host).

`env_call_cpu_s` measures it in situ: the real rollout manager, scheduler and rank (over a
simulated engine with no cost, driven on the rank's worker thread as a real engine is) play
the same groups twice on a real event loop, once with the env served over HTTP by the
in-process server and `EnvClient`, as a job does, and once with the same adapter and latencies
called in-process (`SimSuiteEnv`, what the simulator runs). The difference in the loop
thread's CPU time, per HTTP call, is the cost. A call measured alone (`calibrate`'s
`env_times`) costs less: a job's loop carries many connections and tasks at once.

`env_served_cpu_s` measures the same with the env served by a process of its own
(`tiderl.sim.served`): the loop thread's extra CPU per call is then the client's share
(`env_client`), and the server process's CPU per call, while it served, the server's
(`env_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any


class OnWorker:
    """A simulated engine the rank drives on its worker thread, as it drives a real engine
    (no `take_cost_s`: see `tiderl.serving.rank`). Each prefill or decode call then sleeps its
    simulated cost on that thread, as a real call waits on its device (the GIL released), so
    turns come as far apart as a job's."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "take_cost_s":
            raise AttributeError(name)
        attr = getattr(self._engine, name)
        if name not in ("prefill_many", "generate"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                time.sleep(self._engine.take_cost_s())
        return call


async def play(cfg: Any, *, http: bool, groups: int, first: int = 0,
               costs: Any = None) -> tuple[float, int, list[Any]]:
    """Plays train groups `first .. first + groups - 1` of the job `cfg` at once through the
    real rollout manager, vanilla scheduler and one rank (its KV pool as configured) over a
    simulated engine taking the time of `costs` (a `SimCostModel`; None: no time); returns
    (loop-thread CPU seconds, HTTP env calls made, the groups' trajectories)."""
    from tiderl.envs.client import EnvClient
    from tiderl.envs.server import endpoint
    from tiderl.envs.tasks import TaskSource
    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import load_tokenizer
    from tiderl.serving.ctb import make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager
    from tiderl.sim.envs import SimSuiteEnv
    from tiderl.sim.virtual_engine import DigitActions, SimEngine

    r = cfg.rollout
    template = template_for(load_tokenizer(cfg.model.tokenizer), "auto")
    stops = tuple(sorted(set(r.stop_tokens) | set(template.stop_ids)))
    engine = SimEngine(seed=cfg.seed, max_action_tokens=r.max_action_tokens,
                       max_context=r.max_context, stop_tokens=stops, num_pages=r.num_pages,
                       page_size=r.page_size, max_slots=r.max_slots,
                       actions=DigitActions(cfg.seed, r.max_action_tokens), costs=costs)
    rank = RolloutRank(0, OnWorker(engine), max_prefills_per_step=min(r.prefill_batch,
                                                                       r.max_slots))
    await rank.start()
    sched = make_scheduler("vanilla", r.ctb, [r.num_pages * r.page_size],
                           max_context=r.max_context, max_tasks_per_rank=r.max_slots)
    src = TaskSource.from_config(cfg.env, "train")
    try:
        async with contextlib.AsyncExitStack() as stack:
            env: Any
            if http:
                url = await stack.enter_async_context(endpoint(cfg.env))
                env = await stack.enter_async_context(EnvClient(url, cfg.env))
            else:
                env = SimSuiteEnv(cfg.env)
            manager = RolloutManager([rank], sched, env, template,
                                     max_turns=cfg.env.max_turns)
            c0 = time.thread_time()
            played = await asyncio.gather(*(manager.run_group(src.element(first + k))
                                            for k in range(groups)))
            cpu = time.thread_time() - c0
    finally:
        await rank.close()
    return cpu, env.attempts if http else 0, [t for g in played for t in g]


def env_call_cpu_s(cfg: Any, costs: Any = None, *, groups: int = 16,
                   repeats: int = 3) -> dict[str, Any]:
    """Loop-thread CPU seconds per env call over HTTP, in situ (see the module docstring):
    the median over `repeats` of (CPU with HTTP - CPU in-process) / HTTP calls, the two
    playing the same `groups` groups (different ones each repeat; an untimed pair first)."""
    if groups < 1 or repeats < 1:
        raise ValueError(f"env_call_cpu_s: groups={groups} and repeats={repeats} must be >= 1")
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, url=""))
    per_call, calls = [], []
    for k in range(repeats + 1):
        first = k * groups
        http, n, _ = asyncio.run(play(cfg, http=True, groups=groups, first=first,
                                           costs=costs))
        direct, _, _ = asyncio.run(play(cfg, http=False, groups=groups, first=first,
                                             costs=costs))
        if k and n:  # the first pair warms up imports, connections and caches
            per_call.append((http - direct) / n)
            calls.append(n)
    q = sorted(per_call)
    med = statistics.median(q)
    return {"seconds": med, "calls": int(statistics.median(calls)) if calls else 0,
            "spread": (q[-1] - q[0]) / med if med else float("nan"), "samples": per_call}


def env_served_cpu_s(cfg: Any, costs: Any = None, *, groups: int = 16,
                     repeats: int = 3) -> dict[str, Any]:
    """The same groups played with the env served by a process of its own
    (`tiderl.sim.served`), as a deployed environment runs: per HTTP call, the loop thread's CPU
    (HTTP minus in-process, as `env_call_cpu_s`: the client's share, `client_s`) and the
    server process's CPU while it served (`server_s`); medians over `repeats`, each
    with a server of its own (an untimed pair first)."""
    from tiderl.sim.served import ServedEnv

    if groups < 1 or repeats < 1:
        raise ValueError(f"env_served_cpu_s: groups={groups} and repeats={repeats} must be >= 1")
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, url=""))
    overrides = [f"latency.{f.name}={getattr(cfg.env.latency, f.name)}"
                 for f in dataclasses.fields(cfg.env.latency)]
    client, server = [], []
    for k in range(repeats + 1):
        first = k * groups
        with ServedEnv(overrides) as srv:
            served = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, url=srv.url))
            http, n, _ = asyncio.run(play(served, http=True, groups=groups, first=first,
                                          costs=costs))
        direct, _, _ = asyncio.run(play(cfg, http=False, groups=groups, first=first,
                                        costs=costs))
        if k and n:
            client.append((http - direct) / n)
            server.append(srv.cpu_s / n)
    return {"client_s": statistics.median(client), "server_s": statistics.median(server),
            "client_samples": client, "server_samples": server}


def _paced(ops: dict[str, dict[str, float]], engine_rules: dict[str, Any]) -> Any:
    """The tiny model's cost model from fitted `ops`: what paces the simulated engine."""
    from tiderl.sim.costs import SimCostModel, model_shape, profile_from_dict

    return SimCostModel(profile_from_dict({"kind": "fitted", "engine": engine_rules,
                                           "ops": ops}), model_shape("tiny"))


def _stamp(load: float, groups: int) -> dict[str, Any]:
    """When a note was measured, how busy the machine was before, and on how many groups."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": round(load, 2),
            "groups": groups}


def env_call_note(cfg: Any, ops: dict[str, dict[str, float]], engine_rules: dict[str, Any], *,
                  groups: int, repeats: int) -> dict[str, Any]:
    """Measures the env call's host work in situ (`tiderl.sim.hostcost.env_call_cpu_s`), the
    simulated engine paced by the fitted `ops`; the profile's note on it."""
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    m = env_call_cpu_s(cfg, _paced(ops, engine_rules), groups=groups, repeats=repeats)
    return {"seconds": m["seconds"], "spread": m["spread"],
            "measured_by": "tiderl.sim.hostcost.env_call_cpu_s: event-loop CPU per HTTP env "
                           "call, in situ (rollout manager, scheduler and rank over the paced "
                           "simulated engine; HTTP minus in-process), median of repeats",
            **_stamp(load, groups),
            "calls_per_repeat": m["calls"],
            "per_call_ms": [round(x * 1e3, 4) for x in m["samples"]]}


def host_only(path: Path, cfg: Any, *, groups: int, repeats: int) -> dict[str, Any]:
    """Re-measures the profile's host costs (the env call, on the job `cfg`) and rewrites them
    in place; the engine and trainer fits are kept."""
    import yaml

    d = yaml.safe_load(path.read_text())
    ops = {k: {c: float(v) for c, v in spec.items()} for k, spec in d["ops"].items()}
    env = env_call_note(cfg, ops, d["engine"], groups=groups, repeats=repeats)
    notes = d.setdefault("notes", {})
    if (notes.get("mape") or {}).pop("env_call", None) is not None:
        # The previous measure, one call timed alone (its fit's error and noise go with it).
        (notes.get("noise_iqr_over_median") or {}).pop("env_call", None)
        env["alone_ms"] = round(float(d["ops"]["env_call"]["c0"]) * 1e3, 4)
    elif "alone_ms" in (notes.get("env_call") or {}):  # an earlier in-situ note kept it
        env["alone_ms"] = notes["env_call"]["alone_ms"]
    d["ops"]["env_call"] = {"c0": env["seconds"]}
    notes["env_call"] = env
    served = env_served_note(cfg, ops, d["engine"], groups=groups, repeats=repeats)
    d["ops"]["env_client"] = {"c0": served["client_s"]}
    d["ops"]["env_server"] = {"c0": served["server_s"]}
    notes["env_served"] = served
    write_profile(path, d)
    env["served"] = served
    return env


def env_served_note(cfg: Any, ops: dict[str, dict[str, float]], engine_rules: dict[str, Any],
                    *, groups: int, repeats: int) -> dict[str, Any]:
    """`env_served_cpu_s` over the simulated engine paced by the fitted `ops`; the profile's
    note on it (`ops.env_client`, `ops.env_server`)."""
    load = os.getloadavg()[0]
    m = env_served_cpu_s(cfg, _paced(ops, engine_rules), groups=groups, repeats=repeats)
    return {"client_s": m["client_s"], "server_s": m["server_s"],
            "measured_by": "tiderl.sim.hostcost.env_served_cpu_s: the env served by a process "
                           "of its own; per HTTP call the loop thread's CPU (HTTP minus "
                           "in-process) and the server process's CPU, medians of repeats",
            **_stamp(load, groups),
            "client_ms": [round(x * 1e3, 4) for x in m["client_samples"]],
            "server_ms": [round(x * 1e3, 4) for x in m["server_samples"]]}


def write_profile(path: Path, profile: dict[str, Any]) -> None:
    import yaml

    path.write_text(
        "# Fitted by `python -m tiderl.sim.calibrate` on this machine (see notes); rerun to\n"
        "# refit. Costs: c0 + max(flops / flops_rate, bytes / hbm_rate), seconds. env_call:\n"
        "# the event loop's CPU seconds per env call over HTTP, in situ (notes.env_call);\n"
        "# env_client/env_server: the same with the env served by a process of its own,\n"
        "# the client's loop CPU and the server's CPU per call (notes.env_served).\n"
        + yaml.safe_dump(profile, sort_keys=False))
