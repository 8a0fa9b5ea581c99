"""What the controller reports: evaluation rounds, the step record, the live progress line and
the run's summary. No JAX.

An evaluation round plays every eval group once (one task per group under greedy decoding) on
the weights of one step and logs an `eval` record (and samples); the loop starts it right after
that step's sync and awaits it before the next. The step record gathers the trainer's metrics,
the buffer's readiness, the rollout's figures and the boundary's roles and plan; writing it
closes the step's windows (RWT, the manager's stats) and forgets the stream positions of groups
no longer live. A mixin so the loop in `controller.py` stays about the loop; it reads the
controller's state (`cfg`, `manager`, `buffer`, `metrics`, `samples`, `step`, `version`, ...)
and the boundary's record (`ReadinessAware._roles_record`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tiderl.control.buffer import ReadyGroup
from tiderl.control.metrics import trajectory_metrics
from tiderl.control.progress import snapshot

# The controller's logger: these are the controller's messages (as in `starvation.py`).
log = logging.getLogger("tiderl.control.controller")


class Reporting:
    """Evaluation, the step record, the progress line, the summary (see the module docstring)."""

    cfg: Any
    manager: Any
    buffer: Any
    metrics: Any
    samples: Any
    roles: Any
    starvation: Any
    eval_groups: list[dict]
    step: int
    version: int
    index_of: dict[str, int]
    in_flight: set[str]
    consumed_tokens: int
    generated_tokens: int
    rwt: float
    nonfinite_total: int
    last_eval: float
    end_reason: str
    _phase: str
    _taken: list[ReadyGroup]
    _t0: float
    _t_roll: tuple[float, float] | None
    _eval_task: asyncio.Task[None] | None
    _progress_broken: bool
    now: Callable[[], float]
    """The controller's clock (`Controller.now`)."""

    # -- evaluation ------------------------------------------------------------------------------
    async def _evaluate(self, step: int, version: int) -> None:
        t0 = self.now()
        # Greedy decoding plays every sibling of a group the same way: one task per group.
        size = 1 if self.cfg.eval_temperature == 0 else None
        groups = await asyncio.gather(*(self.manager.run_group(_tagged(g, f"@s{step}", size),
                                                               is_eval=True)
                                        for g in self.eval_groups))
        trajs = [t for g in groups for t in g]
        ok = [t for t in trajs if t.ok]
        success = sum(t.reward >= 1.0 for t in ok) / max(1, len(trajs))
        if self.samples is not None and self.samples.n:
            path, samples = self.samples.write(step, trajs)
            self.metrics.log_samples(step, samples, path)
        self.metrics.log({"kind": "eval", "step": step, "version": version,
                          "eval_success": success,
                          "eval_reward": sum(t.reward for t in ok) / max(1, len(ok)),
                          "eval_tasks": len(trajs), "eval_failed": len(trajs) - len(ok),
                          "eval_time_s": self.now() - t0, "wall_s": self.now() - self._t0})
        self.last_eval = success

    def _launch_eval(self) -> None:
        self._eval_task = asyncio.create_task(self._evaluate(self.step, self.version))

    async def _await_eval(self) -> None:
        if self._eval_task is not None:
            await self._eval_task
            self._eval_task = None

    # -- records and progress --------------------------------------------------------------------
    async def _tick(self) -> None:
        """The live progress line (and gauges), once a second while the run goes."""
        while True:  # a clock, not a wait for a condition
            if not self._show_progress():
                return
            await asyncio.sleep(1.0)

    def _show_progress(self, *, force: bool = False) -> bool:
        if self._progress_broken:
            return False
        try:
            self.metrics.progress(self.progress(), force=force)
        except Exception:  # a display bug must not stop training (or hide why it stopped)
            log.exception("the progress line failed; it stays off for this run")
            self._progress_broken = True
        return not self._progress_broken

    def progress(self) -> dict[str, Any]:
        """What the rollout is doing now (`tiderl.control.progress.snapshot`)."""
        snap = snapshot(manager=self.manager, buffer=self.buffer, phase=self._phase,
                        needed=self.cfg.groups_per_step, taken=len(self._taken),
                        in_flight=len(self.in_flight))
        return {"step": self.step + 1, "starved_s": self.starvation.waited(self.now()), **snap}

    def _log_step(self, out: dict, sync_s: float) -> None:
        m, r = out["train"], out["readiness"]
        wall = self.now() - self._t0
        taken: list[ReadyGroup] = out["taken"]
        rs = out.get("rollout_stats") or self.manager.stats()  # taken before the role change
        rec = {
            "kind": "step", "step": self.step, "version": self.version, "wall_s": wall,
            "goodput": self.consumed_tokens / max(wall, 1e-9),
            "gen_throughput": self.generated_tokens / max(wall, 1e-9),
            "consumed_tokens": self.consumed_tokens,
            "generated_tokens": self.generated_tokens,
            "kv_hit_rate": rs["kv_hit_rate"],
            "kv_pages_in_use": [r.get("pages_in_use", 0) for r in rs["per_rank"]],
            "prefill_computed": rs["computed_tokens"],
            # Over the step: the engines' busy share, mean tasks in a turn / ready / waiting
            # on their environment / queued for admission.
            **{k: rs[k] for k in ("engine_busy", "tasks_executing", "tasks_ready",
                                  "tasks_waiting", "tasks_queued", "tasks_paused", "shared_tokens",
                                  "restored_tokens", "window_cuts", "engine_steps",
                                  "engine_busy_s") if k in rs},
            "reward_mean": sum(g.reward_mean for g in taken) / max(1, len(taken)),
            "groups": len(taken),
            "group_ids": [g.group_id for g in taken],
            "rwt_s": self.rwt, "twt_s": out["twt"], "step_time_s": out["step_time"],
            "sync_s": sync_s, **out.get("sync", {}),
            "t_train_start": out["t_train"][0] - self._t0, "t_train_end": out["t_train"][1] - self._t0,
            **({"t_rollout_start": self._t_roll[0] - self._t0,
                "t_rollout_end": self._t_roll[1] - self._t0} if self._t_roll else {}),
            **r.record(),
            "staleness_mean": _mean_staleness(taken, self.version - 1),
            **self._roles_record(out),
            "nonfinite_skipped": self.nonfinite_total,
            "eval_success": self.last_eval,
            **{k: v for k, v in m.items() if isinstance(v, (int, float, str))},
            **self.buffer.summary(),
            "end_reasons": rs["end_reasons"],
            **trajectory_metrics([t for g in taken for t in g.trajs]),
            "staleness_max": max((self.version - 1 - g.min_version for g in taken
                                  if g.min_version >= 0), default=0),
        }
        self.rwt = 0.0
        self.manager.new_window()
        self.metrics.log(rec)
        # Only groups not yet trained or dropped need their stream position (`data_state`).
        live = self.in_flight | {g.group_id for g in self.buffer.ready}
        self.index_of = {g: k for g, k in self.index_of.items() if g in live}

    def _summary(self) -> dict:
        return {**self.metrics.summary.result(), **self.roles.summary(),
                "ended": self.end_reason}


def _tagged(group: dict, tag: str, size: int | None = None) -> dict:
    """The same eval group under ids unique to one evaluation round (first `size` tasks)."""
    gid = group["group_id"] + tag
    return {**group, "group_id": gid,
            "tasks": [{**t, "task_id": t["task_id"] + tag, "group_id": gid}
                      for t in group["tasks"][:size]]}


def _mean_staleness(groups: Sequence[ReadyGroup], train_version: int) -> float:
    s = [train_version - g.min_version for g in groups if g.min_version >= 0]
    return sum(s) / len(s) if s else 0.0
