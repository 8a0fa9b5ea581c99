"""A rollout rank's engine side, and the records it hands back. No JAX.

`EngineWorker` holds what runs on the rank's worker thread (`tiderl.serving.rank` drives it from
the event loop): one loop iteration's engine calls (control ops, a batch of prefills, one decode
step), the eviction of idle tasks when pages or slots run out, and each finished turn's
`TurnResult`. The records are the rank's per-task state (`_Task`), its counters (`RankStats`),
and what a migrating task takes along (`Handoff`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from tiderl.serving.pages import PoolExhaustedError, PrefillRequest, Prefix, StopReason


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
    steps: int = 0
    """Device rounds: the rank loop's iterations that ran an engine step (its prefills,
    decodes and queued ops together); `busy_s / steps` is a round's mean time."""
    shared_tokens: int = 0
    """Prompt tokens taken from a sibling's KV pages (prefix sharing) instead of computed."""
    restored_tokens: int = 0
    """Prompt tokens copied back from the engine's host KV tier instead of computed."""
    deferred_shares: int = 0
    """Prefills held back one loop iteration so a sibling computes their common prefix first."""

    @property
    def kv_hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


class EngineWorker:
    """The worker thread's half of `RolloutRank` (see the module docstring): everything here
    runs on that thread, but `_snapshot`, which the event loop calls too (`evict=False`). A
    mixin; it reads the rank's `engine`, `rank_id`, `stats`, `share_prefixes`, its decode
    state and the snapshot of its tasks that the current step sees."""

    rank_id: int
    engine: Any
    share_prefixes: bool
    stats: RankStats
    _state: Any
    _snap: dict[int, _Task]

    def _snapshot(self, t: _Task, *, evict: bool) -> Handoff:
        # Futures are cancelled on the loop thread only (close, the failed path).
        if not evict and t.future is not None and not t.future.done():
            t.future.cancel()
        p = t.prefix
        if p is None:
            return Handoff(None, t.pending, t.result, t.pending_images)
        if evict and p.slot is not None:
            self.engine.evict(p, offload=False)  # it leaves this rank: keep nothing of it
        # Host data only: its images' patches go with it (the new rank encodes them again).
        copy = dataclasses.replace(p, tokens=list(p.tokens), logprobs=list(p.logprobs),
                                   versions=list(p.versions), images=list(p.images),
                                   slot=None, kv_length=0, decoding=False)
        return Handoff(copy, t.pending, t.result, t.pending_images)

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
            self.stats.restored_tokens += getattr(c1, "prompt_tokens_restored", 0) - getattr(
                c0, "prompt_tokens_restored", 0)
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
