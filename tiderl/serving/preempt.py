"""CTB's eval preemption: an evaluation task that fits nowhere pauses non-eval tasks between
their turns to make room (evals are anchored to weights and block the weight sync). No JAX.
`CTBScheduler` owns an `EvalPreemption` and uses it while resuming and admitting; the policy
sees the scheduler only through `PreemptionHost`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tiderl.serving.tasktable import Decision, Task

if TYPE_CHECKING:
    from tiderl.serving.ctb_config import CTBConfig


@runtime_checkable
class PreemptionHost(Protocol):
    """What eval preemption reads from and does to its scheduler (`CTBScheduler`)."""

    cfg: CTBConfig
    admission_limit: int | None
    max_tasks_per_rank: int | None

    def n_active(self) -> int: ...
    def active_on(self, rank: int) -> list[Task]: ...
    def queued_eval_heads(self) -> list[Task]: ...
    def admitted_this_round(self, task_id: str) -> bool: ...
    def priority(self, t: Task) -> float: ...
    def budget(self, rank: int) -> int: ...
    def fits(self, t: Task, rank: int) -> bool: ...
    def footprint(self, t: Task) -> int: ...
    def probe_size(self, t: Task) -> int: ...
    def sum_usage(self, sized: list[tuple[Task, int]]) -> int: ...
    def pause(self, t: Task, rank: int, out: list[Decision], *, park: bool = False) -> None: ...


class EvalPreemption:
    """Makes room for eval tasks on the scheduler `host` by pausing non-eval ones."""

    def __init__(self, host: PreemptionHost):
        self.host = host

    def pausable(self, t: Task) -> bool:
        """Eviction candidate for an eval task: a task inside its prefill/decode finishes that
        turn on its rank (pausing it would resume it elsewhere mid-turn), one admitted this
        round has not started, and an eval task blocks the weight sync as much as `t` does."""
        return not (t.is_eval or t.executing or self.host.admitted_this_round(t.task_id))

    def rank_for(self, t: Task, ranks: list[int]) -> int | None:
        """A rank where pausing non-eval tasks makes room for eval task `t`, if any."""
        s = self.host
        size = s.probe_size(t)
        cap = s.max_tasks_per_rank
        for r in ranks:
            active = s.active_on(r)
            keep = [a for a in active if not self.pausable(a)]
            if len(keep) == len(active) or (cap is not None and len(keep) >= cap):
                continue
            if s.n_active() - (len(active) - len(keep)) >= s.cfg.env_concurrency:
                continue
            if s.sum_usage([(a, s.footprint(a)) for a in keep] + [(t, size)]) <= s.budget(r):
                return r
        return None

    def make_room(self, t: Task, r: int) -> list[Decision]:
        """Pauses pausable tasks on `r`, lowest priority first, until `t` fits there; it does
        once all are paused (what `rank_for` checked)."""
        s = self.host
        out: list[Decision] = []
        victims = sorted((a for a in s.active_on(r) if self.pausable(a)),
                         key=lambda a: (s.priority(a), a.task_id))
        for victim in victims:
            if s.fits(t, r) and s.n_active() < s.cfg.env_concurrency:
                break
            s.pause(victim, r, out)
        return out

    def pick_eval(self, ranks: list[int], out: list[Decision],
                  stuck: set[str]) -> tuple[Task, int] | None:
        """The first queued eval task (not in `stuck`) that preempting makes room for, and
        its rank; the preemption's pauses go to `out`. One that cannot joins `stuck`."""
        s = self.host
        if s.admission_limit is not None and s.admission_limit <= 0:
            return None
        for t in s.queued_eval_heads():
            if t.task_id in stuck:
                continue
            r = self.rank_for(t, ranks)
            if r is None:
                stuck.add(t.task_id)
                continue
            out.extend(self.make_room(t, r))
            stuck.clear()
            return t, r
        return None
