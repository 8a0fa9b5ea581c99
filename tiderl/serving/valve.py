"""CTB's release valve: parking tasks that wait on their environment. No JAX.

A task waiting on its environment holds KV budget but no compute (arXiv 2608.10402, §4). A
parked task is paused while it waits: its rank keeps its KV until pages are needed (the
lowest `keep_value` is evicted first), it holds no budget, and it is not resumed until its
environment answers. `CTBScheduler` owns a `ReleaseValve` and runs it as the last step of a
round; the valve sees the scheduler only through `ValveHost`.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tiderl.serving.tasktable import Decision, Task

if TYPE_CHECKING:
    from tiderl.serving.ctb_config import CTBConfig
    from tiderl.serving.taskstats import TypeStats


@runtime_checkable
class ValveHost(Protocol):
    """What the release valve reads from and does to its scheduler (`CTBScheduler`)."""

    cfg: CTBConfig
    admission_limit: int | None
    max_tasks_per_rank: int | None
    engine_busy: list[float]
    type_stats: dict[str, TypeStats]

    # The task table.
    def n_active(self) -> int: ...
    def n_queued(self) -> int: ...
    def paused_tasks(self) -> Collection[Task]: ...
    def active_on(self, rank: int) -> list[Task]: ...
    def queue_head(self) -> Task | None: ...
    def joined_this_round(self, task_id: str) -> bool: ...

    # What tasks are worth.
    def priority(self, t: Task) -> float: ...
    def keep_value(self, t: Task) -> float: ...
    def relative_wait(self, t: Task) -> float | None: ...
    def affinity(self, t: Task) -> int | None: ...

    # Token accounting.
    def budget(self, rank: int) -> int: ...
    def limit(self, rank: int) -> int: ...
    def usage(self, rank: int) -> int: ...
    def grown_usage(self, rank: int) -> int: ...
    def marginal(self, rank: int, t: Task, size: int) -> int: ...
    def fits(self, t: Task, rank: int) -> bool: ...
    def least_need(self, t: Task) -> int: ...
    def footprint(self, t: Task) -> int: ...
    def probe_size(self, t: Task) -> int: ...
    def grown_size(self, t: Task) -> int: ...

    # The one action.
    def pause(self, t: Task, rank: int, out: list[Decision], *, park: bool = False) -> None: ...


class ReleaseValve:
    """Step 4 of a CTB round (`park_for_demand`), over the scheduler `host`."""

    def __init__(self, host: ValveHost):
        self.host = host

    def park_for_demand(self, ranks: list[int], out: list[Decision]) -> bool:
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
        Either way a task is parked only if its environment is expected to keep it away for
        at least the turn its room is parked for (the mean turn of `want`'s type, learned):
        one whose environment answers sooner would be back wanting room the other now
        holds, the room changing hands each round for nothing (on the simulator's validation
        job with 2 ms environment waits, parking without this rule gave 13% less goodput than
        no parking at all, with 40 times the forced evictions).
        Returns whether anything was parked (the caller then resumes and admits again)."""
        s = self.host
        c = s.cfg
        if not c.park_below_busy or not ranks:
            return False
        paused = s.paused_tasks()
        ready = [t for t in paused if t.ready and not t.is_eval]
        if ready:
            want = max(ready, key=lambda t: (s.priority(t), t.task_id))
            home = s.affinity(want)
            order = [r for r in ([home] if home in ranks else ranks) if self._idle(r)]
            return bool(order) and self._park_on(want, order, out, admit=False)
        if not s.n_queued() or s.n_active() >= c.env_concurrency or (
                s.admission_limit is not None and s.admission_limit <= 0) or not all(
                t.parked for t in paused):
            return False
        head = s.queue_head()
        idle = [r for r in ranks if self._idle(r)]
        if head is None or not idle:
            return False
        return self._park_on(head, idle, out, admit=True)

    def _park_on(self, want: Task, order: list[int], out: list[Decision], *,
                 admit: bool) -> bool:
        """Parks waiting tasks on the first rank of `order` where that makes room for `want`
        (for a new task, `admit`, only while the expected demand still fits)."""
        s = self.host
        c = s.cfg
        need = s.least_need(want)
        for r in order:
            active = s.active_on(r)
            if s.max_tasks_per_rank is not None and want.state != "active" and \
                    len(active) >= s.max_tasks_per_rank:
                continue
            hold = self._turn_s(want)
            victims = [t for t in active
                       if self._parkable(t, c.park_min_wait if admit else 0.0, hold)]
            # Nothing to park is the common answer: it goes before the demand sum.
            if not victims or admit and self.expected_demand(r) + self._share_outside(
                    want) * self._planned(want) > s.budget(r):
                continue
            victims.sort(key=lambda t: (s.keep_value(t), t.task_id))
            # Room as admission and resumption count it: a new task must fit at everyone's
            # planned size (the scheduler's admission check), a resumed one at current sizes
            # (`fits`).
            grown = admit and c.plan_growth and not want.is_eval
            room = s.limit(r) - (s.grown_usage(r) if grown else s.usage(r))
            if grown:
                need = s.marginal(r, want, s.grown_size(want))
            take: list[Task] = []
            for v in victims[:c.park_per_round]:
                if room >= need and (not admit or s.fits(want, r)):
                    break
                take.append(v)
                room += (s.grown_size(v) if grown else s.footprint(v)) + c.action_reserve
            if not take or room < need:
                continue
            for v in take:
                s.pause(v, r, out, park=True)
            return True
        return False

    def expected_demand(self, rank: int) -> float:
        """KV tokens the tasks of `rank` (active and parked there) need on average: each at
        its planned size (`_planned`) times its type's share of time outside its environment
        (learned; all of it before enough waits are known). A task waiting on its
        environment holds KV but needs none: this is what must fit for the ready ones not to
        queue for room."""
        s = self.host
        total = 0.0
        share: dict[str, float] = {}
        for t in itertools.chain(s.active_on(rank), (
                p for p in s.paused_tasks() if p.parked and p.rank == rank)):
            e = share.get(t.task_type)
            if e is None:
                e = share[t.task_type] = self._share_outside(t)
            total += e * self._planned(t)
        return total

    def _share_outside(self, t: Task) -> float:
        s = self.host
        st = s.type_stats.get(t.task_type)
        wf = st.wait_fraction if st is not None and len(st.waits) >= s.cfg.wait_samples \
            else None
        return 1.0 - wf if wf is not None else 1.0

    def _planned(self, t: Task) -> int:
        """The KV `t` is planned to need: its projected final context with `plan_growth`."""
        s = self.host
        size = s.grown_size(t) if s.cfg.plan_growth else s.probe_size(t)
        return size + s.cfg.action_reserve

    def _idle(self, rank: int) -> bool:
        """The rank's engine has time to spare (`park_below_busy`)."""
        return self.host.engine_busy[rank] < self.host.cfg.park_below_busy

    def _turn_s(self, t: Task) -> float:
        """How long `t`'s turns execute (its type's mean; 0 before the first)."""
        st = self.host.type_stats.get(t.task_type)
        return st.turn_s if st is not None and st.turns else 0.0

    def _parkable(self, t: Task, min_wait: float, hold: float = 0.0) -> bool:
        """`t` waits on its environment and is expected to for at least `min_wait` of its
        type's mean wait and at least `hold` seconds (the turn its room is parked for)."""
        # Before its first observation a task may not have called its environment yet (it
        # is woken by its admission): parked then, nothing would ever wake it.
        if t.is_eval or t.executing or t.ready or not t.turns or \
                self.host.joined_this_round(t.task_id):
            return False
        rel = self.host.relative_wait(t)
        if rel is None or rel < min_wait:
            return False
        if hold <= 0:
            return True
        mean = self.host.type_stats[t.task_type].waits.mean  # known: `rel` is not None
        return mean is not None and rel * mean >= hold
