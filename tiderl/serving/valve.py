"""CTB's release valve: parking tasks that wait on their environment. No JAX.

A task waiting on its environment holds KV budget but no compute (arXiv 2608.10402, §4). A
parked task is paused while it waits: its rank keeps its KV until pages are needed (the
lowest `keep_value` is evicted first), it holds no budget, and it is not resumed until its
environment answers. `CTBScheduler` runs this as the last step of a round; the methods here
use its accounting (`usage`, `_grown_usage`, `_fits`, `keep_value`, ...).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tiderl.serving.tasktable import Decision, Task

if TYPE_CHECKING:
    from tiderl.serving.ctb import CTBScheduler


class ReleaseValve:
    """Mixin of `CTBScheduler` (its methods take the scheduler as `self`): step 4 of a round."""

    def _park_for_demand(self: CTBScheduler, ranks: list[int], out: list[Decision]) -> bool:
        """4. The release valve. A task waiting on its environment holds KV budget but no
        compute (arXiv 2608.10402, §4): park such tasks (they keep their KV until pages are
        needed, the lowest `keep_value` evicted first, and hold no budget until their
        environment answers) when
        - a task that has its observation waits for room on a rank whose engine has time to
          spare (`park_below_busy`): it takes the room of waiting tasks, cheapest to let go
          first. On a saturated engine it waits for room instead: running it sooner adds no
          throughput there, and the parked tasks' KV, evicted when pages run short, would
          be computed again (measured on long contexts: more prefill and longer steps); or
        - nothing paused waits to come back, the rank's engine has time to spare
          (`park_below_busy`) and the tasks that would need the engine at any moment (each
          live task's share of time outside its environment, learned per type) would still
          fit its budget with the queue's next task: admitting it keeps the engine fed while
          others wait.
        Returns whether anything was parked (the caller then resumes and admits again)."""
        c = self.cfg
        if not c.park_below_busy or not ranks:
            return False
        ready = [t for t in self._paused.values() if t.ready and not t.is_eval]
        if ready:
            want = max(ready, key=lambda t: (self.priority(t), t.task_id))
            home = self.affinity(want)
            order = [r for r in ([home] if home in ranks else ranks) if self._idle(r)]
            return bool(order) and self._park_on(want, order, out, admit=False)
        if not self._n_queued or self._n_active >= c.env_concurrency or (
                self.admission_limit is not None and self.admission_limit <= 0) or not all(
                t.parked for t in self._paused.values()):
            return False
        head = self._queue_head()
        idle = [r for r in ranks if self._idle(r)]
        if head is None or not idle:
            return False
        return self._park_on(head, idle, out, admit=True)

    def _park_on(self: CTBScheduler, want: Task, order: list[int], out: list[Decision], *,
                 admit: bool) -> bool:
        """Parks waiting tasks on the first rank of `order` where that makes room for `want`
        (for a new task, `admit`, only while the expected demand still fits)."""
        c = self.cfg
        need = self._least_need(want)
        for r in order:
            if self.max_tasks_per_rank is not None and want.state != "active" and \
                    len(self._active[r]) >= self.max_tasks_per_rank:
                continue
            if admit and self.expected_demand(r) + self._share_outside(want) * \
                    self._planned(want) > self.budget(r):
                continue
            victims = sorted((t for t in self._active[r].values()
                              if self._parkable(t, self.cfg.park_min_wait if admit else 0.0)),
                             key=lambda t: (self.keep_value(t), t.task_id))
            # Room as admission and resumption count it: a new task must fit at everyone's
            # planned size (`_admit_fits`), a resumed one at current sizes (`_fits`).
            grown = admit and c.plan_growth and not want.is_eval
            room = self.limit(r) - (self._grown_usage(r) if grown else self.usage(r))
            if grown:
                need = self._marginal(r, want, self._grown_size(want))
            take: list[Task] = []
            for v in victims[:c.park_per_round]:
                if room >= need and (not admit or self._fits(want, r)):
                    break
                take.append(v)
                room += (self._grown_size(v) if grown else self.footprint(v)) + c.action_reserve
            if not take or room < need:
                continue
            for v in take:
                self._pause(v, r, out, park=True)
            return True
        return False

    def expected_demand(self: CTBScheduler, rank: int) -> float:
        """KV tokens the tasks of `rank` (active and parked there) need on average: each at
        its planned size (`_planned`) times its type's share of time outside its environment
        (learned; all of it before enough waits are known). A task waiting on its
        environment holds KV but needs none: this is what must fit for the ready ones not to
        queue for room."""
        total = 0.0
        share: dict[str, float] = {}
        for t in itertools.chain(self._active[rank].values(), (
                p for p in self._paused.values() if p.parked and p.rank == rank)):
            e = share.get(t.task_type)
            if e is None:
                e = share[t.task_type] = self._share_outside(t)
            total += e * self._planned(t)
        return total

    def _share_outside(self: CTBScheduler, t: Task) -> float:
        st = self.type_stats.get(t.task_type)
        wf = st.wait_fraction if st is not None and len(st.waits) >= self.cfg.wait_samples \
            else None
        return 1.0 - wf if wf is not None else 1.0

    def _planned(self: CTBScheduler, t: Task) -> int:
        """The KV `t` is planned to need: its projected final context with `plan_growth`."""
        size = self._grown_size(t) if self.cfg.plan_growth else self._probe_size(t)
        return size + self.cfg.action_reserve

    def _idle(self: CTBScheduler, rank: int) -> bool:
        """The rank's engine has time to spare (`park_below_busy`)."""
        return self.engine_busy[rank] < self.cfg.park_below_busy

    def _parkable(self: CTBScheduler, t: Task, min_wait: float) -> bool:
        # Before its first observation a task may not have called its environment yet (it
        # is woken by its admission): parked then, nothing would ever wake it.
        if t.is_eval or t.executing or t.ready or not t.turns or t.task_id in self._fresh or \
                t.task_id in self._resumed:
            return False
        rel = self.relative_wait(t)
        return rel is not None and rel >= min_wait

    def _queue_head(self: CTBScheduler) -> Task | None:
        for tids in itertools.islice(self.queue.values(), self.cfg.lookahead):
            if tids and not self._probing(self.tasks[tids[0]]):
                return self.tasks[tids[0]]
        return None
