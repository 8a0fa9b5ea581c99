"""The task table's indexes and their upkeep. No JAX.

A round makes many decisions over thousands of tasks, so what a decision reads is kept in
indexes: the active tasks of each rank, the paused tasks, the queue's size and eval groups, live
tasks per type, the groups per rank and type, and the probes of each type. Every change of a
task's state or rank goes through `_move`, of its flag through `_set_executing`, of the queue
through `_dequeue` and `_unqueue_group` and of the probes through `_add_probe` and
`_drop_probe`; `_check_indexes` recomputes every index from the tasks to prove they cannot
drift. A mixin (`TaskTable`'s base) so `tasktable.py` stays about what the schedulers ask of the
table; it reads the table's state (`tasks`, `groups`, `queue`, `group_probe`, `capacity`,
`dead`, `phases` and the private indexes `TaskTable.__init__` makes) and calls its phase
tracking (`phase`, `_phase_change`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from tiderl.serving.taskrecords import LIVE_STATES, State, Task

if TYPE_CHECKING:
    from tiderl.serving.taskstats import PhaseOccupancy


class TaskIndexes:
    """The indexes' upkeep and check of `TaskTable` (see the module docstring)."""

    tasks: dict[str, Task]
    groups: dict[str, list[str]]
    queue: OrderedDict[str, list[str]]
    group_probe: dict[str, int]
    capacity: list[int]
    dead: set[int]
    phases: PhaseOccupancy
    _active: list[dict[str, Task]]
    _n_active: int
    _paused: dict[str, Task]
    _queue_seq: dict[str, int]
    _queued_evals: dict[str, int]
    _live_by_type: dict[str, int]
    _group_type: dict[str, str]
    _type_probes: dict[str, dict[str, int]]
    _type_probe_max: dict[str, int]
    _rank_groups: list[dict[str, dict[str, int]]]
    _dirty: list[bool]

    def _move(self, t: Task, state: State, rank: int | None) -> None:
        """The only place a task's state or rank changes."""
        if (t.state in LIVE_STATES) != (state in LIVE_STATES):
            self._phase_change(t, lambda: self._move_to(t, state, rank))
        else:
            self._move_to(t, state, rank)

    def _move_to(self, t: Task, state: State, rank: int | None) -> None:
        old = t.state
        if state != "paused":
            t.parked = False
        if old == "active":
            self._leave(t)
        elif old == "paused" and state != "paused":
            del self._paused[t.task_id]
        if (old in LIVE_STATES) != (state in LIVE_STATES):
            n = self._live_by_type.get(t.task_type, 0) + (1 if state in LIVE_STATES else -1)
            if n:
                self._live_by_type[t.task_type] = n
            else:
                del self._live_by_type[t.task_type]
        t.state, t.rank = state, rank
        if state == "active":
            self._join(t)
        elif state == "paused":
            self._paused[t.task_id] = t

    def _join(self, t: Task) -> None:
        r = t.rank
        assert r is not None
        self._active[r][t.task_id] = t
        self._n_active += 1
        groups = self._rank_groups[r].setdefault(t.task_type, {})
        groups[t.group_id] = groups.get(t.group_id, 0) + 1
        self._load_join(r, t)

    def _leave(self, t: Task) -> None:
        r = t.rank
        assert r is not None
        del self._active[r][t.task_id]
        self._n_active -= 1
        groups = self._rank_groups[r][t.task_type]
        groups[t.group_id] -= 1
        if not groups[t.group_id]:
            del groups[t.group_id]
            if not groups:
                del self._rank_groups[r][t.task_type]
        self._load_leave(r, t)

    def _load_join(self, rank: int, t: Task) -> None:
        """Hook: `t` became active on `rank` (CTB keeps the rank's usage current)."""

    def _load_leave(self, rank: int, t: Task) -> None:
        """Hook: `t` stopped being active on `rank`."""

    def _set_executing(self, t: Task, executing: bool) -> None:
        # Not indexed: it changes neither usage nor any set; rounds read it from the task.
        if t.executing == executing and not (executing and t.ready):
            return

        def change():
            t.executing = executing
            t.ready = t.ready and not executing

        self._phase_change(t, change)

    def _dequeue(self, t: Task, *, drop_empty: bool) -> None:
        tids = self.queue[t.group_id]
        tids.remove(t.task_id)
        self.phases.queue(self.clock(), -1)
        if t.is_eval:
            left = self._queued_evals[t.group_id] - 1
            if left:
                self._queued_evals[t.group_id] = left
            else:
                del self._queued_evals[t.group_id]
        if drop_empty and not tids:
            self._unqueue_group(t.group_id)

    def _unqueue_group(self, group_id: str) -> None:
        del self.queue[group_id], self._queue_seq[group_id]

    def _eval_groups(self) -> list[str]:
        """The groups holding queued eval tasks, in queue order."""
        return sorted(self._queued_evals, key=self._queue_seq.__getitem__)

    def _queue_positions(self, group_ids: set[str]) -> dict[str, int]:
        pos: dict[str, int] = {}
        for i, gid in enumerate(self.queue):
            if gid in group_ids:
                pos[gid] = i
                if len(pos) == len(group_ids):
                    break
        return pos

    def _add_probe(self, group_id: str, tokens: int) -> None:
        self.group_probe[group_id] = tokens
        for tid in self.groups[group_id]:  # siblings share the prompt the probe reported
            s = self.tasks[tid]
            if not s.prompt_tokens:
                s.prompt_tokens = s.tokens = max(s.tokens, tokens)
                if s.state == "active":
                    self._dirty[s.rank] = True
        kind = self._group_type[group_id]
        self._type_probes.setdefault(kind, {})[group_id] = tokens
        top = self._type_probe_max.get(kind)
        if top is None or tokens > top:
            # Unmeasured tasks of every group of this type without a probe are sized by it.
            self._type_probe_max[kind] = tokens
            self._dirty = [True] * len(self._dirty)
            return
        for tid in self.groups[group_id]:  # its own unmeasured tasks switch to it
            s = self.tasks[tid]
            if s.state == "active":
                self._dirty[s.rank] = True

    def _drop_probe(self, group_id: str) -> None:
        probe = self.group_probe.pop(group_id, None)
        kind = self._group_type.pop(group_id)
        if probe is None:
            return
        probes = self._type_probes[kind]
        del probes[group_id]
        top = max(probes.values()) if probes else None
        if top != self._type_probe_max[kind]:
            if top is None:
                del self._type_probes[kind], self._type_probe_max[kind]
            else:
                self._type_probe_max[kind] = top
            self._dirty = [True] * len(self._dirty)

    def _check_indexes(self) -> None:
        """Recomputes every index from the tasks and raises AssertionError on a mismatch."""

        def expect(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"scheduler index out of step: {what}")

        n = len(self.capacity)
        active: list[dict[str, Task]] = [{} for _ in range(n)]
        rank_groups: list[dict[str, dict[str, int]]] = [{} for _ in range(n)]
        paused: set[str] = set()
        live: dict[str, int] = {}
        for tid, t in self.tasks.items():
            expect(t.task_id == tid, f"task {tid!r} is stored under another id")
            if t.state == "active":
                expect(t.rank is not None and t.rank not in self.dead,
                       f"active task {tid!r} has no live rank ({t.rank})")
                active[t.rank][tid] = t
                g = rank_groups[t.rank].setdefault(t.task_type, {})
                g[t.group_id] = g.get(t.group_id, 0) + 1
            elif t.state == "paused":
                paused.add(tid)
            if t.state in LIVE_STATES:
                live[t.task_type] = live.get(t.task_type, 0) + 1
        for r in range(n):
            expect(self._active[r].keys() == active[r].keys(), f"active set of rank {r}")
            expect(all(self._active[r][tid] is t for tid, t in active[r].items()),
                   f"rank {r} indexes a stale Task object")
        expect(self._n_active == sum(map(len, active)), "active count")
        expect(self._paused.keys() == paused, "paused set")
        expect(all(self._paused[tid] is self.tasks[tid] for tid in paused), "paused objects")
        expect(self._live_by_type == live, "live tasks per type")
        expect(self._rank_groups == rank_groups, "groups per rank and type")
        queued = [tid for tids in self.queue.values() for tid in tids]
        expect(len(queued) == len(set(queued)) == self.phases.queued, "queued count")
        expect(set(queued) == {tid for tid, t in self.tasks.items() if t.state == "new"},
               "queue holds exactly the new tasks")
        expect(sorted(self._queue_seq, key=self._queue_seq.__getitem__) == list(self.queue),
               "queue order")
        evals = {g: k for g, tids in self.queue.items()
                 if (k := sum(self.tasks[tid].is_eval for tid in tids))}
        expect(self._queued_evals == evals, "queued eval tasks per group")
        kinds = {g: self.tasks[tids[0]].task_type for g, tids in self.groups.items()}
        expect(self._group_type == kinds, "group types")
        probes: dict[str, dict[str, int]] = {}
        for g, p in self.group_probe.items():
            probes.setdefault(kinds[g], {})[g] = p
        expect(self._type_probes == probes, "probes per type")
        expect(self._type_probe_max == {k: max(v.values()) for k, v in probes.items()},
               "largest probe per type")
        phases = dict.fromkeys(self.phases.counts, 0)
        for t in self.tasks.values():
            if (ph := self.phase(t)) is not None:
                phases[ph] += 1
        expect(self.phases.counts == phases, f"phase counts {self.phases.counts} != {phases}")
