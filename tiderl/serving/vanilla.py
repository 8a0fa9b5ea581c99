"""The request-level baseline: continuous batching with a fixed cap on tasks in flight. No
JAX. (`tiderl.serving.ctb.make_scheduler` builds it.)
"""

from __future__ import annotations

from tiderl.serving.tasktable import Admit, Decision, Resume, Task, TaskTable


class VanillaScheduler(TaskTable):
    """Request-level continuous batching: a fixed cap on tasks in flight, no pausing.

    Memory is not planned: a rank that runs out of pages evicts the KV of waiting tasks (LRU)
    and re-prefills them when their observation returns (the rank does that, not this class).
    """

    def priority(self, t: Task) -> float:
        return 0.0

    def schedule(self) -> list[Decision]:
        out: list[Decision] = []
        ranks = self.live_ranks()
        cap = min(self.cfg.vanilla_concurrency, self.cfg.env_concurrency)

        def least_loaded() -> int:
            return min(ranks, key=lambda r: (len(self._active[r]), r))

        for t in sorted(self._paused.values(), key=lambda t: t.task_id):  # off a dead rank
            if self._n_active >= cap or not ranks:
                break
            rank = least_loaded()
            self._move(t, "active", rank)
            out.append(Resume(t.task_id, rank, True))
        while self._n_active < cap and self.phases.queued and ranks and self._take_admission():
            gid, tids = next(iter(self.queue.items()))
            while not tids:  # a group whose queued tasks were all finished before admission
                self._unqueue_group(gid)
                gid, tids = next(iter(self.queue.items()))
            t = self.tasks[tids[0]]
            self._dequeue(t, drop_empty=True)
            rank = least_loaded()
            self._move(t, "active", rank)
            out.append(Admit(t.task_id, rank))
        return out
