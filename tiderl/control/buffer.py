"""ReadinessBuffer: finished groups → advantages → trainable sequences, with the readiness
signals the paper schedules by (RAS, TPRM, head-of-line latency, deficits). No JAX.

A group becomes ready when all its G tasks have ended. Tasks that failed in the environment
(`env_error`, `timeout`, `cancelled`) carry no verdict: the group trains on the others when at
least `min_ok_per_group` ended with one, else the whole group is dropped (both counted).
Advantages are group-normalised over the tasks kept. Staleness is judged when the trainer takes
a group: one whose oldest token is more than `max_staleness` versions behind the version being
trained is dropped and counted, never silently trained on.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiderl.serving.rollout import Trajectory
from tiderl.train.advantages import group_advantages
from tiderl.train.dispatch import Trajectory as TrainSeq


@dataclasses.dataclass
class ReadyGroup:
    group_id: str
    seqs: list[TrainSeq]
    trajs: list[Trajectory]
    ready_at: float
    min_version: int
    action_tokens: int
    reward_mean: float


@dataclasses.dataclass
class Readiness:
    """Signals at the start of a step and over it (arXiv 2608.10402, §5)."""

    ras: int = 0
    """Ready-at-start: micro-batches of work ready when the step began."""
    tprm: float = float("inf")
    """Mean seconds between further micro-batches becoming ready during the step."""
    hol_s: float = 0.0
    """Age of the oldest ready group when the step began."""
    generation_deficit: bool = False
    consumption_deficit: bool = False


class ReadinessBuffer:
    """Holds ready groups in arrival order and accounts for everything it drops."""

    def __init__(self, *, groups_per_microbatch: int, max_staleness: int, min_ok_per_group: int,
                 zero_var: str = "drop", adv_eps: float = 1e-6, hol_tau: float = 1.0):
        self.groups_per_microbatch = groups_per_microbatch
        self.max_staleness = max_staleness
        self.min_ok = min_ok_per_group
        self.zero_var = zero_var
        self.adv_eps = adv_eps
        self.hol_tau = hol_tau
        self.ready: deque[ReadyGroup] = deque()
        self.dropped: Counter[str] = Counter()
        self.drops_in_a_row = 0
        """Groups dropped since the last one that became trainable."""
        self.failed_tasks: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self._uids = itertools.count()
        self._arrivals: list[float] = []
        self._step_t0: float | None = None

    # -- producer side -------------------------------------------------------------------------
    def add_group(self, trajs: Sequence[Trajectory], *, now: float) -> ReadyGroup | None:
        """A finished group; returns it when it is trainable, None when it was dropped."""
        ok = [t for t in trajs if t.ok]
        for t in trajs:
            if not t.ok:
                self.failed_tasks[str(t.end_reason)] += 1
        gid = trajs[0].group_id if trajs else "?"
        if len(ok) < self.min_ok:
            self.dropped["failed_tasks"] += 1
            self.drops_in_a_row += 1
            return None
        adv = group_advantages([[t.reward for t in ok]], eps=self.adv_eps, zero_var=self.zero_var)
        if not adv.keep[0]:
            self.dropped["zero_variance"] += 1
            self.drops_in_a_row += 1
            return None
        seqs = [TrainSeq(uid=next(self._uids), tokens=np.asarray(t.tokens, np.int32),
                         action_mask=np.asarray(t.loss_mask, bool),
                         behaviour_logprobs=np.asarray(t.logprobs, np.float32),
                         advantage=float(a), versions=np.asarray(t.versions, np.int32))
                for t, a in zip(ok, adv.advantages[0], strict=True)]
        g = ReadyGroup(group_id=gid, seqs=seqs, trajs=list(ok), ready_at=now,
                       min_version=min((t.min_version for t in ok if t.min_version >= 0),
                                       default=-1),
                       action_tokens=sum(t.action_token_count for t in ok),
                       reward_mean=float(np.mean([t.reward for t in ok])))
        self.ready.append(g)
        self.drops_in_a_row = 0
        if self._step_t0 is not None:
            self._arrivals.append(now)
        return g

    # -- consumer side -------------------------------------------------------------------------
    def begin_step(self, now: float, *, step_time: float, batch_ideal: int) -> Readiness:
        """Snapshot of the readiness signals as a training step starts."""
        self._step_t0 = now
        self._arrivals = []
        ras = len(self.ready) // self.groups_per_microbatch
        hol = now - self.ready[0].ready_at if self.ready else 0.0
        return Readiness(
            ras=ras, hol_s=hol,
            generation_deficit=len(self.ready) < batch_ideal,
            consumption_deficit=bool(step_time) and hol > self.hol_tau * step_time,
        )

    def end_step(self, r: Readiness) -> Readiness:
        """Adds TPRM (seconds per micro-batch that became ready during the step)."""
        n_mb = len(self._arrivals) / self.groups_per_microbatch
        if n_mb >= 1 and self._step_t0 is not None:
            r.tprm = (self._arrivals[-1] - self._step_t0) / n_mb
        self._step_t0 = None
        return r

    def take(self, n: int, *, train_version: int) -> list[ReadyGroup]:
        """Up to `n` ready groups, oldest first, dropping the too-stale ones (counted)."""
        out: list[ReadyGroup] = []
        while self.ready and len(out) < n:
            g = self.ready.popleft()
            staleness = train_version - g.min_version if g.min_version >= 0 else 0
            if staleness > self.max_staleness:
                self.dropped["stale"] += 1
                continue
            self.staleness_hist[staleness] += 1
            out.append(g)
        return out

    def __len__(self) -> int:
        return len(self.ready)

    def summary(self) -> dict[str, Any]:
        return {"ready_groups": len(self.ready), "dropped": dict(self.dropped),
                "failed_tasks": dict(self.failed_tasks),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())}}
