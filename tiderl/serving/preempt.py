"""CTB's eval preemption: an evaluation task that fits nowhere pauses non-eval tasks between
their turns to make room (evals are anchored to weights and block the weight sync). No JAX.
`CTBScheduler` uses it while resuming and admitting; the methods here use its accounting
(`usage`, `_fits`, `_sum_usage`, `footprint`, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiderl.serving.tasktable import Decision, Task

if TYPE_CHECKING:
    from tiderl.serving.ctb import CTBScheduler


class EvalPreemption:
    """Mixin of `CTBScheduler` (its methods take the scheduler as `self`)."""

    def _pausable(self: CTBScheduler, t: Task) -> bool:
        """Eviction candidate for an eval task: a task inside its prefill/decode finishes that
        turn on its rank (pausing it would resume it elsewhere mid-turn), one admitted this
        round has not started, and an eval task blocks the weight sync as much as `t` does."""
        return not (t.is_eval or t.executing or t.task_id in self._fresh)

    def _preemptible_rank(self: CTBScheduler, t: Task, ranks: list[int]) -> int | None:
        """A rank where pausing non-eval tasks makes room for eval task `t`, if any."""
        size = self._probe_size(t)
        cap = self.max_tasks_per_rank
        for r in ranks:
            active = self._active[r]
            keep = [s for s in active.values() if not self._pausable(s)]
            if len(keep) == len(active) or (cap is not None and len(keep) >= cap):
                continue
            if self._n_active - (len(active) - len(keep)) >= self.cfg.env_concurrency:
                continue
            if self._sum_usage([(s, self.footprint(s)) for s in keep] + [(t, size)]) \
                    <= self.budget(r):
                return r
        return None

    def _preempt_on(self: CTBScheduler, t: Task, r: int) -> list[Decision]:
        """Pauses pausable tasks on `r`, lowest priority first, until `t` fits there; it does
        once all are paused (what `_preemptible_rank` checked)."""
        out: list[Decision] = []
        victims = sorted((s for s in self._active[r].values() if self._pausable(s)),
                         key=lambda s: (self.priority(s), s.task_id))
        for victim in victims:
            if self._fits(t, r) and self._n_active < self.cfg.env_concurrency:
                break
            self._pause(victim, r, out)
        return out

    def _pick_eval_by_preemption(self: CTBScheduler, ranks: list[int], out: list[Decision],
                                 stuck: set[str]) -> tuple[Task, int] | None:
        if self.admission_limit is not None and self.admission_limit <= 0:
            return None
        for gid in self._eval_groups():
            tids = self.queue[gid]
            if not tids or not self.tasks[tids[0]].is_eval or tids[0] in stuck:
                continue
            t = self.tasks[tids[0]]
            r = self._preemptible_rank(t, ranks)
            if r is None:
                stuck.add(t.task_id)
                continue
            out.extend(self._preempt_on(t, r))
            stuck.clear()
            return t, r
        return None
