"""Episodes across rollout ranks under a task scheduler (CTB or the vanilla baseline). No JAX.

`RolloutManager` owns the scheduler, the ranks and the env client. `run_group(group)` plays
every task of a GRPO group to its end and returns their `Trajectory`s; each task is one
coroutine (the episode runner): wait for admission → `/start` → turns (prefill the observation
→ decode the action on the task's rank → `/observation`) → `/end`. Scheduling rounds run after
every event that changes usage or state; their decisions are applied here: `Admit` wakes a
task, `Pause` parks it on its rank and calls `/pause` on its env session, `Resume` revives it
(migrating its handle when the rank changes) and calls `/resume`.

Failures are values: an env error or timeout ends the task with that `EndReason`; a rank whose
engine raises is quarantined (`RankFailedError`), its tasks resume on the other ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any

from tiderl.envs.protocol import EndReason
from tiderl.envs.templates import Transcript, TurnTemplate
from tiderl.serving.ctb import Admit, CTBScheduler, Pause, Resume, Task, VanillaScheduler
from tiderl.serving.pages import StopReason
from tiderl.serving.rank import RankFailedError, RolloutRank, TurnResult

log = logging.getLogger(__name__)


class RolloutFailedError(RuntimeError):
    """Every rollout rank has been quarantined: no task can run any more."""


@dataclasses.dataclass
class Trajectory:
    """One finished task, token in / token out: exactly the ids the engine saw and produced."""

    task_id: str
    group_id: str
    is_eval: bool
    tokens: list[int]
    loss_mask: list[int]
    """1 on action tokens (what the policy sampled), 0 on prompt/observation/template tokens."""
    logprobs: list[float]
    """Behaviour logprob of each token (0 where loss_mask is 0)."""
    versions: list[int]
    """Weight version that sampled each token (-1 where loss_mask is 0)."""
    reward: float
    end_reason: EndReason
    turns: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished_at: float = 0.0

    @property
    def ok(self) -> bool:
        """Trainable: the episode ran to a verdict (done, turn or context limit)."""
        return self.end_reason in (EndReason.done, EndReason.turn_limit, EndReason.context_limit)

    @property
    def min_version(self) -> int:
        vs = [v for v in self.versions if v >= 0]
        return min(vs) if vs else -1

    @property
    def action_token_count(self) -> int:
        return sum(self.loss_mask)


def numeric_id(task_id: str) -> int:
    """A stable 31-bit id for sampling keys: the same task samples the same way anywhere."""
    return zlib.crc32(task_id.encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class _Episode:
    spec: dict[str, Any]
    num_id: int
    task: Task
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    rank: int | None = None
    session: str = ""
    migrate_from: int | None = None
    env_paused: bool = False


class RolloutManager:
    """Runs episodes on rollout ranks under CTB (or the vanilla policy) against an env server."""

    def __init__(self, ranks: Sequence[RolloutRank], scheduler: CTBScheduler | VanillaScheduler,
                 env: Any, template: TurnTemplate, *, max_turns: int, system: str | None = None,
                 eval_temperature: float | None = 0.0):
        self.ranks = list(ranks)
        self.sched = scheduler
        scheduler.horizon_turns = max_turns
        self.env = env
        self.template = template
        self.max_turns = max_turns
        self.eval_temperature = eval_temperature
        self.system = system
        self.episodes: dict[str, _Episode] = {}
        self.decisions = {"admit": 0, "pause": 0, "resume": 0, "migrate": 0}
        self.end_reasons: dict[str, int] = {}
        self.fatal: RolloutFailedError | None = None

    # -- scheduling -----------------------------------------------------------------------------
    def kick(self) -> None:
        """One scheduling round; applies its decisions."""
        for d in self.sched.schedule():
            ep = self.episodes[d.task_id]
            if isinstance(d, Admit):
                self.decisions["admit"] += 1
                ep.rank = d.rank
                ep.wake.set()
            elif isinstance(d, Pause):
                self.decisions["pause"] += 1
                self.ranks[d.rank].pause(ep.num_id)
                ep.wake.clear()
            elif isinstance(d, Resume):
                self.decisions["resume"] += 1
                if ep.rank is not None and ep.rank != d.rank:
                    ep.migrate_from = ep.rank
                    self.ranks[ep.rank].abort_turn(ep.num_id)
                elif ep.rank is not None:
                    self.ranks[ep.rank].resume(ep.num_id)
                ep.rank = d.rank
                ep.wake.set()

    def quarantine(self, rank: int) -> None:
        if rank in self.sched.dead:
            return
        log.warning("quarantining rollout rank %d; its tasks migrate", rank)
        for tid in self.sched.remove_rank(rank):
            ep = self.episodes[tid]
            ep.migrate_from, ep.rank = rank, None
            ep.wake.clear()
            self.ranks[rank].abort_turn(ep.num_id)
        if not self.sched.live_ranks():
            self.fatal = RolloutFailedError(
                f"every rollout rank failed (the last was rank {rank}: "
                f"{self.ranks[rank].failed!r}); see the log above for the first error")
            for ep in self.episodes.values():
                ep.wake.set()
            return
        self.kick()

    # -- episodes -------------------------------------------------------------------------------
    async def run_group(self, group: dict[str, Any], *, is_eval: bool = False
                        ) -> list[Trajectory]:
        """Plays every task of `group` to its end (failures included) and returns them."""
        specs = group["tasks"]
        eps = []
        for spec in specs:
            task = Task(task_id=spec["task_id"], group_id=spec["group_id"], prompt_tokens=0,
                        is_eval=is_eval, task_type=str(spec.get("suite", "")))
            ep = _Episode(spec=spec, num_id=numeric_id(spec["task_id"]), task=task)
            self.episodes[task.task_id] = ep
            eps.append(ep)
        self.sched.submit([ep.task for ep in eps])
        self.kick()
        return list(await asyncio.gather(*(self._episode(ep) for ep in eps)))

    async def _active(self, ep: _Episode) -> RolloutRank:
        """The task's rank once it is active. While it is parked, its env session is paused
        (/pause, /resume go through this coroutine, so they never race the session's own
        /observation calls)."""
        while True:
            if self.fatal is not None:
                raise self.fatal
            if ep.rank is not None and ep.task.state == "active":
                if ep.env_paused:
                    ep.env_paused = False
                    await self.env.resume(ep.session)
                    continue  # state may have changed while we awaited
                return self.ranks[ep.rank]
            if ep.session and not ep.env_paused:
                ep.env_paused = True
                await self.env.pause(ep.session)
                continue
            ep.wake.clear()
            await ep.wake.wait()

    async def _episode(self, ep: _Episode) -> Trajectory:
        tid = ep.task.task_id
        traj = Trajectory(task_id=tid, group_id=ep.task.group_id, is_eval=ep.task.is_eval,
                          tokens=[], loss_mask=[], logprobs=[], versions=[], reward=0.0,
                          end_reason=EndReason.cancelled, turns=0)
        transcript: Transcript | None = None
        try:
            await self._active(ep)
            start = await self.env.start(ep.spec)
            if not start.ok:
                traj.end_reason, traj.error = start.reason, start.error
                return traj
            ep.session = start.session
            transcript = Transcript.start(self.template, start.observation, system=self.system)
            new_tokens = list(transcript.tokens)
            reward: float | None = None
            while True:
                rank = await self._active(ep)
                self.sched.update_usage(tid, len(transcript) , executing=True)
                self.kick()
                rank = await self._active(ep)
                result = await self._turn(ep, new_tokens)
                self.sched.set_executing(tid, False)
                traj.turns += 1
                traj.prompt_tokens += result.prompt_tokens
                traj.cached_tokens += result.cached_tokens
                if result.stop_reason == StopReason.CONTEXT_LIMIT and not result.action_tokens:
                    traj.end_reason = EndReason.context_limit
                    break
                start_i = len(transcript)
                action = transcript.add_action(result.action_tokens)
                self._record(traj, transcript, start_i, result)
                if result.stop_reason == StopReason.CONTEXT_LIMIT:
                    traj.end_reason = EndReason.context_limit
                    break
                step = await self.env.step(ep.session, action)
                if not step.ok:
                    traj.end_reason, traj.error = step.reason, step.error
                    break
                if step.reward is not None:
                    reward = step.reward
                if step.done:
                    traj.end_reason = EndReason.done
                    break
                if traj.turns >= self.max_turns:
                    traj.end_reason = EndReason.turn_limit
                    break
                new_tokens = transcript.add_observation(step.observation)
                del rank
            end = await self.env.end(ep.session)
            if end.ok:
                traj.reward = float(end.reward)
                traj.info = dict(end.info)
            elif reward is not None:
                traj.reward = float(reward)
            elif traj.ok:
                traj.end_reason, traj.error = end.reason, end.error
            return traj
        except asyncio.CancelledError:
            traj.end_reason = EndReason.cancelled
            raise
        finally:
            if transcript is not None:
                traj.tokens = list(transcript.tokens)
                traj.loss_mask = list(transcript.loss_mask)
                pad = len(traj.tokens) - len(traj.logprobs)
                traj.logprobs += [0.0] * pad
                traj.versions += [-1] * pad
            traj.finished_at = time.monotonic()
            self._close(ep)
            self.end_reasons[str(traj.end_reason)] = self.end_reasons.get(
                str(traj.end_reason), 0) + 1

    async def _turn(self, ep: _Episode, new_tokens: list[int]) -> TurnResult:
        """Runs one turn on the task's rank. When the task migrates (CTB resumed it elsewhere,
        or its rank failed and was quarantined) the turn moves with its handle and the new rank
        re-prefills the KV."""
        pending = list(new_tokens)
        prefix = None
        while True:
            rank = await self._active(ep)
            if ep.migrate_from is not None:
                old, ep.migrate_from = self.ranks[ep.migrate_from], None
                moved, unfed = await old.release(ep.num_id)
                if moved is not None:
                    prefix = moved
                    pending = unfed if unfed is not None else []
                self.decisions["migrate"] += 1
            temp = self.eval_temperature if ep.task.is_eval else None
            fut = rank.turn(ep.num_id, pending, prefix, temperature=temp) \
                if rank.failed is None else None
            prefix = None
            try:
                if fut is None:
                    raise RankFailedError(f"rank {rank.rank_id} is quarantined")
                return await fut
            except RankFailedError:
                ep.migrate_from = rank.rank_id
                self.quarantine(rank.rank_id)
            except asyncio.CancelledError:
                if ep.migrate_from is None:
                    raise  # not a migration: the episode itself is being cancelled

    def _record(self, traj: Trajectory, transcript: Transcript, start: int,
                result: TurnResult) -> None:
        pad = start - len(traj.logprobs)
        traj.logprobs += [0.0] * pad
        traj.versions += [-1] * pad
        traj.logprobs += list(result.logprobs)
        traj.versions += list(result.versions)

    def _close(self, ep: _Episode) -> None:
        tid = ep.task.task_id
        if ep.rank is not None and self.ranks[ep.rank].failed is None:
            self.ranks[ep.rank].finish(ep.num_id)
        self.sched.finish(tid)
        self.kick()

    # -- metrics --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        prompt = sum(r.stats.prompt_tokens for r in self.ranks)
        cached = sum(r.stats.cached_tokens for r in self.ranks)
        return {
            "kv_hit_rate": cached / max(1, prompt),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": sum(r.stats.computed_tokens for r in self.ranks),
            "decode_tokens": sum(r.stats.decode_tokens for r in self.ranks),
            "forced_evictions": sum(r.stats.forced_evictions for r in self.ranks),
            "decisions": dict(self.decisions),
            "end_reasons": dict(self.end_reasons),
            "per_rank": [{**r.kv_stats(), "hit_rate": r.stats.kv_hit_rate} for r in self.ranks],
        }
