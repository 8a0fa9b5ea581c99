"""What the rollout is doing while a step fills, in one console line, and what to try when no
group becomes trainable. No JAX.

`snapshot(...)` gathers the live numbers from the rollout manager, its scheduler, the env
client and the readiness buffer (cheap: it runs every second); `format_line` writes them as

    filling · episodes: 40 running (8 eval), 312 done, 2 failed · groups: 3/16 ready, 9 in
    flight · dropped: 21 zero_variance · env step p50 0.02s p95 0.31s · KV 37% · tasks: 8
    exec, 32 env, 0 paused, 12 queued

The phase says what the trainer is doing: `filling` (waiting for the step's groups),
`training`, `eval` (waiting for the evaluation before the weight sync) or `sync`.

Episode counts are the manager's (`tasks_live`, `end_reasons`); tasks executing (in a
prefill/decode) vs waiting (on their env, paused, or queued for admission) come from the
manager's stats when it reports them (`tasks_executing`, `tasks_waiting`, and the engines'
`engine_busy`), else from the scheduler's task table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

FAILED = ("env_error", "timeout", "cancelled")


def quantiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.95)) -> list[float]:
    """Nearest-rank quantiles of a small sample (no numpy: this runs every second)."""
    if not values:
        return [float("nan")] * len(qs)
    s = sorted(values)
    return [s[min(len(s), max(1, math.ceil(q * len(s)))) - 1] for q in qs]


def task_states(manager: Any, stats: Mapping[str, Any]) -> dict[str, int]:
    """Tasks executing vs waiting (env, paused, queued) now, from the scheduler's table; a
    manager without one: its own `tasks_*` keys (means over its window)."""
    tasks = getattr(getattr(manager, "sched", None), "tasks", None)
    if not isinstance(tasks, Mapping):
        return {k.removeprefix("tasks_"): int(v) for k, v in stats.items()
                if k in ("tasks_executing", "tasks_waiting") and isinstance(v, (int, float))}
    out = {"executing": 0, "env": 0, "paused": 0, "queued": 0}
    for t in tasks.values():
        if t.state == "active":
            out["executing" if t.executing else "env"] += 1
        elif t.state == "paused":
            out["paused"] += 1
        elif t.state == "new":
            out["queued"] += 1
    return out


def kv_usage(manager: Any, stats: Mapping[str, Any]) -> tuple[int, int]:
    """(pages in use, pages in the pools) over the rollout ranks (total 0 when unknown)."""
    used = sum(int(r.get("pages_in_use", 0)) for r in stats.get("per_rank", []))
    total = 0
    for rank in getattr(manager, "ranks", []):
        pages = getattr(getattr(rank, "engine", None), "pages", None)
        total += int(getattr(pages, "num_pages", 0) or 0)
    return used, total


def env_latency(env: Any) -> dict[str, list[float]]:
    """{"step": [p50, p95], "start": [...]} from the env client's recent calls, if it keeps them."""
    lat = getattr(env, "latency_s", None)
    if not isinstance(lat, Mapping):
        return {}
    return {k: quantiles(list(v)) for k, v in lat.items() if v}


def snapshot(*, manager: Any, buffer: Any, phase: str, needed: int, taken: int,
             in_flight: int) -> dict[str, Any]:
    """The live numbers of the console line (and the Prometheus gauges)."""
    stats = manager.stats()
    ended = dict(stats.get("end_reasons", {}))
    failed = sum(ended.get(k, 0) for k in FAILED)
    eval_live = sum(1 for ep in getattr(manager, "episodes", {}).values()
                    if getattr(ep.task, "is_eval", False))
    used, total = kv_usage(manager, stats)
    return {
        "phase": phase,
        "episodes_live": int(stats.get("tasks_live", 0)), "episodes_live_eval": eval_live,
        "episodes_done": int(stats.get("tasks_ended", 0)) - failed, "episodes_failed": failed,
        "groups_ready": len(buffer) + taken, "groups_needed": needed,
        "groups_in_flight": in_flight, "dropped": dict(buffer.dropped),
        "dropped_in_a_row": buffer.drops_in_a_row,
        "env_latency_s": env_latency(manager.env),
        "kv_pages_in_use": used, "kv_pages_total": total,
        "tasks": task_states(manager, stats),
        "engine_busy": engine_busy(stats),
    }


def engine_busy(stats: Mapping[str, Any]) -> float | None:
    """The engines' busy fraction when the manager reports one (a number, or one per rank)."""
    v = stats.get("engine_busy")
    if isinstance(v, (list, tuple)):
        v = [x for x in v if isinstance(x, (int, float))]
        return sum(v) / len(v) if v else None
    return float(v) if isinstance(v, (int, float)) else None


def format_line(s: Mapping[str, Any]) -> str:
    """The snapshot as one line (see the module docstring)."""
    ev = f" ({s['episodes_live_eval']} eval)" if s.get("episodes_live_eval") else ""
    ready, needed = s["groups_ready"], s["groups_needed"]
    ahead = f" (+{ready - needed} ahead)" if ready > needed else ""
    parts = [s["phase"],
             f"episodes: {s['episodes_live']} running{ev}, {s['episodes_done']} done, "
             f"{s['episodes_failed']} failed",
             f"groups: {min(ready, needed)}/{needed} ready{ahead}, "
             f"{s['groups_in_flight']} in flight"]
    dropped = {k: v for k, v in s.get("dropped", {}).items() if v}
    if dropped:
        parts.append("dropped: " + ", ".join(f"{v} {k}" for k, v in sorted(dropped.items())))
    for kind, (p50, p95) in s.get("env_latency_s", {}).items():
        parts.append(f"env {kind} p50 {p50:.2f}s p95 {p95:.2f}s")
    used, total = s.get("kv_pages_in_use", 0), s.get("kv_pages_total", 0)
    parts.append(f"KV {100 * used / total:.0f}%" if total else f"KV {used} pages")
    if (busy := s.get("engine_busy")) is not None:
        parts.append(f"engines busy {100 * busy:.0f}%" if busy <= 1 else f"engines busy {busy:g}")
    tasks = s.get("tasks", {})
    if tasks:
        parts.append("tasks: " + ", ".join(f"{v} {k.replace('executing', 'exec')}"
                                           for k, v in tasks.items()))
    return " · ".join(parts)


def starvation_advice(cfg: Any) -> str:
    """Run-specific things to try when no group becomes trainable (`cfg`: a RunConfig)."""
    tips = []
    env, rollout = cfg.env, cfg.rollout
    opts = env.option_dict()
    if env.suite == "default" and float(opts.get("format_bonus", "0") or 0) == 0:
        tips.append("a graded reward: env.options=[format_bonus=0.1] pays a failed episode for "
                    "each valid guess")
    if env.suite == "textworld":
        tips.append("a smaller world: env.options=[rooms=1,objects=1,quest_length=1]")
    digit = (env.suite == "gui" and opts.get("actions") == "cell") or (
        env.suite == "textworld" and opts.get("format") == "chat")  # a number is the action
    if env.suite != "default" and not digit and rollout.max_action_tokens < 16:
        tips.append(f"longer actions: rollout.max_action_tokens={rollout.max_action_tokens} "
                    "tokens cannot spell a command")
    if not cfg.model.checkpoint and not cfg.model.init_from and env.suite != "default":
        tips.append("a pretrained policy (model.checkpoint=/path/to/hf-folder): one trained "
                    "from scratch rarely scores on this suite")
    if cfg.trainer.zero_var_groups == "drop":
        tips.append("trainer.zero_var_groups=keep trains on such groups (zero advantage: only "
                    "the entropy/KL terms move the policy)")
    return "; ".join(tips)
