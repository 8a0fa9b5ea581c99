"""ReadinessBuffer: finished groups → advantages → trainable sequences, with the readiness
signals the paper schedules by (RAS, TPRM, head-of-line latency, deficits). No JAX.

A group becomes ready when all its G tasks have ended. Tasks that failed in the environment
(`env_error`, `timeout`, `cancelled`, `bad_reward`, ...) carry no verdict: the group trains on
the others when at least `min_ok_per_group` ended with one, else the whole group is dropped
(both counted). A task whose reward is not a finite number is `bad_reward` here whatever its
runner said, so no NaN or inf ever reaches the advantages.
Advantages are group-normalised over the tasks kept; with `step_credit` (GiGPO) each turn of a
recurring anchor adds its step advantage on its action tokens (train/advantages.py), and a group
whose rewards are all equal is dropped only when no turn has a step advantage either.
Staleness is judged when the trainer takes a group: one whose oldest token is more than
`max_staleness` versions behind the version being trained is dropped and counted, never
silently trained on.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiderl.envs.protocol import EndReason
from tiderl.serving.trajectory import VERDICTS, Trajectory
from tiderl.train import ra2p
from tiderl.train.advantages import (StepCredit, group_advantages, step_advantages,
                                     token_advantages)
from tiderl.train.dispatch import TrainSequence


@dataclasses.dataclass
class ReadyGroup:
    group_id: str
    seqs: list[TrainSequence]
    trajs: list[Trajectory]
    ready_at: float
    min_version: int
    action_tokens: int
    reward_mean: float


@dataclasses.dataclass
class Readiness:
    """Readiness signals of one step (arXiv 2608.10402, §5): at its start, over it, and at the
    boundary after its update (where ERS plans). Times in seconds of the controller's clock."""

    ras: int = 0
    """Ready-at-Start: micro-batches of work ready when the step began."""
    ready_times: list[float] = dataclasses.field(default_factory=list)
    """Per micro-batch the step consumed: when it became ready, relative to the step start
    (≤ 0: ready at start). A micro-batch is ready when its last group is."""
    tprm: float = float("nan")
    """Time Per Ready Micro-batch observed in this step (mean post-start gap; 0 if all were
    ready at start)."""
    tprm_ema: float = float("nan")
    """TPRM measured live: an exponentially weighted mean of the gaps between micro-batches
    becoming ready during steps, updated as they arrive (what the next step is planned with)."""
    hol_s: float = 0.0
    """Head-of-line latency at the boundary: age of the oldest ready group."""
    hol_limit_s: float = float("inf")
    """τ·T_step, the head-of-line threshold (T_step: the mean step duration)."""
    ras_next: int = 0
    """Micro-batches ready at the boundary (the next step's RAS if it began now)."""
    volume_next: int = 0
    """Groups ready at the boundary."""
    twt_frac: float = 0.0
    rwt_frac: float = 0.0
    break_even_ras: int = 0
    """RAS from which decoupled RA2P beats colocated (cost model, live phase times)."""
    above_break_even: bool = False
    generation_deficit: bool = False
    """The next batch is short of B_ideal and the trainer waited for data this step."""
    consumption_deficit: bool = False
    """Data waited for the trainer: head-of-line latency over τ·T_step, or rollout throttled."""
    deficit_reason: str = ""
    gen_rate: float = float("nan")
    """Trainable groups per second (exponentially weighted over boundaries)."""

    def record(self) -> dict[str, Any]:
        """The fields `metrics.jsonl` carries per step."""
        return {"ras": self.ras, "tprm_s": self.tprm, "tprm_ema_s": self.tprm_ema,
                "hol_s": self.hol_s, "hol_limit_s": self.hol_limit_s, "ras_next": self.ras_next,
                "ready_next": self.volume_next, "ready_times": [round(a, 4)
                                                                for a in self.ready_times],
                "break_even_ras": self.break_even_ras,
                "generation_deficit": self.generation_deficit,
                "consumption_deficit": self.consumption_deficit,
                "above_break_even": self.above_break_even,
                "deficit_reason": self.deficit_reason, "gen_rate": self.gen_rate}


class ReadinessBuffer:
    """Holds ready groups in arrival order and accounts for everything it drops."""

    def __init__(self, *, groups_per_microbatch: int, max_staleness: int, min_ok_per_group: int,
                 zero_var: str = "drop", adv_eps: float = 1e-6, ema: float = 0.3,
                 step_credit: StepCredit | None = None):
        self.groups_per_microbatch = groups_per_microbatch
        self.step_credit = step_credit
        self.credit_stats: Counter[str] = Counter()
        """With step_credit: turns, anchored turns and step groups of the trainable groups."""
        self.max_staleness = max_staleness
        self.min_ok = min_ok_per_group
        self.zero_var = zero_var
        self.adv_eps = adv_eps
        self.ema = ema
        self.ready: deque[ReadyGroup] = deque()
        self.dropped: Counter[str] = Counter()
        self.drops_in_a_row = 0
        """Groups dropped since the last one that became trainable."""
        self.failed_tasks: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self._uids = itertools.count()
        self._step_t0: float | None = None
        self._in_step = 0  # trainable groups that arrived during the current step
        self._last_mb_t = 0.0
        self.tprm_ema = float("nan")
        self.gen_rate = float("nan")
        self._arrived = 0  # trainable groups since the last boundary
        self._last_boundary: float | None = None

    # -- producer side -------------------------------------------------------------------------
    def add_group(self, trajs: Sequence[Trajectory], *, now: float) -> ReadyGroup | None:
        """A finished group; returns it when it is trainable, None when it was dropped."""
        for t in trajs:
            if t.end_reason in VERDICTS and not math.isfinite(t.reward):
                t.end_reason = EndReason.bad_reward
                t.error = t.error or f"reward {t.reward} is not a finite number"
        ok = [t for t in trajs if t.ok]
        for t in trajs:
            if not t.ok:
                self.failed_tasks[str(t.end_reason)] += 1
        gid = trajs[0].group_id if trajs else "?"
        if len(ok) < self.min_ok:
            self.dropped["failed_tasks"] += 1
            self.drops_in_a_row += 1
            return None
        seqs = self._sequences(ok)
        if seqs is None:
            self.dropped["zero_variance"] += 1
            self.drops_in_a_row += 1
            return None
        g = ReadyGroup(group_id=gid, seqs=seqs, trajs=list(ok), ready_at=now,
                       min_version=min((t.min_version for t in ok if t.min_version >= 0),
                                       default=-1),
                       action_tokens=sum(t.action_token_count for t in ok),  # cut parts too
                       reward_mean=float(np.mean([t.reward for t in ok])))
        self.ready.append(g)
        self.drops_in_a_row = 0
        if self._last_boundary is None:
            self._last_boundary = now  # the generation rate is measured from here
        self._arrived += 1
        if self._step_t0 is not None:
            self._in_step += 1
            if self._in_step % self.groups_per_microbatch == 0:  # a micro-batch became ready
                self.tprm_ema = _ema(self.tprm_ema, now - self._last_mb_t, self.ema)
                self._last_mb_t = now
        return g

    def _sequences(self, ok: Sequence[Trajectory]) -> list[TrainSequence] | None:
        """The kept tasks as sequences with their advantages; None when the group carries no
        signal and the zero-variance policy drops it."""
        adv = group_advantages([[t.reward for t in ok]], eps=self.adv_eps, zero_var=self.zero_var)
        ep = adv.advantages[0]
        advs: list[float | np.ndarray] = [float(a) for a in ep]
        c = self.step_credit
        if c is not None:
            st = step_advantages([t.tokens for t in ok], [t.loss_mask for t in ok],
                                 [t.reward for t in ok], c)
            if not adv.keep[0] and not any(np.any(a != 0) for a in st.per_turn):
                return None
            self.credit_stats.update(turns=st.turns, anchored_turns=st.anchored,
                                     anchored_later_turns=st.anchored_later,
                                     step_groups=st.groups)
            advs = [token_advantages(t.loss_mask, float(a), s, c.omega)
                    for t, a, s in zip(ok, ep, st.per_turn, strict=True)]
        elif not adv.keep[0]:
            return None
        out = []
        for t, a, e in zip(ok, advs, ep, strict=True):
            # Parts the sliding image window cut off: the episode's advantage (step credit's
            # per-turn terms apply to the last part, whose tokens it was computed on).
            out += [seg.sequence(next(self._uids), float(e)) for seg in t.segments]
            out.append(TrainSequence(uid=next(self._uids), tokens=np.asarray(t.tokens, np.int32),
                                     action_mask=np.asarray(t.loss_mask, bool),
                                     behaviour_logprobs=np.asarray(t.logprobs, np.float32),
                                     advantage=a, versions=np.asarray(t.versions, np.int32),
                                     images=tuple(t.images)))
        return out

    # -- consumer side -------------------------------------------------------------------------
    def begin_step(self, now: float) -> Readiness:
        """Snapshot of the readiness signals as a training step starts."""
        self._step_t0 = self._last_mb_t = now
        self._in_step = 0
        if self._last_boundary is None:
            self._last_boundary = now
        return Readiness(ras=len(self.ready) // self.groups_per_microbatch)

    def end_step(self, r: Readiness, taken: Sequence[ReadyGroup]) -> Readiness:
        """Adds the step's micro-batch ready times and its TPRM (the update is done)."""
        t0 = self._step_t0 if self._step_t0 is not None else 0.0
        gpm = self.groups_per_microbatch
        at = sorted(g.ready_at for g in taken)
        r.ready_times = [at[min(k + gpm, len(at)) - 1] - t0 for k in range(0, len(at), gpm)]
        r.tprm = ra2p.tprm(r.ready_times) if r.ready_times else float("nan")
        self._step_t0 = None
        return r

    def boundary(self, r: Readiness, now: float, *, step_time: float, step_time_mean: float,
                 twt: float, rwt: float, batch_ideal: int, tau: float, wait_frac: float,
                 break_even_ras: int, uses_ref: bool,
                 rwt_span: float | None = None) -> Readiness:
        """The signals ERS plans with, right after the update (before the weight sync).

        Consumption deficit: the oldest ready group has waited longer than τ·T_step, rollout
        sat throttled (RWT) for more than `wait_frac` of the step, or at least
        (1 − `wait_frac`)·B_ideal groups are ready for the next step while this one's trainer
        waited at most `wait_frac` of it (a ready backlog). Generation deficit:
        fewer than B_ideal groups are ready for the next step and the trainer waited (TWT) for
        more than `wait_frac` of this one. RAS at or above the RA2P break-even (with a Ref
        forward to run) is reported apart: it asks for a decoupled Ref, not a wider trainer."""
        gpm = self.groups_per_microbatch
        if self._last_boundary is not None and now > self._last_boundary:
            self.gen_rate = _ema(self.gen_rate, self._arrived / (now - self._last_boundary),
                                 self.ema)
        self._last_boundary, self._arrived = now, 0
        r.gen_rate = self.gen_rate
        r.tprm_ema = self.tprm_ema
        r.hol_s = now - self.ready[0].ready_at if self.ready else 0.0
        t_step = step_time_mean or step_time
        r.hol_limit_s = tau * t_step if t_step > 0 else float("inf")
        r.volume_next = len(self.ready)
        r.ras_next = len(self.ready) // gpm
        span = max(step_time, 1e-9)
        # RWT accrues from one boundary to the next (a slow weight sync throttles rollout
        # too), so it is a share of that interval; TWT is a share of the step.
        r.twt_frac = twt / span
        r.rwt_frac = rwt / max(rwt_span or step_time, span)
        r.break_even_ras = break_even_ras
        r.above_break_even = uses_ref and r.ras_next >= max(1, break_even_ras)
        con, gen = [], []
        if r.hol_s > r.hol_limit_s:
            con.append(f"head-of-line {r.hol_s:.2f}s > τ·T_step {r.hol_limit_s:.2f}s")
        if r.rwt_frac > wait_frac:
            con.append(f"rollout throttled {rwt:.2f}s = {r.rwt_frac:.0%} of the interval "
                       "since the last boundary")
        if r.volume_next >= (1.0 - wait_frac) * batch_ideal and r.twt_frac <= wait_frac:
            # The next step's batch is (nearly) ready before it starts and this step's trainer
            # hardly waited: rollout runs a step ahead of a trainer it outpaces (the paper's
            # large RAS). Rollout then idles throttled behind the staleness bound with only
            # stragglers left, which RWT (counted when nothing is in flight) does not show.
            con.append(f"{r.volume_next} of B_ideal={batch_ideal} groups ready before the "
                       f"step, trainer waited {r.twt_frac:.0%} of this one")
        if r.volume_next < batch_ideal and r.twt_frac > wait_frac:
            gen.append(f"{r.volume_next} of B_ideal={batch_ideal} groups ready, trainer "
                       f"waited {twt:.2f}s = {r.twt_frac:.0%} of the step")
        r.consumption_deficit = bool(con) and not gen
        r.generation_deficit = bool(gen) and not con
        if r.above_break_even:
            con.append(f"RAS {r.ras_next} ≥ break-even {break_even_ras}")
        r.deficit_reason = "; ".join(gen if r.generation_deficit else con if (
            r.consumption_deficit or r.above_break_even) else [])
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
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                **({"step_credit": dict(self.credit_stats)} if self.step_credit else {})}


def _ema(old: float, value: float, alpha: float) -> float:
    return value if old != old else (1 - alpha) * old + alpha * value  # old NaN: first value
