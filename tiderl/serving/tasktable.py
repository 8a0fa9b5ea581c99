"""The schedulers' task table: tasks, groups, the queue and per-rank indexes. No JAX.

Shared by CTB (`tiderl.serving.ctb`) and the request-level baseline (`vanilla`). A round
makes many decisions over thousands of tasks, so nothing a decision reads may rescan every
task: the active tasks of each rank, the paused tasks, the queue's size and eval groups, live
tasks per type and the probes of each type are indexes kept up to date. The task and decision
records are in `taskrecords.py`, the indexes' upkeep and check in `taskindex.py` (the
TaskIndexes mixin TaskTable inherits); this module re-exports the records.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from tiderl.serving.taskindex import TaskIndexes
from tiderl.serving.taskrecords import LIVE_STATES, Admit, Decision, Pause, Resume, State, Task
from tiderl.serving.taskstats import PhaseOccupancy, TypeStats

if TYPE_CHECKING:
    from tiderl.serving.ctb_config import CTBConfig

__all__ = ["LIVE_STATES", "Admit", "Decision", "Pause", "Resume", "State", "Task", "TaskTable"]


class TaskTable(TaskIndexes):
    """Bookkeeping shared by CTB and the vanilla baseline.

    A round makes many decisions over thousands of tasks, so nothing a decision reads may
    rescan every task: the active tasks of each rank, the paused tasks, the queue's size and
    eval groups, live tasks per type and the probes of each type are indexes kept up to date.
    Every change of a task's state or rank goes through `_move`, of its flag through
    `_set_executing` and of its size through `update_usage`, so the indexes cannot drift from
    the tasks; `_check_indexes` recomputes them from scratch to prove it.
    """

    def __init__(self, cfg: CTBConfig, capacities: Iterable[int], *, max_context: int,
                 max_tasks_per_rank: int | None = None):
        self.cfg = cfg
        self.capacity = list(capacities)
        self.max_tasks_per_rank = max_tasks_per_rank
        """Engine slots per rank: a resident task holds one while it waits on its env."""
        self.max_context = max_context
        self.tasks: dict[str, Task] = {}
        self.groups: dict[str, list[str]] = {}
        self.queue: OrderedDict[str, list[str]] = OrderedDict()  # group -> unadmitted task ids
        self.group_done: dict[str, int] = {}
        self.group_probe: dict[str, int] = {}
        self.final_context: dict[str, tuple[int, int]] = {}
        """Per task type: (sum, count) of the context lengths finished tasks reached."""
        self.growth: dict[str, tuple[int, int]] = {}
        """Per task type: (sum, count) of context growth between consecutive turns."""
        self._stats_version = 0
        """Bumped whenever projected growth may change (growth, final contexts, horizon)."""
        self._horizon_turns: int | None = None
        self._fresh: set[str] = set()
        """Tasks admitted in the current round: never preempted in the same round."""
        self.dead: set[int] = set()
        self.admission_limit: int | None = None
        n = len(self.capacity)
        self._active: list[dict[str, Task]] = [{} for _ in range(n)]
        self._n_active = 0
        self._paused: dict[str, Task] = {}
        self._queue_seq: dict[str, int] = {}
        """Group -> when it joined the queue: orders eval groups without walking the queue."""
        self._queue_count = itertools.count()
        self._queued_evals: dict[str, int] = {}
        """Group -> its queued eval tasks; empty lets admission skip the eval scan."""
        self._live_by_type: dict[str, int] = {}
        """Task type -> its active and paused tasks (the probe waits while one is out)."""
        self._group_type: dict[str, str] = {}
        """Group -> the type of its first task (what `estimate` matches groups by)."""
        self._type_probes: dict[str, dict[str, int]] = {}
        self._type_probe_max: dict[str, int] = {}
        self._rank_groups: list[dict[str, dict[str, int]]] = [{} for _ in range(n)]
        """Per rank: task type -> group -> its active tasks there (admission's diversity)."""
        self._dirty = [True] * n
        """Per rank: its cached usage is stale (CTB recomputes it on the next read)."""
        self.engine_busy = [1.0] * n
        """Per rank: the recent share of time its engine worked (the runner keeps it current;
        CTB parks waiting tasks only on a rank with time to spare)."""
        self.clock: Callable[[], float] = time.monotonic
        """Seconds; the runner sets its event loop's clock (virtual time in the simulator)."""
        self.type_stats: dict[str, TypeStats] = {}
        """Per task type: environment waits and compute per turn, learned online."""
        self.phases = PhaseOccupancy(self.clock())
        """How many live tasks execute, are ready, or wait on their environment (and since
        when, integrated: per-step averages)."""

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Measures phases and waits on `clock` (the runner's event loop time) from now on."""
        self.clock = clock
        now = clock()
        self.phases.rebase(now)
        for t in self.tasks.values():
            t.since = now

    @property
    def horizon_turns(self) -> int | None:
        """Turn limit of an episode (the runner sets it); bounds projected growth."""
        return self._horizon_turns

    @horizon_turns.setter
    def horizon_turns(self, n: int | None) -> None:
        self._horizon_turns = n
        self._stats_version += 1

    # -- inputs -------------------------------------------------------------------------------
    def submit(self, tasks: Iterable[Task]) -> None:
        for t in tasks:
            if t.task_id in self.tasks:
                raise ValueError(f"task {t.task_id!r} submitted twice")
            if t.state != "new":
                raise ValueError(f"task {t.task_id!r} is submitted in state {t.state!r}; "
                                 "submit a fresh Task (state 'new')")
            self.tasks[t.task_id] = t
            if t.group_id not in self.groups:
                self.groups[t.group_id] = []
                self._group_type[t.group_id] = t.task_type
            self.groups[t.group_id].append(t.task_id)
            self.group_done.setdefault(t.group_id, 0)
            if t.group_id not in self.queue:
                self._queue_seq[t.group_id] = next(self._queue_count)
                self.queue[t.group_id] = []
            self.queue[t.group_id].append(t.task_id)
            self.phases.queue(self.clock(), 1)
            if t.is_eval:
                self._queued_evals[t.group_id] = self._queued_evals.get(t.group_id, 0) + 1

    def update_usage(self, task_id: str, tokens: int, *, executing: bool | None = None,
                     ready: bool = False) -> None:
        """Called once per turn with the task's context length for that turn: when its
        environment answered (`ready=True`: it wants the engine now), or when the turn starts
        (`executing=True`)."""
        t = self.tasks[task_id]
        was = (t.tokens, t.measured, t.prompt_tokens)
        if ready or executing:
            self._env_answered(t)
        if t.measured and tokens > t.tokens:
            total, n = self.growth.get(t.task_type, (0, 0))
            self.growth[t.task_type] = (total + tokens - t.tokens, n + 1)
            self._stats_version += 1
        if not t.measured and not t.prompt_tokens:
            t.prompt_tokens = tokens  # a task's first report is its prompt
        t.tokens, t.measured = tokens, True
        t.turns += 1
        if t.state == "active":
            self._resized(t, *was)
        if executing is not None:
            self._set_executing(t, executing)
        if t.group_id not in self.group_probe:
            self._add_probe(t.group_id, tokens)

    def restart_context(self, task_id: str) -> None:
        """The task's context was cut and continues from a fresh prefill that does not start
        with its group's prompt (the rollout's sliding image window): none of it counts as
        shared with its siblings any more; its new size comes with its next `update_usage`."""
        t = self.tasks[task_id]
        t.prompt_tokens = 0
        if t.state == "active":
            self._dirty[t.rank] = True

    def _resized(self, t: Task, tokens: int, measured: bool, prompt_tokens: int) -> None:
        """Active `t` reported a new size (it had `tokens`, `measured`, `prompt_tokens`): its
        rank's cached usage is stale (a scheduler that can update it in place does)."""
        self._dirty[t.rank] = True

    def set_executing(self, task_id: str, executing: bool) -> None:
        """A turn starts (True) or ends (False: the task now waits on its environment)."""
        t = self.tasks[task_id]
        if executing:
            self._env_answered(t)
        elif t.executing and t.state in LIVE_STATES:
            now = self.clock()
            self._stats(t).add_compute(now - t.answered, now - t.since)
        self._set_executing(t, executing)

    def set_ready(self, task_id: str) -> None:
        """The task's environment answered and it wants its next turn (its size is reported
        with the turn's `update_usage`)."""
        self._env_answered(self.tasks[task_id])

    def _env_answered(self, t: Task) -> None:
        if t.state in LIVE_STATES and not t.executing and not t.ready:
            now = self.clock()
            self._stats(t).waits.add(now - t.since)
            t.answered = now
            self._phase_change(t, lambda: setattr(t, "ready", True))
        t.parked = False

    def _stats(self, t: Task) -> TypeStats:
        st = self.type_stats.get(t.task_type)
        if st is None:
            st = self.type_stats[t.task_type] = TypeStats()
        return st

    def phase(self, t: Task) -> str | None:
        """'executing', 'ready' or 'waiting' (on its environment) for a live task, else None."""
        if t.state not in LIVE_STATES:
            return None
        return "executing" if t.executing else "ready" if t.ready else "waiting"

    def _phase_change(self, t: Task, change: Callable[[], None]) -> None:
        old = self.phase(t)
        change()
        new = self.phase(t)
        if new != old:
            now = self.clock()
            self.phases.move(now, old, new)
            t.since = now

    def finish(self, task_id: str) -> None:
        t = self.tasks[task_id]
        if t.state == "done":
            return
        if t.state == "new":
            self._dequeue(t, drop_empty=False)
        if t.measured:
            total, n = self.final_context.get(t.task_type, (0, 0))
            self.final_context[t.task_type] = (total + t.tokens, n + 1)
            self._stats_version += 1
        self._set_executing(t, False)
        self._move(t, "done", t.rank)
        self.group_done[t.group_id] += 1
        if self.group_done[t.group_id] == len(self.groups[t.group_id]):
            # The whole group is over: forget it (long runs would otherwise grow without bound).
            for tid in self.groups.pop(t.group_id):
                del self.tasks[tid]
            del self.group_done[t.group_id]
            self._drop_probe(t.group_id)
            if t.group_id in self.queue:
                self._unqueue_group(t.group_id)

    def set_admission_limit(self, n: int | None) -> None:
        """Staleness throttle from the controller: how many more tasks may start (None: any)."""
        self.admission_limit = n

    def remove_rank(self, rank: int) -> list[str]:
        """Takes `rank` out (quarantined, or drained by ERS); its tasks become paused with no
        residency (they re-prefill elsewhere)."""
        self.dead.add(rank)
        moved = []
        for t in self.tasks.values():
            if t.rank == rank and t.state in LIVE_STATES:
                was = t.executing
                self._set_executing(t, False)
                self._move(t, "paused", None)
                if was:  # its turn must run again elsewhere: it wants the engine now
                    self._phase_change(t, lambda t=t: setattr(t, "ready", True))
                moved.append(t.task_id)
        return moved

    def add_rank(self, rank: int, capacity: int | None = None) -> None:
        """Revives rank slot `rank` (ERS gave its cell back to rollout; it starts empty), with
        the KV `capacity` (tokens) of the engine that now serves it when given."""
        if not 0 <= rank < len(self.capacity):
            raise ValueError(f"rank {rank} has no slot (the scheduler has "
                             f"{len(self.capacity)}); size it for every rank a cell can serve")
        if capacity is not None:
            self.capacity[rank] = int(capacity)
        if rank in self.dead:
            self.dead.discard(rank)
            self._dirty[rank] = True

    def flush(self) -> None:
        """Weight sync: every rank's KV is stale, so paused tasks lose their residency."""
        for t in list(self._paused.values()):
            self._move(t, "paused", None)

    # -- views --------------------------------------------------------------------------------
    def live_ranks(self) -> list[int]:
        return [r for r in range(len(self.capacity)) if r not in self.dead]

    def active_on(self, rank: int) -> list[Task]:
        return list(self._active[rank].values())

    def n_active(self) -> int:
        return self._n_active

    def pending(self) -> int:
        return self.phases.queued + len(self._paused)

    def n_paused(self) -> int:
        return len(self._paused)

    def n_queued(self) -> int:
        """Tasks submitted and not admitted yet."""
        return self.phases.queued

    def paused_tasks(self) -> Collection[Task]:
        """The paused tasks (a live view: do not pause or resume while iterating it)."""
        return self._paused.values()

    def queued_eval_heads(self) -> list[Task]:
        """The first queued task of each group holding queued eval tasks, where that task
        is an eval task, in queue order."""
        heads = []
        for gid in self._eval_groups():
            tids = self.queue[gid]
            if tids and self.tasks[tids[0]].is_eval:
                heads.append(self.tasks[tids[0]])
        return heads

    def admitted_this_round(self, task_id: str) -> bool:
        """Admitted by the current scheduling round (it has not started yet)."""
        return task_id in self._fresh

    def completion(self, group_id: str) -> float:
        return self.group_done[group_id] / len(self.groups[group_id])

    def _take_admission(self) -> bool:
        if self.admission_limit is None:
            return True
        if self.admission_limit <= 0:
            return False
        self.admission_limit -= 1
        return True
