"""The controller: one asyncio loop from task stream to weight sync. No JAX.

    task stream → scheduler (CTB / vanilla) → rollout ranks → env sessions → finished groups →
    advantages → ReadinessBuffer → trainer backend → version + 1 → scaling plan → weight sync

It sees the rollout side through `RolloutManager` and the trainer through the backend contract
(`submit(mb)`, `finish_step_async()`, `export_weights_async()`, `version`); device work and
weight movement come in as coroutines from the JAX side (`tiderl.runtime.job`), which run them off the
event loop's thread so env I/O (and an in-process env server) never stalls behind them. Every baseline is a mode of
this one loop:

- `tiderl`: CTB rollout runs ahead within the staleness bound; micro-batches are submitted as
  groups become ready (RA2P executes them, aggregated when colocated).
- `stream`: the same streaming, request-level rollout, Ref/Actor alternate per micro-batch.
- `async`: request-level rollout runs ahead; the trainer waits for the whole global batch.
- `sync`: a global barrier: roll out one step's groups, then train on them, never overlapping.

Evaluation every K steps: eval groups start right after the sync of step i's weights, at top
priority, and the next sync waits for them, so they run entirely on step i's weights.

Readiness-aware control (arXiv 2608.10402, §5.2) sits at the boundary after each update and
before the weight sync: the buffer's signals (RAS, live TPRM, head-of-line latency against
τ·T_step, deficits), the RA2P cost model's advice for the next step (`advise_mode` on predicted
ready times) and its break-even RAS go to the planner (`tiderl.control.ers`); a plan that moves
cells is carried out by `tiderl.control.roles.RoleSwitch` through `Hooks.apply_roles`
(`tiderl.control.boundary` holds that part of the controller). The
trainer consumes an elastic batch in [B_min, B_ideal]: once it holds B_min it stops waiting
when the wait would pass τ·T_step, and while rollout cannot sustain the trainer's consumption
it fetches toward B_min and leaves a micro-batch ready for the next step (adaptive data
retention).

This module holds the loop: its steps, the elastic batch and the end of the run. The rollout
side (groups from the task stream to the buffer, the staleness throttle, `sync` mode's rollout
phase) is the `Producing` mixin (`tiderl.control.producer`); what the run reports (evaluation
rounds, the step record, the progress line, the summary) is the `Reporting` mixin
(`tiderl.control.reporting`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from tiderl.control.boundary import ReadinessAware
from tiderl.control.buffer import ReadinessBuffer, ReadyGroup
from tiderl.control.config import ControllerConfig
from tiderl.control.fixed_plans import KeepSplit
from tiderl.control.metrics import MetricsSink
from tiderl.control.plans import CellMap, Planner, RoleChange, RoleChangeResult, initial_cells
from tiderl.control.producer import Producing
from tiderl.control.reporting import Reporting
from tiderl.control.roles import RoleSwitch
from tiderl.control.samples import SampleWriter
from tiderl.control.starvation import Starvation, Starved
from tiderl.serving.rollout import RolloutManager

log = logging.getLogger(__name__)


class TrainerPort(Protocol):
    """What the controller needs of the trainer backend."""

    version: int

    def submit(self, mb: Any) -> None: ...

    async def finish_step_async(self) -> dict: ...

    async def export_weights_async(self) -> Any: ...


class TaskStreamPort(Protocol):
    """The task stream the controller draws groups from (`tiderl.runtime.taskstream.GrainTaskStream` in a
    run; any JAX-free iterator of the same shape in the simulator)."""

    position: int
    """Index of the group the next `next()` returns."""

    def __next__(self) -> dict: ...

    def element(self, k: int) -> dict:
        """The group at position k (regenerating groups in flight at a checkpoint)."""
        ...

    def get_state(self) -> dict: ...


class _TimeUp(Exception):
    """The run's time limit passed while it waited for data."""


class _StreamEnded(Exception):
    """The task stream ran out (env.epochs) and everything it gave was trained or dropped."""


class NonFiniteStop(RuntimeError):
    """Too many consecutive non-finite updates; the run stopped with a checkpoint."""


class StarvedStop(RuntimeError):
    """No group became trainable for `controller.max_dropped_in_a_row` groups (or
    `controller.max_starved_s` seconds); the run stopped with a checkpoint."""

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary or {}


@dataclasses.dataclass
class Hooks:
    """JAX-side work the controller triggers (provided by `tiderl.runtime.job`, or fakes in tests)."""

    sync_weights: Callable[[Any, int], Awaitable[dict | None]]
    """Moves exported weights (version v) to every rollout rank; stale KV is flushed there.
    May return figures of the sync (e.g. `sync_gbps`) for the step's metrics record."""
    make_microbatches: Callable[[list[Any], bool], list[Any]]
    """Packs train sequences into micro-batches (`final`: the step's last, keep it small)."""
    checkpoint: Callable[[int, dict], Awaitable[None]] | None = None
    """Saves the trainer state at a step with the task-stream state."""
    apply_roles: Callable[[RoleChange, Any], Awaitable[RoleChangeResult]] | None = None
    """Carries out a role change at a sync boundary (see `tiderl.control.plans`); None: roles
    stay as they are."""
    compile_stats: Callable[[], dict] | None = None
    """Cumulative compilation counters ({"compiles", "compile_s"}); role-change records and
    step records report their deltas."""


class Controller(Producing, Reporting, ReadinessAware):
    def __init__(self, cfg: ControllerConfig, *, manager: RolloutManager, trainer: TrainerPort,
                 hooks: Hooks, train_stream: TaskStreamPort,
                 eval_groups: Sequence[dict], metrics: MetricsSink, buffer: ReadinessBuffer,
                 planner: Planner | None = None, cells: CellMap | None = None,
                 ranks_per_cell: int = 1, ref_mode: str | None = None,
                 start_step: int = 0, pending: Sequence[int] = (),
                 samples: SampleWriter | None = None, advice: str = ""):
        self.cfg = cfg
        self.manager = manager
        self.trainer = trainer
        self.hooks = hooks
        self.stream = train_stream
        self.eval_groups = list(eval_groups)
        self.metrics = metrics
        self.buffer = buffer
        self.planner = planner or KeepSplit()
        cells = cells or initial_cells([("rollout", len(manager.ranks)), ("trainer", 1)])
        self.roles = RoleSwitch(
            manager=manager, cells=cells, ranks_per_cell=ranks_per_cell,
            ref_mode=ref_mode or ("decoupled" if cells.count("ref") else "colocated"),
            apply_roles=hooks.apply_roles, compile_stats=hooks.compile_stats,
            log_record=metrics.log, clock=self.now)
        self._fetch = cfg.groups_per_step
        """This step's fetch target in [B_min, B_ideal] (adaptive data retention)."""
        self._t_group: float | None = None
        """Trainer compute seconds per group (exponentially weighted)."""
        self._advice: Any = None
        self._compiles_at = self._compile_stats()
        self.step = start_step
        self._step0 = start_step
        self.version = trainer.version
        self._regen = list(pending)
        self._exhausted = False
        self.index_of: dict[str, int] = {}
        self.in_flight: set[str] = set()
        self.started_groups = 0
        self.consumed_tokens = 0
        self.generated_tokens = 0
        self.rwt = 0.0
        self.nonfinite = 0
        self.nonfinite_total = 0
        self._changed = asyncio.Event()
        self._ready = asyncio.Event()
        self.starvation = Starvation(cfg, advice=advice)
        """Warns when no group becomes trainable, and stops the run past the hard limits."""
        self.samples = samples
        self._phase = "filling"
        self._taken: list[ReadyGroup] = []  # groups taken by the step being filled
        self._ticker: asyncio.Task[None] | None = None
        self._progress_broken = False
        self._eval_task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._producer: asyncio.Task[None] | None = None
        self._step_time = 0.0
        self._t0 = 0.0
        self._stop = False
        self._saved = start_step
        """The step of the last checkpoint the loop saved."""
        self._fatal: BaseException | None = None
        self.end_reason = ""
        """Why the run ended, in words (the summary's `ended`)."""

    # -- clock and the run's bounded wait --------------------------------------------------------
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _wait(self, event: asyncio.Event, *, starving: bool = False) -> None:
        """`event.wait()`, bounded by the run's time limit (raises `_TimeUp`): a run whose
        groups stop becoming trainable (say, all zero variance) still ends on time. While the
        trainer waits for data (`starving`) it also returns at the next wall-clock starvation
        threshold, for `_warn_if_starved` to act on."""
        limit = self._t0 + self.cfg.time_limit_s - self.now() if self.cfg.time_limit_s else None
        if limit is not None and limit <= 0:
            raise _TimeUp
        wake = self.starvation.wake_in(self.now()) if starving else None
        timeout = min((x for x in (limit, wake) if x is not None), default=None)
        if timeout is None:
            await event.wait()
            return
        try:
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        except TimeoutError:
            if limit is not None and timeout >= limit:
                raise _TimeUp from None

    # -- training side ---------------------------------------------------------------------------
    async def _wait_ready(self, n: int, within: float | None = None) -> float:
        """Waits until `n` groups are ready (or no more can come, or `within` seconds passed);
        returns seconds waited."""
        t0 = self.now()
        self.starvation.begin_wait(t0)
        while len(self.buffer) < n:
            if self._fatal is not None:
                raise self._fatal
            if (self._producer is None or self._producer.done()) and not self.in_flight:
                break
            self._ready.clear()
            if within is None:
                await self._wait(self._ready, starving=True)
            else:
                left = t0 + within - self.now()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._wait(self._ready, starving=True), left)
                except TimeoutError:
                    break
            self._warn_if_starved()
        return self.now() - t0

    def _warn_if_starved(self) -> None:
        """Warns (or stops the run, raising `Starved`) when groups keep ending but none
        becomes trainable, or the trainer waited long for one (`tiderl.control.starvation`)."""
        self.starvation.check(
            now=self.now(), step=self.step, in_a_row=self.buffer.drops_in_a_row,
            dropped=self.buffer.dropped, in_flight=len(self.in_flight),
            episodes=len(self.manager.episodes), end_reasons=self.manager.end_reasons,
            before_warning=lambda: self._show_progress(force=True))

    async def _train_step(self) -> dict:
        c = self.cfg
        r = self.buffer.begin_step(self.now())
        t_step = self.now()
        self._t_train_start = t_step
        twt = 0.0
        taken: list[ReadyGroup] = []
        submitted = 0
        b_min = c.min_groups_per_step or c.groups_per_step
        target = max(b_min, min(self._fetch, c.groups_per_step))
        streaming = c.mode in ("tiderl", "stream")
        while len(taken) < target:
            need = target - len(taken)
            want = min(need, c.groups_per_microbatch) if streaming else need
            within = None
            if len(taken) >= b_min:
                # Elastic batch: B_min is in hand; wait for more only while the step stays
                # within τ·T_step of its start (the first step has no T_step: no waiting).
                within = t_step + c.elastic.tau * self._step_time - self.now()
                if len(self.buffer) == 0 and within <= 0:
                    break
            try:
                waited = await self._wait_ready(want, within)
            except _TimeUp:
                if not taken:
                    raise
                break  # out of time mid-step: train on the groups taken so far (elastic batch)
            if submitted == 0:
                twt += waited
            groups = self.buffer.take(want, train_version=self.version)
            self._changed.set()
            if not groups:
                if len(self.buffer) == 0 and not self.in_flight and (
                        self._producer is None or self._producer.done()):
                    break
                continue
            if not streaming:
                # One batch for the whole step: pack it in stream order, not finishing order,
                # so the same groups give the same update whatever the timing (summation order).
                groups.sort(key=lambda g: self.index_of.get(g.group_id, 1 << 62))
            taken += groups
            self._taken = taken
            seqs = [s for g in groups for s in g.seqs]
            final = len(taken) >= target
            for mb in self.hooks.make_microbatches(seqs, final):
                self.trainer.submit(mb)
                submitted += 1
        for mb in self.hooks.make_microbatches([], True):  # after an early end: the remainder
            self.trainer.submit(mb)
            submitted += 1
        if not submitted and self._exhausted:
            raise _StreamEnded
        if not submitted:
            raise RuntimeError("no trainable data: every group failed, was stale or had zero "
                               "reward variance; check the env server and controller settings")
        self._phase = "training"
        m = await self.trainer.finish_step_async()
        self._taken = []
        r = self.buffer.end_step(r, taken)
        step_time = self.now() - t_step
        # T_step, the mean duration of a full step (B_ideal groups): a step that ended early
        # at B_min counts as its time per group scaled up, so the elastic batch's wait budget
        # and the head-of-line threshold do not shrink with the batch.
        full = step_time * c.groups_per_step / max(1, len(taken))
        self._step_time = full if not self._step_time else 0.7 * self._step_time + 0.3 * full
        twt += float(m.get("time_wait", 0.0))
        finite = all(math.isfinite(float(m.get(k, 0.0))) for k in ("loss", "grad_norm"))
        if finite and not m.get("skipped", False):
            self.consumed_tokens += sum(g.action_tokens for g in taken)
            self.nonfinite = 0
        else:
            self.nonfinite += 1
            self.nonfinite_total += 1
            log.warning("step %d: non-finite loss/gradient; update skipped (%d in a row)",
                        self.step + 1, self.nonfinite)
        return {"train": m, "readiness": r, "taken": taken, "twt": twt, "step_time": step_time}

    # -- the loop --------------------------------------------------------------------------------
    def data_state(self) -> dict:
        """Task-stream position plus groups started but not yet trained (regenerated on resume)."""
        pending = sorted(self.index_of[g] for g in self.in_flight if g in self.index_of)
        # Ready groups, and those a step took but never trained (a run stopped mid-step).
        pending += sorted(self.index_of[g.group_id] for g in [*self.buffer.ready, *self._taken]
                          if g.group_id in self.index_of)
        return {"next_index": self.stream.position, "stream": self.stream.get_state(),
                "pending": sorted(set(pending) | set(self._regen))}

    async def run(self) -> dict:
        c = self.cfg
        self._t0 = self.starvation.last_trainable = self.now()
        self.last_eval = float("nan")
        await self._cold_start()
        self._ticker = asyncio.create_task(self._tick(), name="progress")
        stop: StarvedStop | None = None
        if c.mode != "sync":
            self._producer = asyncio.create_task(self._produce(), name="producer")
        evaluating = bool(c.eval_every and self.eval_groups)
        if evaluating:
            self._launch_eval()
        self._saved = self.step
        try:
            while self.step < c.steps and not self._stop:
                if c.time_limit_s and self.now() - self._t0 > c.time_limit_s:
                    self.end_reason = (f"time limit (controller.time_limit_s={c.time_limit_s:g})"
                                       f" reached after {self.step} of {c.steps} steps")
                    log.info("%s", self.end_reason)
                    break
                done, stop = await self._one_step()
                if done:
                    break
                if evaluating and self.step % c.eval_every == 0 and self.step < c.steps:
                    self._launch_eval()
            if not self.end_reason:
                self.end_reason = f"completed {self.step} of {c.steps} steps"
        finally:
            await self._stop_background()
        await self._wind_down(stop, evaluating)
        if stop is not None:
            stop.summary = self._summary()
            raise stop
        return self._summary()

    async def _one_step(self) -> tuple[bool, StarvedStop | None]:
        """Rolls out (sync mode) and trains one step, then the boundary, its record and its
        checkpoint. Returns (the run ends here, the stop to raise if it was starved)."""
        c = self.cfg
        t_roll = self.now()
        self._phase = "filling"
        try:
            if c.mode == "sync":
                await self._sync_rollout()
            rollout_s = self.now() - t_roll
            self._t_roll = (t_roll, self.now()) if c.mode == "sync" else None
            out = await self._train_step()
        except _TimeUp:
            self.end_reason = (
                f"time limit (controller.time_limit_s={c.time_limit_s:g}) reached after "
                f"{self.step} of {c.steps} steps while waiting for trainable data "
                f"(groups dropped so far: {dict(self.buffer.dropped)})")
            log.warning("%s", self.end_reason)
            return True, None
        except _StreamEnded:
            self.end_reason = (f"the task stream ended (env.epochs) after {self.step} of "
                               f"{c.steps} steps")
            log.info("%s", self.end_reason)
            return True, None
        except Starved as e:
            self.end_reason = f"stopped at step {self.step}: {e}"
            return True, StarvedStop(f"{e} Stopped at step {self.step} with a checkpoint; "
                                     "change the config, then --resume")
        out["t_train"] = (self._t_train_start, self.now())
        self.step += 1
        self.version = self.trainer.version
        self._phase = "eval"
        await self._await_eval()
        self._phase = "sync"
        sync_s = await self._boundary(out)
        self._changed.set()
        if c.mode == "sync":
            self.rwt += out["step_time"] + sync_s
            out["twt"] = rollout_s
        self._log_step(out, sync_s)
        if self.hooks.checkpoint is not None and c.checkpoint_every and (
                self.step % c.checkpoint_every == 0 or self.step == c.steps):
            await self.hooks.checkpoint(self.step, self.data_state())
            self._saved = self.step
        if self.nonfinite >= c.max_nonfinite_steps:
            if self.hooks.checkpoint is not None:
                await self.hooks.checkpoint(self.step, self.data_state())
            raise NonFiniteStop(
                f"{self.nonfinite} consecutive non-finite updates (skipped) at step "
                f"{self.step}; stopped with a checkpoint. Lower trainer.lr or raise "
                "trainer.grad_clip, then resume with --resume")
        return False, None

    async def _stop_background(self) -> None:
        """The producer and the progress ticker stop (the last progress line is shown)."""
        self._stop = True
        self._changed.set()
        self._show_progress(force=True)  # where the rollout stood as the run ends
        for task in (self._producer, self._ticker):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _wind_down(self, stop: StarvedStop | None, evaluating: bool) -> None:
        """After the loop: the last checkpoint, the final evaluation (none when stopping on an
        error), pending role changes, and the rollouts still in flight cancelled."""
        c = self.cfg
        if self.hooks.checkpoint is not None and (
                stop is not None or c.checkpoint_every and self.step > self._saved):
            # Ended early (time limit, stream exhausted, starved): the last weights are saved.
            await self.hooks.checkpoint(self.step, self.data_state())
        if stop is not None:  # no final evaluation: the run is stopping on an error
            if self._eval_task is not None:
                self._eval_task.cancel()
                await asyncio.gather(self._eval_task, return_exceptions=True)
        else:
            # A final evaluation of the last weights, then let in-flight rollouts finish or go.
            await self._await_eval()
            if evaluating:
                await self._evaluate(self.step, self.version)
        self.roles.finish_pending()
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
