"""Continuous Task Batching (arXiv 2608.10402, §4, Algorithm 1), and `make_scheduler`, which
also builds the request-level baseline (`tiderl.serving.vanilla`). No JAX. The task table both
schedulers keep is in `tiderl.serving.tasktable`, what they learn about task types
(environment waits, time outside the environment) in `taskstats`. CTB's release valve
(`valve.ReleaseValve`) and its eval preemption (`preempt.EvalPreemption`) are policies the
scheduler owns; each sees it through a small protocol of public methods (`ValveHost`,
`PreemptionHost`).

One scheduler sees every rollout rank. It holds no device state: ranks report usage, the
scheduler answers with decisions (`Admit`, `Pause`, `Resume`) that the ranks apply.

Token accounting. What each rank's active tasks need, its budget, the probe that sizes a
group and the growth admission plans with are in `tiderl.serving.ctb_usage` (`UsageTable`, the
scheduler's base): this module holds the round that decides from them.

Priority. `P(t) = w1·I_eval + w2·G_completion + w3·I_active + w4·L_context`, with L normalised to
[0, 1) by `max_context`. The weights must keep the tiers lexicographic (checked in CTBConfig).
Pausing and parking take the lowest `keep_value` first: the same tiers, a task with its
observation counted active, and the context tier weighing recompute against the task's
expected remaining environment wait (short contexts with long waits go first).

Pausing. A task inside its prefill/decode (`executing`) is never paused, by the budget or by a
preempting eval task: its turn finishes on its rank whatever the scheduler says, so pausing it
would resume it on another rank while the turn still runs. Its KV keeps counting; a rank left
over budget with only executing tasks is brought back once their turns end.

The release valve (parking). A task waiting on its environment holds KV but no compute. CTB
parks such tasks (paused, KV kept until pages are needed, no budget held, not resumed until
their environment answers) to give their room to a task that has its observation, or, while a
rank's engine has time to spare, to admit more work as long as what the live tasks need on
average still fits (see `ReleaseValve.park_for_demand`). A task with its observation waiting
for room goes before new tasks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from tiderl.configlib import ConfigError
from tiderl.serving.ctb_config import CTBConfig
from tiderl.serving.ctb_usage import UsageTable
from tiderl.serving.preempt import EvalPreemption
from tiderl.serving.tasktable import Admit, Decision, Pause, Resume, Task
from tiderl.serving.valve import ReleaseValve
from tiderl.serving.vanilla import VanillaScheduler

__all__ = ["Admit", "CTBConfig", "CTBScheduler", "Decision", "Pause", "Resume", "Task",
           "VanillaScheduler", "make_scheduler"]


class CTBScheduler(UsageTable):
    """Algorithm 1: per-rank token budgets, RL-aware priority, pause/resume, group affinity.

    It satisfies `ValveHost` and `PreemptionHost`: the public accounting of `UsageTable`
    (`usage`, `fits`, `marginal`, `grown_usage`, ...) and `pause` are what its policies use.
    """

    def __init__(self, cfg: CTBConfig, capacities: Iterable[int], *, max_context: int,
                 max_tasks_per_rank: int | None = None, page_size: int = 1):
        super().__init__(cfg, capacities, max_context=max_context,
                         max_tasks_per_rank=max_tasks_per_rank, page_size=page_size)
        self._now = 0.0
        self._resumed: set[str] = set()
        self.valve = ReleaseValve(self)
        """Step 4 of a round: parks tasks that wait on their environment."""
        self.preemption = EvalPreemption(self)
        """Makes room for eval tasks that fit nowhere."""

    def priority(self, t: Task) -> float:
        c = self.cfg
        return (c.w_eval * t.is_eval + c.w_group * self.completion(t.group_id)
                + c.w_active * (t.state == "active" and t.executing)
                + c.w_context * min(t.tokens / self.max_context, 0.999))

    def relative_wait(self, t: Task) -> float | None:
        """`t`'s expected remaining environment wait over its type's mean wait: 0 when it has
        its observation (executing or ready), None without enough samples of its type."""
        if t.executing or t.ready:
            return 0.0
        st = self.type_stats.get(t.task_type)
        if st is None or len(st.waits) < max(1, self.cfg.wait_samples):
            return None
        mean = st.waits.mean or 0.0
        rem = st.waits.remaining(self._now - t.since)
        return rem / mean if mean > 0 and rem is not None else None

    def keep_value(self, t: Task) -> float:
        """What keeping `t` resident is worth; pausing and parking take the lowest first.

        The priority tiers (eval > group completion > active > context), where a task that
        has its observation counts as active, and the lowest tier weighs recompute against
        the wait: a long context that will be needed soon is worth most, a short one whose
        environment will keep it waiting long is the cheapest to let go (arXiv 2608.10402,
        Table 1; its context term is this one with no wait known)."""
        c = self.cfg
        x = min(t.tokens / self.max_context, 0.999)
        rel = self.relative_wait(t)
        v = x / max(rel if rel is not None else 1.0, 1e-3)
        return (c.w_eval * t.is_eval + c.w_group * self.completion(t.group_id)
                + c.w_active * (t.executing or t.ready) + c.w_context * v / (1.0 + v))

    def affinity(self, t: Task) -> int | None:
        """The rank most likely to hold the task's KV or its group's shared prompt."""
        if t.rank is not None and t.rank not in self.dead:
            return t.rank
        counts: dict[int, int] = {}
        for tid in self.groups[t.group_id]:
            s = self.tasks[tid]
            if s.state == "active" and s.rank is not None:
                counts[s.rank] = counts.get(s.rank, 0) + 1
        return max(counts, key=lambda r: (counts[r], -r)) if counts else None

    def resume_rank(self, t: Task, ranks: list[int]) -> int:
        """The affinity rank when it has headroom, else the fitting rank with most headroom."""
        home = self.affinity(t)
        if home is not None and home in ranks and self.fits(t, home):
            return home
        return max((r for r in ranks if self.fits(t, r)),
                   key=lambda r: (self.budget(r) - self.usage(r), -r))

    def schedule(self) -> list[Decision]:
        """One scheduling round; returns the decisions in the order they must be applied."""
        out: list[Decision] = []
        self._fresh = set()
        self._resumed: set[str] = set()
        self._now = self.clock()
        for memo in self._admit_memo:  # sizes and stats may have changed since the last round
            if memo:
                memo.clear()
        ranks = self.live_ranks()
        # A round changes no capacity or busy share: each rank's budget is computed once.
        self._round_budgets = None
        self._round_budgets = [self.budget(r) for r in range(len(self.capacity))]
        try:
            self._pause_over_budget(ranks, out)
            self._resume_paused(ranks, out)
            self._admit_new(ranks, out)
            if self.valve.park_for_demand(ranks, out):
                self._resume_paused(ranks, out)
                self._admit_new(ranks, out)
        finally:
            self._round_budgets = None
        return out

    def pause(self, t: Task, rank: int, out: list[Decision], *, park: bool = False) -> None:
        """Pauses active `t` on `rank` (`park`: until its environment answers); the
        decision goes to `out`."""
        self._set_executing(t, False)
        self._move(t, "paused", rank)
        t.parked = park
        out.append(Pause(t.task_id, rank, park))

    def _pause_over_budget(self, ranks: list[int], out: list[Decision]) -> None:
        """1. Pause the lowest priority while a rank is over budget (never below one task).
        An executing task is never paused: its turn ends on this rank whatever we decide, and
        its KV keeps counting here. When only executing tasks are left the rank stays over
        budget until a later round (after `set_executing(..., False)`) can pause one."""
        own, prompts = self._own, self._prompt_sum
        for r in ranks:
            budget = self.budget(r)
            if self._dirty[r]:
                self._refresh(r)
            if own[r] + prompts[r] <= budget:  # `usage(r)`, inlined (every rank every round)
                continue
            active = self._active[r]
            # Pausing one task changes no other's value: one sort gives the order.
            victims = sorted((t for t in active.values() if not t.executing),
                             key=lambda t: (self.keep_value(t), t.task_id))
            for victim in victims:
                if len(active) <= 1 or self.usage(r) <= budget:
                    break
                self.pause(victim, r, out)

    def _resume_paused(self, ranks: list[int], out: list[Decision]) -> None:
        """2. Resume paused tasks, highest priority first, on their affinity rank when it fits.
        Eval tasks are anchored to weights and block the sync: one that fits nowhere preempts
        non-eval tasks on a rank where that makes room.

        A resume only takes room, so a task that did not qualify still does not: the scan goes
        on from where it is, and a task needing more than the best headroom is passed over
        without trying every rank. A preemption frees room: the scan starts over. It ends
        because evals are never preempted and each start-over resumes one more."""
        conc = self.cfg.env_concurrency
        # Parked tasks wait for their environment: with no other paused task there is none to
        # resume (and no headroom to compute).
        preempted = any(not t.parked for t in self._paused.values())
        while preempted:
            preempted = False
            head = self._best_headroom(ranks)
            found = [t for t in self._paused.values() if not t.parked and (t.is_eval or (
                head is not None and self._n_active < conc and self.least_need(t) <= head))]
            # Ready first (their environment answered: they want the engine now), within
            # their tier.
            found.sort(key=lambda t: (-self.priority(t) - self.cfg.w_active * t.ready,
                                      t.task_id))
            for t in found:
                if self._n_active < conc and head is not None and \
                        self.least_need(t) <= head and any(self.fits(t, r) for r in ranks):
                    self._resume(t, ranks, out)
                    head = self._best_headroom(ranks)
                    continue
                r = self.preemption.rank_for(t, ranks) if t.is_eval else None
                if r is not None:
                    out.extend(self.preemption.make_room(t, r))
                    self._resume(t, ranks, out)
                    preempted = True
                    break

    def joined_this_round(self, task_id: str) -> bool:
        """Admitted or resumed by the current round."""
        return task_id in self._fresh or task_id in self._resumed

    def _resume(self, t: Task, ranks: list[int], out: list[Decision]) -> None:
        self._resumed.add(t.task_id)
        rank = self.resume_rank(t, ranks)
        migrated = t.rank is None or t.rank != rank
        self._move(t, "active", rank)
        out.append(Resume(t.task_id, rank, migrated))

    def _admit_new(self, ranks: list[int], out: list[Decision]) -> None:
        """3. Admit new tasks while budgets, env concurrency and the staleness throttle allow.
        Paused tasks that fit somewhere were all resumed above, so none is overtaken. A new
        eval task that fits nowhere preempts non-eval tasks, as a paused one does; the tasks
        it paused are offered the other ranks before any new non-eval task. Evals go first,
        so a preempting eval never pauses a task admitted in this same round."""
        # Admissions only take room: an eval that cannot preempt now cannot later this round,
        # until a preemption frees some.
        stuck: set[str] = set()
        # A task that has its observation and waits for room (it did not fit above) goes
        # before new work: new tasks would take the room it needs, piece by piece.
        blocked = any(t.ready and not t.is_eval for t in self._paused.values())
        seen = len(out)
        while True:
            room = self._n_active < self.cfg.env_concurrency
            pick = self._pick_new(ranks, evals_only=True) if room and self._queued_evals \
                else None
            if pick is None and self._queued_evals:
                pick = self.preemption.pick_eval(ranks, out, stuck)
            if pick is None and any(isinstance(d, Pause) for d in out[seen:]):
                # Evals preempted tasks in this loop: like any paused task they go before new
                # work, on another rank if theirs is full now.
                self._resume_paused(ranks, out)
                seen = len(out)
                room = self._n_active < self.cfg.env_concurrency
                blocked = any(t.ready and not t.is_eval for t in self._paused.values())
            if pick is None and room and not blocked:
                pick = self._pick_new(ranks)
            if pick is None or not self._take_admission():
                break
            t, rank = pick
            self._dequeue(t, drop_empty=True)
            self._move(t, "active", rank)
            self._fresh.add(t.task_id)
            out.append(Admit(t.task_id, rank))

    def _pick_new(self, ranks: list[int], *, evals_only: bool = False
                  ) -> tuple[Task, int] | None:
        if evals_only:
            groups = [(gid, self.queue[gid]) for gid in self._eval_groups()]
        else:
            groups = list(itertools.islice(self.queue.items(), self.cfg.lookahead))
        options: list[tuple[str, Task, int]] = []
        for gid, tids in groups:
            if not tids or (evals_only and not self.tasks[tids[0]].is_eval):
                continue
            t = self.tasks[tids[0]]
            if self.probing(t):
                continue  # siblings wait for the probe's first turn to size them
            # Eval groups jump the queue; siblings go where the group already is.
            home = self.affinity(t)
            candidates = [home] if home is not None and self._admit_fits_now(t, home) else [
                r for r in ranks if self._admit_fits_now(t, r)]
            options.extend((gid, t, r) for r in candidates)
        if not options:
            return None
        # Scores count queue positions; eval groups may sit anywhere in the queue, so theirs
        # are looked up only when one can be admitted.
        pos = self._queue_positions({gid for gid, _, _ in options}) if evals_only else {
            gid: i for i, (gid, _) in enumerate(groups)}
        heads = {r: self.budget(r) - self.usage(r) for r in {r for _, _, r in options}}
        weight = self.cfg.diversity_weight
        best: tuple[float, Task, int] | None = None
        for gid, t, r in options:
            same = self._rank_groups[r].get(t.task_type, {})
            score = pos[gid] + weight * (len(same) - (gid in same)) - 1e6 * t.is_eval
            score -= 1e-6 * heads[r]  # ties: most headroom
            if best is None or score < best[0]:
                best = (score, t, r)
        assert best is not None
        return best[1], best[2]

    def queue_head(self) -> Task | None:
        """The next queued task admission would consider (within `lookahead` groups, past
        groups waiting for their probe); None when there is none."""
        for tids in itertools.islice(self.queue.values(), self.cfg.lookahead):
            if tids and not self.probing(self.tasks[tids[0]]):
                return self.tasks[tids[0]]
        return None


def make_scheduler(kind: str, cfg: CTBConfig, capacities: Iterable[int], *,
                   max_context: int, max_tasks_per_rank: int | None = None,
                   page_size: int = 1) -> CTBScheduler | VanillaScheduler:
    if kind == "ctb":
        return CTBScheduler(cfg, capacities, max_context=max_context,
                            max_tasks_per_rank=max_tasks_per_rank, page_size=page_size)
    if kind == "vanilla":
        return VanillaScheduler(cfg, capacities, max_context=max_context)
    raise ConfigError(f"config key 'rollout.scheduler'={kind!r}: use 'ctb' or 'vanilla'")
