"""RolloutRank: one engine driven across many tasks' turns. No JAX.

The rank owns one object that implements the engine contract (`tiderl.serving.engine`, or a
simulated engine) and one worker thread: every engine call runs there, in one executor call per
loop iteration (control ops, a batch of prefills, one decode step), and results come back to the
event loop through the executor's thread-safe callbacks. The event loop never touches the engine.

A task's turn: `await rank.turn(task_id, new_tokens)` appends the observation tokens (prefill
computes only what is not resident), decodes the action, and returns a `TurnResult`. Between
turns the task's KV stays resident. CTB's decisions arrive as `pause` (keep the KV, evictable
LRU when pages run short, or evict at once), `release` (migration: the KV is dropped and the
task's `Prefix`, host data only, moves to another rank that re-prefills it), and `finish`.
When the engine runs out of pages or slots, the rank evicts the least recently used idle task
(waiting on its environment or paused) and retries: that is all the baseline policy does, and
CTB's budgets make it rare.

A simulated engine (host data only, `tiderl.sim`) says so by having `take_cost_s()`: the device
seconds its calls since the last read would have taken. The rank then calls it on the loop
thread (a worker thread would cost real time, which a virtual-time loop cannot skip) and sleeps
that long on the loop's clock (its `wait_device`, where it has one: on a shared host the step
also waits for the interpreter lock) before delivering the step's results, exactly where a
real step's results arrive when its device work ends.

What runs on the worker thread (`EngineWorker`), and the records the rank hands back
(`TurnResult`, `Handoff`, `RankStats`), are in `tiderl.serving.rank_worker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from tiderl.serving.pages import Prefix
from tiderl.serving.rank_worker import EngineWorker, Handoff, RankStats, TurnResult, _Task

__all__ = ["Handoff", "RankFailedError", "RankStats", "RolloutRank", "TurnResult"]

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """The rank's engine raised; the rank is quarantined and its tasks must migrate."""


class RolloutRank(EngineWorker):
    """Drives one engine through the contract for many concurrent multi-turn tasks."""

    def __init__(self, rank_id: int, engine: Any, *, evict_on_pause: bool = False,
                 max_prefills_per_step: int = 8, share_prefixes: bool = True):
        self.rank_id = rank_id
        self.engine = engine
        self.evict_on_pause = evict_on_pause
        self.share_prefixes = share_prefixes
        """Siblings (tasks given the same `share_key`) share their common prefix's KV pages:
        a group's prompt is prefilled once per rank (engines whose `prefill_many` takes
        `PrefillRequest.share`; others ignore it)."""
        self.max_prefills_per_step = max_prefills_per_step
        self.tasks: dict[int, _Task] = {}
        self.stats = RankStats()
        self.failed: BaseException | None = None
        self._ops: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._runner: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"rank{rank_id}")
        self._state: Any = None
        self._snap: dict[int, _Task] = {}
        self._take_cost = getattr(engine, "take_cost_s", None)
        """A simulated engine's cost report (see the module docstring); None for a real one."""
        self._wait_device = getattr(engine, "wait_device", asyncio.sleep)
        """How a simulated step waits out its cost; a simulated engine on a shared host also
        waits for the interpreter lock and returns that wait's seconds."""

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Allocates the engine's state and starts the loop; an engine that fails here leaves
        the rank quarantined from the start (its turns raise RankFailedError), not the job."""
        loop = asyncio.get_running_loop()
        try:
            if self._take_cost is not None:
                self._state = self.engine.init_decode_state()
            else:
                self._state = await loop.run_in_executor(self._pool,
                                                         self.engine.init_decode_state)
        except Exception as e:  # a device failure: the other ranks carry on
            log.exception("rank %d failed to start", self.rank_id)
            self.failed = e
            return
        self._runner = asyncio.create_task(self._run(), name=f"rank{self.rank_id}")

    async def close(self) -> dict[int, Handoff]:
        """Stops the loop; hands back every task to migrate."""
        self._closed = True
        self._wake.set()
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
        # Requests the loop never reached are answered here, so nobody awaits them forever: a
        # release gets its task's handle (host data), a weight update has nothing left to do.
        ops, self._ops = self._ops, []
        for op, arg in ops:
            if op == "release" and not arg[1].done():
                arg[1].set_result(self._snapshot(arg[0], evict=False))
            elif op == "weights" and not arg[2].done():
                arg[2].set_result(None)
        handed = {tid: self._snapshot(self.tasks.pop(tid), evict=False)
                  for tid in list(self.tasks)}
        self._pool.shutdown(wait=True)
        return handed

    async def drain(self) -> dict[int, Handoff]:
        """Leaves rollout (ERS): the turns in flight here finish, then the loop stops and every
        task still held here is handed back (`close`). The caller has stopped sending turns
        (the scheduler took the rank out), so none start meanwhile."""
        while busy := [t.future for t in self.tasks.values()
                       if t.future is not None and not t.future.done()]:
            if not self.live:
                break
            await asyncio.wait(busy, timeout=1.0)
        return await self.close()

    # -- the caller's API (event-loop thread) ---------------------------------------------------
    @property
    def version(self) -> int:
        return int(self.engine.version)

    def turn(self, task_id: int, new_tokens: Sequence[int],
             prefix: Prefix | None = None, *, sample_id: int | None = None,
             temperature: float | None = None,
             share_key: str | None = None,
             max_action_tokens: int | None = None,
             images: Sequence[Any] | None = None) -> asyncio.Future[TurnResult]:
        """Appends `new_tokens` to the task's context and decodes its next action.

        `task_id` is the caller's key for the task (unique among its live tasks);
        `sample_id` keys its sampling (default: `task_id`); `prefix` adopts a migrated task's
        handle (its KV is re-prefilled here); `temperature` overrides the engine's for this
        task (evaluation decodes greedily with 0); `share_key` (its GRPO group) lets siblings
        on this rank share their common prefix's KV; `max_action_tokens` caps this action below
        the engine's own limit (an agent's max_tokens); `images` are the images whose
        placeholder runs `new_tokens` holds, in order (`vision_inputs.PatchedImage`s; a
        vision-language policy).
        """
        if self.failed is not None:
            raise RankFailedError(f"rank {self.rank_id} is quarantined: {self.failed!r}")
        t = self.tasks.get(task_id)
        handle = t.prefix if t is not None else prefix
        if not new_tokens and (handle is None or handle.done):
            raise ValueError(f"task {task_id}: an empty turn continues an unfinished action "
                             "only; this one has ended, so pass the next observation's tokens")
        if t is None:
            sid = prefix.task_id if prefix is not None else task_id if sample_id is None \
                else sample_id
            t = self.tasks[task_id] = _Task(prefix=prefix, sample_id=sid)
            if prefix is not None:
                self.stats.migrations_in += 1
        if t.future is not None and not t.future.done():
            raise RuntimeError(f"task {task_id} already has a turn in flight on rank "
                               f"{self.rank_id}")
        t.pending = list(new_tokens)
        t.pending_images = list(images) if images else None
        t.temperature = temperature
        t.share_key = share_key
        t.max_action_tokens = max_action_tokens
        t.paused = False
        t.result = None
        t.future = asyncio.get_running_loop().create_future()
        self._wake.set()
        return t.future

    def pause(self, task_id: int, keep: float = 0.0) -> None:
        """CTB paused the task: keep its KV evictable (or evict now, per `evict_on_pause`);
        when pages run short, paused tasks of the lowest `keep` go first."""
        t = self.tasks.get(task_id)
        if t is None:
            return
        t.paused = True
        t.keep = keep
        if self.evict_on_pause and not t.decoding and t.pending is None:
            self._ops.append(("evict", task_id))
            self._wake.set()

    def resume(self, task_id: int) -> None:
        """CTB resumed the task here: its pending turn may run again."""
        t = self.tasks.get(task_id)
        if t is not None and t.paused:
            t.paused = False
            self._wake.set()

    async def release(self, task_id: int) -> Handoff:
        """The task migrates away (see `Handoff`); its KV here is dropped."""
        if task_id not in self.tasks:
            return Handoff(None, None)
        if not self.live:
            return self._snapshot(self.tasks.pop(task_id), evict=False)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._ops.append(("release", (self.tasks.pop(task_id), done)))
        self._wake.set()
        return await done

    def finish(self, task_id: int) -> None:
        """The task ended: its slot and pages are freed (a quarantined rank only forgets it)."""
        t = self.tasks.pop(task_id, None)
        if self.failed is None and t is not None and t.prefix is not None \
                and t.prefix.slot is not None:
            self._ops.append(("free", t.prefix))
            self._wake.set()

    async def update_weights(self, params: Any, version: int) -> None:
        """Swaps weights between engine steps; stale KV is flushed, in-flight actions continue
        after a fresh prefill. A quarantined rank (or one failing meanwhile) returns at once:
        its tasks migrate and its weights no longer matter, so a sync never waits on it."""
        if not self.live:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._ops.append(("weights", (params, version, done)))
        self._wake.set()
        with contextlib.suppress(RankFailedError):
            await done

    @property
    def live(self) -> bool:
        """Its loop runs and its engine has not failed."""
        return self.failed is None and self._runner is not None and not self._runner.done()

    def kv_stats(self) -> dict[str, float]:
        s = self.engine.stats() if hasattr(self.engine, "stats") else {}
        return {**s, "active": sum(not t.paused for t in self.tasks.values()),
                "paused": sum(t.paused for t in self.tasks.values())}

    # -- internals ------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                ops, self._ops = self._ops, []
                ready = [tid for tid, t in self.tasks.items()
                         if t.pending is not None and not t.paused]
                ready.sort(key=lambda tid: self.tasks[tid].last_used)
                ready = ready[: self.max_prefills_per_step]
                decoding = any(t.decoding for t in self.tasks.values())
                if not ops and not ready and not decoding:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self.stats.steps += 1
                if self._take_cost is not None:  # simulated: its device time on the loop clock
                    finished, replies = self._device_step(ops, ready, dict(self.tasks))
                    cost = float(self._take_cost())
                    self.stats.busy_s += cost
                    # A shared host's lock wait (seconds beyond the cost) is busy time too.
                    self.stats.busy_s += await self._wait_device(cost) or 0.0
                else:
                    # Busy time on the loop's clock, the one the scheduler reads.
                    t0 = loop.time()
                    # The worker sees a snapshot: the loop thread adds and removes tasks while
                    # a step runs, and only the loop thread mutates `self.tasks`.
                    finished, replies = await loop.run_in_executor(
                        self._pool, self._device_step, ops, ready, dict(self.tasks))
                    self.stats.busy_s += loop.time() - t0
                for fut, value in replies:
                    if not fut.done():
                        fut.set_result(value)
                for tid, result in finished:
                    t = self.tasks.get(tid)
                    if t is not None and t.future is not None and not t.future.done():
                        t.future.set_result(result)
                        t.result = None
                for op, arg in ops:
                    if op == "weights" and not arg[2].done():
                        arg[2].set_result(None)
        except Exception as e:  # a bug or device failure: quarantine, hand tasks back
            log.exception("rank %d failed", self.rank_id)
            self.failed = e
            for t in self.tasks.values():
                if t.future is not None and not t.future.done():
                    t.future.set_exception(RankFailedError(f"rank {self.rank_id}: {e!r}"))
            for op, arg in self._ops:
                fut = arg[2] if op == "weights" else arg[1] if op == "release" else None
                if fut is not None and not fut.done():
                    fut.set_exception(RankFailedError(f"rank {self.rank_id}: {e!r}"))
