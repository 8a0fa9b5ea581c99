"""Episodes across rollout ranks under a task scheduler (CTB or the vanilla baseline). No JAX.

`RolloutManager` owns the scheduler, the ranks and the env client. `run_group(group)` plays
every task of a GRPO group to its end and returns their `Trajectory`s; each task is one
coroutine (the episode runner): wait for admission → `/start` → turns (prefill the observation
→ decode the action on the task's rank → `/observation`) → `/end`. Scheduling rounds run after
the events that change usage or state (those that need no decision at once share one round
per event-loop iteration, see `kick`); their decisions are applied here: `Admit` wakes a
task, `Pause` parks it on its rank and calls `/pause` on its env session, `Resume` revives it
(migrating its handle when the rank changes) and calls `/resume`.

Failures are values: an env error or timeout ends the task with that `EndReason`, and so does a
reward that is not a finite number (`bad_reward`: never a NaN in a group's advantages); an
action longer than the env server takes ends it `action_too_long`, a verdict that trains like
a turn limit; an observation that does not fit rollout.max_context ends the task
context_limit and is not kept (a trajectory holds only what the engine took, so it always fits
trainer.row_len); a rank whose engine raises is quarantined (`RankFailedError`), its tasks resume
on the other ranks. A text policy reads an observation's images (an image suite such as `gui`)
as placeholder lines, `[image 1: image/png 640x400]` (logged once); a vision-language policy
(`images=ImagePrompt`) gets each image's chat-template placeholder before the text, expanded to
the image's token count, and the image's patches go with the turn to the engine (and into
`Trajectory.images`). With `image_window` > 0 the episode loop applies the sliding image window
(serving/rollout_window.py): a context holding that many images is cut before its next
observation into a segment (`Trajectory.segments`) and a continuation from the `image_keep`
most recent images, prefilled from scratch.

A task moves between ranks only between turns (the scheduler never pauses a task inside its
prefill/decode) or when its rank fails; either way it takes its `Handoff` from the rank that
holds it: the handle, the tokens that rank never prefilled, or the turn that finished there.

Elastic scaling reuses that path: `drain_rank` takes a rank out of the scheduler (its tasks
resume elsewhere, cache-free), lets the turns in flight there finish, stops it and keeps each
task's `Handoff` for its next turn; `add_rank` revives a rank slot with a fresh rank.

A finished task is a `Trajectory` (serving/trajectory.py). What the manager measures (the
engine busy share the scheduler sees, `stats()` and its windows) is the `Measuring` mixin it
inherits (serving/rollout_stats.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tiderl.envs.images import placeholders
from tiderl.envs.protocol import EndReason
from tiderl.envs.templates import Transcript, TurnTemplate
from tiderl.serving.config import kv_budget_tokens
from tiderl.serving.ctb import Admit, CTBScheduler, Pause, Resume, Task, VanillaScheduler
from tiderl.serving.pages import Prefix, StopReason
from tiderl.serving.rank import Handoff, RankFailedError, RankStats, RolloutRank, TurnResult
from tiderl.serving.rollout_stats import Measuring
from tiderl.serving.rollout_window import ImageWindow, task_head
from tiderl.serving.trajectory import VERDICTS, Trajectory

log = logging.getLogger(__name__)


class RolloutFailedError(RuntimeError):
    """Every rollout rank has been quarantined: no task can run any more."""


def numeric_id(task_id: str) -> int:
    """A stable 31-bit id for sampling keys: the same task samples the same way anywhere.

    Not unique (two task ids may share it; they would only share sampling keys): ranks key
    their tasks by the episode's `key` instead."""
    return zlib.crc32(task_id.encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class _Episode:
    spec: dict[str, Any]
    key: int
    """Unique among this manager's episodes: how ranks know the task."""
    num_id: int
    task: Task
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    rank: int | None = None
    """Where the scheduler has the task (None while it waits for a rank)."""
    holder: int | None = None
    """The rank that holds the task's handle (and maybe its KV); a move takes it from there."""
    session: str = ""
    env_paused: bool = False
    handoff: Handoff | None = None
    """Taken from a rank that was drained and stopped; the next turn starts from it."""


class RolloutManager(Measuring):
    """Runs episodes on rollout ranks under CTB (or the vanilla policy) against an env server."""

    def __init__(self, ranks: Sequence[RolloutRank | None],
                 scheduler: CTBScheduler | VanillaScheduler,
                 env: Any, template: TurnTemplate, *, max_turns: int, system: str | None = None,
                 eval_temperature: float | None = 0.0, images: Any = None,
                 image_window: int = 0, image_keep: int = 5,
                 runner: Callable[[RolloutManager, _Episode], Awaitable[Trajectory]] | None = None):
        self.ranks = list(ranks)
        """Rank slot → its rank (None: a slot no rank serves now; the scheduler has it dead)."""
        self.retired = RankStats()
        """Counters of ranks drained away (stats stay cumulative over the run)."""
        self.sched = scheduler
        scheduler.horizon_turns = max_turns
        self.env = env
        self.template = template
        self.max_turns = max_turns
        self.eval_temperature = eval_temperature
        self.system = system
        self.runner = runner
        """Plays an episode instead of the env loop (`tiderl.agents`: agent and single-turn
        tasks); it drives turns through `agent_turn` and ends with `finished`."""
        self.image_prompt = images
        """A vision-language policy's `models.vision_inputs.ImagePrompt` (None: the policy
        reads text, each image a placeholder line)."""
        self.window = ImageWindow(image_window, image_keep)
        """The sliding image window (`image_window` 0: never cut; a text policy has no images
        to count)."""
        self.episodes: dict[str, _Episode] = {}
        """Live episodes only (a finished one is forgotten)."""
        self._keys = itertools.count()
        self.decisions = {"admit": 0, "pause": 0, "park": 0, "resume": 0, "migrate": 0}
        self.end_reasons: dict[str, int] = {}
        self.submitted = 0
        self.fatal: RolloutFailedError | None = None
        self._clocked = False
        self._warned_images = False
        self._busy_at: float | None = None
        self._busy_s: list[float] = []
        self._window: tuple[float, list[float], dict[str, float]] | None = None
        self._round_pending = False

    # -- scheduling -----------------------------------------------------------------------------
    def kick(self, *, defer: bool = False) -> None:
        """A scheduling round now; with `defer`, one at the event loop's next iteration for
        all the deferred kicks of this one. The events that need no decision before their
        task goes on defer theirs: a batch of turns ends on a rank at once (its tasks only
        become parkable), a task ends (its room is for others), a task's environment answers
        while its rank is within budget (nothing there needs pausing, so its turn may
        start). A round per event cost CTB's scheduler most of the event loop's time on
        short environment waits (its rounds look at every live task). A round now also
        covers any deferred one. Outside a running loop every round runs now."""
        if not defer:
            self._round()
            return
        if self._round_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._round()
            return
        self._round_pending = True
        loop.call_soon(self._deferred_round)

    def _unhindered(self, ep: _Episode) -> bool:
        """`ep`'s task is active on a rank within its budget: a round now would pause nothing
        there, so its turn may start before the round runs."""
        if ep.task.state != "active" or ep.rank is None:
            return False
        within = getattr(self.sched, "within_budget", None)
        return within is None or within(ep.rank)

    def _deferred_round(self) -> None:
        if self._round_pending:  # else a round ran since it was asked for
            self._round()

    def _round(self) -> None:
        """One scheduling round; applies its decisions. A round that raises (a scheduler bug)
        fails the rollout with that error, rather than leaving every task waiting for a round
        that will never admit it."""
        self._round_pending = False
        try:
            self._apply_round()
        except Exception as e:  # noqa: BLE001 -- becomes the rollout's error, not a stall
            log.exception("the scheduling round failed")
            self.fatal = RolloutFailedError(f"the task scheduler ({type(self.sched).__name__}) "
                                            f"raised {e!r}; see the log above for its traceback")
            for ep in self.episodes.values():
                ep.wake.set()

    def _apply_round(self) -> None:
        self._track_busy()
        for d in self.sched.schedule():
            ep = self.episodes[d.task_id]
            if isinstance(d, Admit):
                self.decisions["admit"] += 1
                ep.rank = d.rank
                ep.wake.set()
            elif isinstance(d, Pause):
                self.decisions["park" if d.parked else "pause"] += 1
                if ep.holder == d.rank:
                    keep = getattr(self.sched, "keep_value", None)
                    self.ranks[d.rank].pause(ep.key, keep(ep.task) if keep else 0.0)
                ep.wake.clear()
            elif isinstance(d, Resume):
                # A task is paused only between turns, so it has no turn in flight here; on
                # another rank its next turn takes the handle from `holder` (see `_turn`).
                self.decisions["resume"] += 1
                if ep.holder == d.rank:
                    self.ranks[d.rank].resume(ep.key)
                ep.rank = d.rank
                ep.wake.set()

    def quarantine(self, rank: int) -> None:
        if rank in self.sched.dead:
            return
        log.warning("quarantining rollout rank %d; its tasks migrate", rank)
        for tid in self.sched.remove_rank(rank):
            ep = self.episodes[tid]
            ep.rank = None  # its handle stays with `holder` until the next turn takes it
            ep.wake.clear()
        if not self.sched.live_ranks():
            self.fatal = RolloutFailedError(
                f"every rollout rank failed (the last was rank {rank}: "
                f"{self.ranks[rank].failed!r}); see the log above for the first error")
            for ep in self.episodes.values():
                ep.wake.set()
            return
        self.kick()

    async def drain_rank(self, rank: int) -> dict[str, int]:
        """Takes a healthy rank out of rollout (ERS): no new work goes there, its tasks resume
        on the other ranks with a fresh prefill, the turns in flight there finish, and each
        task still held there keeps its `Handoff` for its next turn. The slot is then empty."""
        r = self.ranks[rank] if rank < len(self.ranks) else None
        if r is None:
            return {"tasks": 0, "handoffs": 0}
        moved = [] if rank in self.sched.dead else self.sched.remove_rank(rank)
        for tid in moved:
            ep = self.episodes[tid]
            ep.rank = None  # its handle stays with `holder` until drained or taken
            ep.wake.clear()
        if self.sched.live_ranks():
            self.kick()
        handed = await r.drain()
        by_key = {ep.key: ep for ep in self.episodes.values() if ep.holder == rank}
        for key, h in handed.items():
            if key in by_key:
                by_key[key].handoff = h
        for ep in by_key.values():  # the rest took theirs already (a release during the drain)
            ep.holder = None
        for f in dataclasses.fields(RankStats):
            setattr(self.retired, f.name, getattr(self.retired, f.name) + getattr(r.stats, f.name))
        self.ranks[rank] = None
        return {"tasks": len(moved), "handoffs": len(handed)}

    def add_rank(self, rank: RolloutRank) -> None:
        """A started rank joins rollout in its slot (`rank.rank_id`), empty."""
        i = rank.rank_id
        if i < len(self.ranks) and self.ranks[i] is not None:
            raise ValueError(f"rollout rank slot {i} is taken; drain it first")
        self.ranks += [None] * (i + 1 - len(self.ranks))
        self.ranks[i] = rank
        # Its engine's own pool (rollout.kv_memory_fraction sizes it); engines without a
        # config (the simulator's) keep the slot's capacity.
        ecfg = getattr(getattr(rank, "engine", None), "cfg", None)
        self.sched.add_rank(i, kv_budget_tokens(ecfg) if ecfg is not None else None)
        self.kick()

    # -- episodes -------------------------------------------------------------------------------
    async def run_group(self, group: dict[str, Any], *, is_eval: bool = False
                        ) -> list[Trajectory]:
        """Plays every task of `group` to its end (failures included) and returns them."""
        if not self._clocked:
            self.sched.set_clock(asyncio.get_running_loop().time)
            self._clocked = True
            self.new_window()
        specs = group["tasks"]
        eps = []
        for spec in specs:
            task = Task(task_id=spec["task_id"], group_id=spec["group_id"], prompt_tokens=0,
                        is_eval=is_eval, task_type=str(spec.get("suite", "")))
            if task.task_id in self.episodes or any(e.task.task_id == task.task_id for e in eps):
                raise ValueError(f"task {task.task_id!r} is already running; task ids must be "
                                 "unique among live tasks")
            eps.append(_Episode(spec=spec, key=next(self._keys),
                                num_id=numeric_id(spec["task_id"]), task=task))
        self.sched.submit([ep.task for ep in eps])
        for ep in eps:
            self.episodes[ep.task.task_id] = ep
        self.submitted += len(eps)
        self.kick()
        play = self._episode if self.runner is None else (lambda ep: self.runner(self, ep))
        return list(await asyncio.gather(*(play(ep) for ep in eps)))

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
            if ep.task.state == "paused" and not ep.task.ready and not ep.task.executing:
                # It waits here for its next turn, so its environment (or agent) has
                # answered; a parked task is resumed only once the scheduler knows that.
                self.sched.set_ready(ep.task.task_id)
                self.kick()
                continue
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
        refused = 0  # trailing tokens the engine refused (they never fit rollout.max_context)
        try:
            await self._active(ep)
            start = await self.env.start(ep.spec)
            if not start.ok:
                traj.end_reason, traj.error = start.reason, start.error
                return traj
            ep.session = start.session
            text, images = self._observe(tid, start)
            transcript = Transcript.start(self.template, text, system=self.system,
                                          expand=self._expander(images))
            first_len = len(transcript)
            new_tokens, sent = list(transcript.tokens), images
            reward: float | None = None
            while True:
                # Its environment answered: it wants the engine (the scheduler resumes ready
                # tasks first and knows how long each type waits).
                self.sched.update_usage(tid, len(transcript), ready=True)
                self.kick(defer=self._unhindered(ep))
                # Executing from the turn's start (`_turn`) to its end: CTB never pauses it
                # meanwhile, and its context counts in its rank's usage.
                result = await self._turn(ep, new_tokens, images=sent)
                self.sched.set_executing(tid, False)
                self.kick(defer=True)  # waiting on its env now: the scheduler may park it
                traj.turns += 1
                traj.prompt_tokens += result.prompt_tokens
                traj.cached_tokens += result.cached_tokens
                if result.stop_reason == StopReason.CONTEXT_LIMIT and not result.action_tokens:
                    traj.end_reason = EndReason.context_limit
                    refused = len(new_tokens)  # the observation did not fit: not trained
                    break
                traj.images += images
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
                    traj.end_reason = EndReason.turn_limit if step.truncated == "turn_limit" \
                        else EndReason.done
                    break
                if traj.turns >= self.max_turns:
                    traj.end_reason = EndReason.turn_limit
                    break
                text, images = self._observe(tid, step)
                fresh = self.window.needs_cut(traj)
                if fresh:
                    transcript = self._cut(ep, traj, transcript, start.observation, first_len)
                new_tokens = transcript.add_observation(text, expand=self._expander(images))
                sent = images
                if fresh:  # prefilled from scratch: the whole continuation, kept images first
                    new_tokens, sent = list(transcript.tokens), traj.images + images
            self._settle(traj, await self.env.end(ep.session), reward)
            return traj
        except asyncio.CancelledError:
            traj.end_reason = EndReason.cancelled
            raise
        finally:
            if transcript is not None:
                # Only what the engine took: a trajectory never outgrows rollout.max_context
                # (and so trainer.row_len), as in the agent endpoint's refused requests.
                keep = len(transcript.tokens) - refused
                traj.tokens = list(transcript.tokens[:keep])
                traj.loss_mask = list(transcript.loss_mask[:keep])
                pad = len(traj.tokens) - len(traj.logprobs)
                traj.logprobs += [0.0] * pad
                traj.versions += [-1] * pad
                self.window.settle(traj)
            traj.finished_at = time.monotonic()
            self._close(ep)
            self.end_reasons[str(traj.end_reason)] = self.end_reasons.get(
                str(traj.end_reason), 0) + 1

    def _cut(self, ep: _Episode, traj: Trajectory, transcript: Transcript, task_text: str,
             first_len: int) -> Transcript:
        """The sliding image window cuts the task's context (serving/rollout_window.py): the
        cut part goes to `traj.segments`; the task's handle and KV are freed, so its next turn
        prefills the continuation from scratch, and the scheduler stops counting the group's
        prompt as shared by it. Returns the continuation's transcript."""
        out = self.window.cut(traj, transcript,
                              head=task_head(self.template, task_text, self.system),
                              first_len=first_len,
                              image_token=self.image_prompt.vision.image_token_id)
        if ep.holder is not None and self.ranks[ep.holder] is not None:
            self.ranks[ep.holder].finish(ep.key)
        ep.holder = ep.handoff = None
        self.sched.restart_context(ep.task.task_id)
        return out

    def _observe(self, task_id: str, result: Any) -> tuple[str, list[Any]]:
        """An observation's text to render and, for a vision-language policy (`images`), its
        images patched for the vision tower (their placeholders lead the text)."""
        if self.image_prompt is None:
            return self._text(task_id, result), []
        return self.image_prompt.observation(result.observation, getattr(result, "images", ()))

    def _expander(self, images: list[Any]) -> Callable[[list[int]], list[int]] | None:
        return None if self.image_prompt is None else functools.partial(
            self.image_prompt.expand, images)

    def _text(self, task_id: str, result: Any) -> str:
        """An observation as the (text-only) policy reads it: each image a placeholder line."""
        images = getattr(result, "images", ())
        if images and not self._warned_images:
            self._warned_images = True
            log.warning("task %s: the environment sends images; the policy reads text only, so "
                        "each image is a placeholder line in its observation (%s)", task_id,
                        images[0].placeholder(1))
        return placeholders(result.observation, images)

    @staticmethod
    def _settle(traj: Trajectory, end: Any, reward: float | None) -> None:
        """The episode's reward from its /end reply (else the last step's, unless the reward
        itself failed); a task with a verdict but no finite reward ends bad_reward."""
        if end.ok:
            traj.reward = float(end.reward)
            traj.info = dict(end.info)
        elif reward is not None and end.reason not in (EndReason.reward_error,
                                                       EndReason.bad_reward):
            traj.reward = float(reward)
        elif traj.end_reason in VERDICTS:
            traj.end_reason, traj.error = end.reason, end.error
        if traj.end_reason in VERDICTS and not math.isfinite(traj.reward):
            traj.end_reason = EndReason.bad_reward
            traj.error = traj.error or f"reward {traj.reward} is not a finite number"

    async def agent_turn(self, ep: _Episode, new_tokens: list[int], context: int, *,
                         max_action_tokens: int | None = None,
                         images: list[Any] | None = None) -> TurnResult:
        """One turn for an episode runner: waits until the scheduler has the task active, runs
        it on the task's rank (`context` tokens once `new_tokens` are in, with `images`, those
        of `new_tokens`' placeholder runs), then leaves the task waiting on its agent, where the
        scheduler may park it."""
        tid = ep.task.task_id
        await self._active(ep)
        self.sched.update_usage(tid, context, executing=True)
        self.kick()
        result = await self._turn(ep, new_tokens, max_action_tokens=max_action_tokens,
                                  images=images)
        self.sched.set_executing(tid, False)
        self.kick(defer=True)
        return result

    def finished(self, ep: _Episode, traj: Trajectory) -> None:
        """An episode runner's task ended: frees it on its rank and in the scheduler."""
        if traj.end_reason in VERDICTS and not math.isfinite(traj.reward):
            traj.end_reason = EndReason.bad_reward
            traj.error = traj.error or f"reward {traj.reward} is not a finite number"
        traj.finished_at = time.monotonic()
        self._close(ep)
        self.end_reasons[str(traj.end_reason)] = self.end_reasons.get(
            str(traj.end_reason), 0) + 1

    async def _turn(self, ep: _Episode, new_tokens: list[int], *,
                    max_action_tokens: int | None = None,
                    images: list[Any] | None = None) -> TurnResult:
        """Runs one turn on the task's rank. When the task has moved (CTB resumed it on another
        rank between turns, or the rank running this turn failed and was quarantined), the
        turn takes the task's `Handoff` from the rank that holds it and the new rank re-prefills
        the KV: exactly the tokens that were never fed (with their images), or the finished
        turn itself. `images`: those whose placeholder runs `new_tokens` holds."""
        pending = list(new_tokens)
        pending_images = images
        prefix: Prefix | None = None
        given = False  # this turn's tokens reached `ep.holder`
        while True:
            rank = await self._active(ep)
            h = None
            if ep.handoff is not None:  # its rank was drained: the handle is here already
                h, ep.handoff = ep.handoff, None
            elif ep.holder is not None and ep.holder != rank.rank_id:
                h = await self.ranks[ep.holder].release(ep.key)
            if h is not None:
                ep.holder = None
                self.decisions["migrate"] += 1
                prefix = h.prefix
                if given:
                    if h.result is not None:
                        return h.result  # finished there; only its delivery was lost
                    if h.unfed is not None:
                        pending, pending_images = h.unfed, h.unfed_images
                    elif h.prefix is not None:
                        pending, pending_images = [], None  # mid-action: continued there
                given = False
                continue  # the task may have moved again while the release was awaited
            temp = self.eval_temperature if ep.task.is_eval else None
            self.sched.set_executing(ep.task.task_id, True)
            try:
                fut = rank.turn(ep.key, pending, prefix, sample_id=ep.num_id, temperature=temp,
                                share_key=ep.task.group_id,
                                max_action_tokens=max_action_tokens, images=pending_images)
                ep.holder, given, prefix = rank.rank_id, True, None
                return await fut
            except RankFailedError:
                self.quarantine(rank.rank_id)

    def _record(self, traj: Trajectory, transcript: Transcript, start: int,
                result: TurnResult) -> None:
        pad = start - len(traj.logprobs)
        traj.logprobs += [0.0] * pad
        traj.versions += [-1] * pad
        traj.logprobs += list(result.logprobs)
        traj.versions += list(result.versions)

    def _close(self, ep: _Episode) -> None:
        tid = ep.task.task_id
        if ep.holder is not None and self.ranks[ep.holder] is not None:
            self.ranks[ep.holder].finish(ep.key)
        self.sched.finish(tid)
        self.episodes.pop(tid, None)
        self.kick(defer=True)
