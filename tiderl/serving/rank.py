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
that long on the loop's clock before delivering the step's results, exactly where a real step's
results arrive when its device work ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from tiderl.serving.pages import PoolExhaustedError, PrefillRequest, Prefix, StopReason

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """The rank's engine raised; the rank is quarantined and its tasks must migrate."""


@dataclasses.dataclass
class Handoff:
    """What a migrating task takes from the rank it leaves (host data only)."""

    prefix: Prefix | None
    """A copy of its handle with no resident KV (None: it never reached the engine)."""
    unfed: list[int] | None
    """Tokens it was given for its current turn and never prefilled (None: none waiting)."""
    result: TurnResult | None = None
    """Its current turn, when it finished on the old rank but was never delivered."""
    unfed_images: list[Any] | None = None
    """The images whose placeholders `unfed` holds (a vision-language policy)."""


@dataclasses.dataclass
class TurnResult:
    """One finished turn: the action exactly as sampled, and the KV accounting of its prefill."""

    action_tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    """Weight version that sampled each action token (the handle's own record, so tokens
    sampled before a move or a weight sync keep their version)."""
    stop_reason: StopReason
    prompt_tokens: int
    """Context tokens the turn's prefill needed (vLLM's 'queried')."""
    cached_tokens: int
    """Of those, served from resident KV (the KV hit)."""
    computed_tokens: int
    rank: int


@dataclasses.dataclass
class _Task:
    prefix: Prefix | None
    sample_id: int = 0
    pending: list[int] | None = None
    future: asyncio.Future[TurnResult] | None = None
    result: TurnResult | None = None
    """The current turn's result once the worker finished it (kept until delivered)."""
    decoding: bool = False
    paused: bool = False
    last_used: float = 0.0
    turn_prompt: int = 0
    turn_cached: int = 0
    turn_computed: int = 0
    empty_action: bool = False
    temperature: float | None = None
    share_key: str | None = None
    """The task's GRPO group: siblings on this rank may share its context prefix's KV."""
    keep: float = 0.0
    """While paused: what its KV is worth to the scheduler; the lowest is evicted first."""
    max_action_tokens: int | None = None
    pending_images: list[Any] | None = None
    """The images whose placeholder tokens `pending` holds (until they are prefilled)."""


@dataclasses.dataclass
class RankStats:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    recomputed_evicted: int = 0
    """Prefill tokens recomputed because their KV had been evicted (pause or LRU)."""
    recomputed_version: int = 0
    """Prefill tokens recomputed because a weight sync flushed their KV."""
    prefill_batches: int = 0
    forced_evictions: int = 0
    pause_evictions: int = 0
    migrations_in: int = 0
    busy_s: float = 0.0
    """Seconds the engine worked (its executor calls, on the event loop's clock)."""
    shared_tokens: int = 0
    """Prompt tokens taken from a sibling's KV pages (prefix sharing) instead of computed."""
    deferred_shares: int = 0
    """Prefills held back one loop iteration so a sibling computes their common prefix first."""

    @property
    def kv_hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


class RolloutRank:
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
    def _snapshot(self, t: _Task, *, evict: bool) -> Handoff:
        # Futures are cancelled on the loop thread only (close, the failed path).
        if not evict and t.future is not None and not t.future.done():
            t.future.cancel()
        p = t.prefix
        if p is None:
            return Handoff(None, t.pending, t.result, t.pending_images)
        if evict and p.slot is not None:
            self.engine.evict(p)
        # Host data only: its images' patches go with it (the new rank encodes them again).
        copy = dataclasses.replace(p, tokens=list(p.tokens), logprobs=list(p.logprobs),
                                   versions=list(p.versions), images=list(p.images),
                                   slot=None, kv_length=0, decoding=False)
        return Handoff(copy, t.pending, t.result, t.pending_images)

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
                if self._take_cost is not None:  # simulated: its device time on the loop clock
                    finished, replies = self._device_step(ops, ready, dict(self.tasks))
                    cost = float(self._take_cost())
                    self.stats.busy_s += cost
                    await asyncio.sleep(cost)
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

    # Everything below runs on the worker thread.
    def _device_step(self, ops: list[tuple[str, Any]], ready: list[int],
                     tasks: dict[int, _Task]
                     ) -> tuple[list[tuple[int, TurnResult]], list[tuple[Any, Any]]]:
        eng = self.engine
        self._snap = tasks
        replies: list[tuple[Any, Any]] = []
        for op, arg in ops:
            if op == "release":
                t, fut = arg
                replies.append((fut, self._snapshot(t, evict=True)))
            elif op == "free":
                eng.free(arg)
            elif op == "evict":
                p = getattr(self._snap.get(arg), "prefix", None)
                if p is not None and p.slot is not None and not p.decoding:
                    eng.evict(p)
                    self.stats.pause_evictions += 1
            elif op == "weights":
                params, version, _ = arg
                eng.update_weights(params, version=version)
                # Actions in flight continue after a fresh prefill of what was flushed; one
                # whose KV is of the version synced (the same version again) keeps decoding.
                for t in self._snap.values():
                    if t.decoding and not (t.prefix is not None and t.prefix.decoding):
                        t.decoding = False
                        t.pending = t.pending or []
        batch = [tid for tid in ready
                 if tid in self._snap and self._snap[tid].pending is not None]
        finished = self._prefill_batch(batch)
        if any(t.decoding for t in self._snap.values()):
            finished += self._decode()
        return finished, replies

    def _prefill_batch(self, batch: list[int]) -> list[tuple[int, TurnResult]]:
        """Prefills `batch` (oldest first) in shared engine calls; returns the turns finished.

        Out of pages or slots: evict idle tasks (LRU) and retry; with nothing left to evict,
        shrink the batch from its newest end (those wait for the next step). The tasks' state
        is recorded right after the prefill, before any further engine call: if a later call
        of this step raises, each task hands over exactly what happened to it.
        """
        eng = self.engine
        many = getattr(eng, "prefill_many", None)
        share = self._share_sources(batch) if self.share_prefixes and many is not None else {}
        if share:
            batch = self._defer_followers(batch, share)
        while batch:
            reqs = [PrefillRequest(self._snap[tid].prefix, self._snap[tid].pending or [],
                                    len(self._snap[tid].pending or []),
                                    task_id=self._snap[tid].sample_id,
                                    temperature=self._snap[tid].temperature,
                                    share=share.get(self._snap[tid].share_key),
                                    max_action_tokens=self._snap[tid].max_action_tokens,
                                    images=self._snap[tid].pending_images)
                    for tid in batch]
            n_before = [len(r.existing_prefix.tokens) if r.existing_prefix else 0 for r in reqs]
            c0 = dataclasses.replace(eng.counters)
            try:
                if many is not None:
                    prefixes = many(None, reqs)
                else:  # an engine without batched prefill: one call per task, same semantics
                    if any(r.images for r in reqs[:1]):
                        raise ValueError(f"rank {self.rank_id}: its engine has no "
                                         "prefill_many, so it cannot take images")
                    prefixes = [eng.prefill(None, r.existing_prefix, r.tokens, r.true_length,
                                            task_id=r.task_id) for r in reqs[:1]]
                    batch = batch[:1]
            except PoolExhaustedError:
                if not self._evict_lru(exclude=set(batch)):
                    batch = batch[:-1]
                continue
            c1 = eng.counters
            self.stats.prefill_batches += 1
            self.stats.shared_tokens += getattr(c1, "prompt_tokens_shared", 0) - getattr(
                c0, "prompt_tokens_shared", 0)
            self.stats.recomputed_evicted += c1.recomputed_evicted - c0.recomputed_evicted
            self.stats.recomputed_version += c1.recomputed_version - c0.recomputed_version
            finished = []
            for tid, p, n0 in zip(batch, prefixes, n_before[:len(batch)], strict=True):
                t = self._snap[tid]
                self._after_prefill(t, p, n0)
                if p.done:
                    finished.append((tid, self._result(t)))
            for p in prefixes:
                if not p.done:
                    self._state = eng.insert(p, self._state)
            return finished
        return []

    def _resident(self, p: Prefix | None) -> bool:
        return p is not None and p.slot is not None and p.kv_length > 0 \
            and p.kv_version == self.engine.version

    def _share_sources(self, batch: list[int]) -> dict[str, list[Prefix]]:
        """Per group in `batch`: every handle of that group on this rank (the engine picks the
        resident one covering the longest common prefix)."""
        keys = {self._snap[tid].share_key for tid in batch} - {None}
        out: dict[str, list[Prefix]] = {k: [] for k in keys}
        for t in self._snap.values():
            if t.share_key in out and t.prefix is not None:
                out[t.share_key].append(t.prefix)
        return out

    def _defer_followers(self, batch: list[int], share: dict[str, list[Prefix]]) -> list[int]:
        """Holds back a task that must compute its whole context when a sibling earlier in the
        batch computes a different context with the same start (a flush or evictions dropped
        the group's KV): next iteration it takes the common prefix from that sibling. Identical
        contexts stay: the engine computes them once."""
        ps = getattr(getattr(self.engine, "cfg", None), "page_size", 1)
        first: dict[str, list[int]] = {}
        keep = []
        for tid in batch:
            t = self._snap[tid]
            key = t.share_key
            if key is None or self._resident(t.prefix) or any(
                    self._resident(p) for p in share.get(key, ())):
                keep.append(tid)
                continue
            ctx = (t.prefix.tokens if t.prefix is not None else []) + (t.pending or [])
            lead = first.get(key)
            if lead is None:
                first[key] = ctx
            elif ctx != lead and len(ctx) >= ps and ctx[:ps] == lead[:ps]:
                self.stats.deferred_shares += 1
                continue
            keep.append(tid)
        return keep

    def _after_prefill(self, t: _Task, p: Prefix, n_before: int) -> None:
        t.prefix, t.pending, t.pending_images = p, None, None
        t.last_used = time.monotonic()
        if p.stop_reason == StopReason.CONTEXT_LIMIT and len(p.tokens) == n_before:
            # Refused before running: the observation does not fit; the action is empty.
            t.decoding = False
            t.empty_action = True
            return
        t.turn_prompt += p.prefill_cached + p.prefill_computed
        t.turn_cached += p.prefill_cached
        t.turn_computed += p.prefill_computed
        t.decoding = not p.done

    def _decode(self) -> list[tuple[int, TurnResult]]:
        eng = self.engine
        while True:
            try:
                self._state, res = eng.generate(None, self._state)
                break
            except PoolExhaustedError:
                if not self._evict_lru(exclude=None):
                    # Only decoding tasks hold pages: preempt the one with least progress.
                    victim = min((tid for tid, t in self._snap.items() if t.decoding),
                                 key=lambda tid: len(self._snap[tid].prefix.action_tokens))
                    v = self._snap[victim]
                    eng.evict(v.prefix)
                    v.decoding, v.pending = False, []
                    self.stats.forced_evictions += 1
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(res.slots)
        out = []
        by_slot = {t.prefix.slot: (tid, t) for tid, t in self._snap.items()
                   if t.decoding and t.prefix is not None}
        for slot in res.slots.tolist():
            tid, t = by_slot[slot]
            t.last_used = time.monotonic()
            if t.prefix.done:
                t.decoding = False
                out.append((tid, self._result(t)))
        return out

    def _evict_lru(self, *, exclude: set[int] | None) -> bool:
        """Evicts one idle task's KV: paused ones first (CTB let them go), the lowest value
        to the scheduler first, then LRU."""
        idle = [(not t.paused, t.keep if t.paused else 0.0, t.last_used, tid)
                for tid, t in self._snap.items()
                if (exclude is None or tid not in exclude) and not t.decoding
                and t.prefix is not None and t.prefix.slot is not None]
        if not idle:
            return False
        *_, tid = min(idle)
        self.engine.evict(self._snap[tid].prefix)
        self.stats.forced_evictions += 1
        return True

    def _result(self, t: _Task) -> TurnResult:
        p = t.prefix
        assert p is not None
        empty = t.empty_action
        t.empty_action = False
        r = TurnResult(action_tokens=[] if empty else list(p.action_tokens),
                       logprobs=[] if empty else list(p.logprobs),
                       versions=[] if empty else list(p.versions), stop_reason=p.stop_reason,
                       prompt_tokens=t.turn_prompt, cached_tokens=t.turn_cached,
                       computed_tokens=t.turn_computed, rank=self.rank_id)
        s = self.stats
        s.turns += 1
        s.prompt_tokens += t.turn_prompt
        s.cached_tokens += t.turn_cached
        s.computed_tokens += t.turn_computed
        t.turn_prompt = t.turn_cached = t.turn_computed = 0
        t.result = r  # kept until delivered: a rank that fails now still hands it over
        return r
