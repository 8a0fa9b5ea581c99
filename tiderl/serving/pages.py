"""Host side of the paged KV cache: page allocator, page tables, sharing, and the engine's
host-side contract types (Prefix handles, stop reasons, results, counters). No JAX.

The device pool has `num_pages` real pages plus one scratch page (index `num_pages`, "trash"):
padded rows and padded tokens write there and page tables are padded with it, so jitted
kernels never need a branch and never touch a page they do not own.

Pages are reference counted: GRPO siblings made by `fork` share every page of the parent;
a shared page is copied (copy-on-write) the first time a sequence writes into it, which in
practice is the last, partial page of the prompt.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from tiderl.serving.mrope import ImageSpan, shared_prefix


class PoolExhaustedError(RuntimeError):
    """The KV page pool (or the slot table) cannot hold what was asked; nothing was changed."""


class StaleKVError(RuntimeError):
    """A slot's KV was computed with older weights than the engine now holds."""


class StopReason(enum.IntEnum):
    """Why a slot stopped decoding its current action (NONE while it is still going)."""

    NONE = 0
    STOP_TOKEN = 1
    MAX_ACTION_TOKENS = 2
    CONTEXT_LIMIT = 3


class PageAllocator:
    """Free list, per-slot page tables and reference counts; capacity fixed at construction."""

    def __init__(self, *, num_pages: int, page_size: int, max_slots: int,
                 max_pages_per_slot: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.max_slots, self.max_pages_per_slot = max_slots, max_pages_per_slot
        self.trash = num_pages
        # Pop from the end: the lowest page ids are handed out first (easier to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.refcount = np.zeros(num_pages, np.int32)
        self.tables: list[list[int]] = [[] for _ in range(max_slots)]
        self.in_use = np.zeros(max_slots, bool)

    # -- slots ---------------------------------------------------------------------------------
    def open(self, slot: int | None = None) -> int:
        """Claims `slot` (or the lowest free one) with an empty page table."""
        if slot is None:
            free = np.flatnonzero(~self.in_use)
            if free.size == 0:
                raise PoolExhaustedError(
                    f"no free slot: all rollout.max_slots={self.max_slots} slots hold a task; "
                    "raise rollout.max_slots or evict/free a task first")
            slot = int(free[0])
        elif self.in_use[slot]:
            raise ValueError(f"slot {slot} is already in use; free or evict it first")
        self.in_use[slot] = True
        self.tables[slot] = []
        return slot

    def close(self, slot: int) -> None:
        """Releases the slot and drops its references to its pages."""
        self._check_open(slot)
        self.release_pages(slot)
        self.in_use[slot] = False

    def release_pages(self, slot: int) -> None:
        """Drops the slot's page references (pages return to the free list at refcount 0)."""
        self._check_open(slot)
        for page in self.tables[slot]:
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(page)
        self.tables[slot] = []

    def move(self, src: int, dst: int) -> None:
        """Moves a page table to another slot (no KV is copied)."""
        self._check_open(src)
        self.open(dst)
        self.tables[dst], self.tables[src] = self.tables[src], []
        self.in_use[src] = False

    def fork(self, slot: int, n: int) -> list[int]:
        """n new slots whose page tables share all of `slot`'s pages (refcounts +1 each)."""
        self._check_open(slot)
        free = np.flatnonzero(~self.in_use)
        if free.size < n:
            raise PoolExhaustedError(
                f"fork needs {n} free slots but only {free.size} of rollout.max_slots="
                f"{self.max_slots} are free; raise rollout.max_slots or fork fewer siblings")
        children = [int(s) for s in free[:n]]
        for child in children:
            self.in_use[child] = True
            self.tables[child] = list(self.tables[slot])
            for page in self.tables[slot]:
                self.refcount[page] += 1
        return children

    def share(self, slot: int, source: int, n_pages: int) -> None:
        """Gives the open, empty `slot` the first `n_pages` pages of `source` (refcounts +1).

        The prefix sharing of GRPO siblings: their common prompt's pages are held once, and the
        first write into a shared page copies it (`reserve`)."""
        self._check_open(slot)
        self._check_open(source)
        if self.tables[slot]:
            raise ValueError(f"slot {slot} already holds pages; share into an empty slot")
        if not 0 < n_pages <= len(self.tables[source]):
            raise ValueError(f"share: slot {source} holds {len(self.tables[source])} pages, "
                             f"cannot share {n_pages}")
        self.tables[slot] = self.tables[source][:n_pages]
        for page in self.tables[slot]:
            self.refcount[page] += 1

    # -- pages ---------------------------------------------------------------------------------
    def pages_needed(self, slot: int, start: int, end: int) -> int:
        """Free pages `reserve(slot, start, end)` would take (new pages + copy-on-write)."""
        self._check_open(slot)
        table = self.tables[slot]
        n_need = -(-end // self.page_size)
        if n_need > self.max_pages_per_slot:
            raise ValueError(
                f"slot {slot}: {end} tokens need {n_need} pages but a slot holds at most "
                f"{self.max_pages_per_slot} (rollout.max_context / rollout.page_size); "
                "raise rollout.max_context or end the task at its context limit")
        first = start // self.page_size
        shared = sum(1 for i in range(first, min(len(table), n_need))
                     if self.refcount[table[i]] > 1)
        return max(0, n_need - len(table)) + shared

    def reserve(self, slot: int, start: int, end: int) -> list[tuple[int, int]]:
        """Makes token positions [start, end) of `slot` writable by it alone.

        Appends new pages and replaces shared pages in the range by private copies. Returns the
        (src, dst) page copies the device must do before writing. Atomic: on PoolExhaustedError
        nothing changed.
        """
        if end <= start:
            return []
        need = self.pages_needed(slot, start, end)
        if need > len(self._free):
            raise PoolExhaustedError(
                f"KV page pool exhausted: slot {slot} needs {need} more pages, "
                f"{len(self._free)} free of rollout.num_pages={self.num_pages} "
                f"(page_size={self.page_size}); raise rollout.num_pages, lower "
                "rollout.max_slots, or evict/pause tasks")
        table = self.tables[slot]
        copies = []
        n_need = -(-end // self.page_size)
        for i in range(start // self.page_size, min(len(table), n_need)):
            page = table[i]
            if self.refcount[page] > 1:
                new = self._take()
                self.refcount[page] -= 1
                table[i] = new
                copies.append((page, new))
        while len(table) < n_need:
            table.append(self._take())
        return copies

    def _take(self) -> int:
        page = self._free.pop()
        self.refcount[page] = 1
        return page

    def _check_open(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or not self.in_use[slot]:
            raise ValueError(f"slot {slot} is not open (valid open slots: "
                             f"{np.flatnonzero(self.in_use).tolist()})")

    # -- views ---------------------------------------------------------------------------------
    def table_array(self, slots: list[int], rows: int) -> np.ndarray:
        """int32 [rows, max_pages_per_slot] page tables for `slots`, padded with the trash page."""
        out = np.full((rows, self.max_pages_per_slot), self.trash, np.int32)
        for r, slot in enumerate(slots):
            table = self.tables[slot]
            out[r, : len(table)] = table
        return out

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        """Distinct pages held by any slot (a page shared by siblings counts once)."""
        return self.num_pages - len(self._free)

    @property
    def pages_shared(self) -> int:
        """Pages referenced by more than one slot."""
        return int(np.count_nonzero(self.refcount > 1))

    def check(self) -> None:
        """Asserts the allocator's invariants (tests and debugging)."""
        counts = np.zeros(self.num_pages, np.int32)
        for slot in range(self.max_slots):
            if not self.in_use[slot]:
                assert not self.tables[slot], f"closed slot {slot} holds pages"
            assert len(self.tables[slot]) <= self.max_pages_per_slot
            assert len(set(self.tables[slot])) == len(self.tables[slot]), "page twice in a table"
            for page in self.tables[slot]:
                counts[page] += 1
        assert np.array_equal(counts, self.refcount), "refcounts disagree with the page tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice (double free)"
        used = set(np.flatnonzero(counts).tolist())
        assert not free & used, "a page is both free and in use"
        assert free | used == set(range(self.num_pages)), "a page leaked"


@dataclasses.dataclass(eq=False)
class Prefix:
    """A task's handle: its full context as token ids and where its KV lives.

    Owned by the caller across turns, pauses and evictions; the engine updates it in place.
    `tokens[:kv_length]` are resident in KV (of weight version `kv_version`) when `slot` is not
    None; the tokens after `kv_length` (the last sampled token, a new observation, or everything
    after an eviction or a flush) are computed by the next `prefill`.
    """

    task_id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """Logprob of every token sampled by the engine, aligned with `tokens[action_start:]` of
    the current action only (cleared when an observation starts a new action)."""
    versions: list[int] = dataclasses.field(default_factory=list)
    """Weight version that produced each entry of `logprobs` (a flush can split an action)."""
    slot: int | None = None
    kv_length: int = 0
    kv_version: int = -1
    """The engine weight version its resident KV was computed with (stale once the engine's
    `version` moves on). Weight versions have one source, the trainer's `version`: a weight
    sync stamps it on each engine (`Engine.version`), the engine stamps it on each sampled
    token (`versions`, then `Trajectory.versions`) and on KV it computes (here); the
    controller's `version` is its copy after each step."""
    action_start: int = 0
    temperature: float = 1.0
    max_action_tokens: int = 1
    stop_reason: StopReason = StopReason.NONE
    decoding: bool = False
    computed_max: int = 0
    drop_reason: str = "new"
    prefill_computed: int = 0
    """Tokens the last prefill computed (new + recomputed)."""
    prefill_cached: int = 0
    """Tokens the last prefill served from resident KV."""
    images: list[ImageSpan] = dataclasses.field(default_factory=list)
    """The context's images (vision-language policies), in order: each one's placeholder run
    in `tokens` and its patches, kept on the host so a prefill after an eviction, a flush or a
    migration encodes them again (serving/mrope.py)."""

    @property
    def rope_delta(self) -> int:
        """M-RoPE position minus token index of the text after its images (0 for text)."""
        return sum(s.advance - s.n_tokens for s in self.images)

    @property
    def action_tokens(self) -> list[int]:
        """Tokens sampled for the current action."""
        return self.tokens[self.action_start:]

    @property
    def done(self) -> bool:
        return self.stop_reason != StopReason.NONE


@dataclasses.dataclass
class PrefillRequest:
    """One task's part of `Engine.prefill_many` (the arguments of `prefill`)."""

    existing_prefix: Prefix | None
    tokens: Any
    true_length: int
    task_id: int | None = None
    temperature: float | None = None
    max_action_tokens: int | None = None
    share: Any = None
    """Prefix sharing (None: off). Handles of the task's GRPO siblings on this engine, any of
    which may hold the task's context prefix resident: a task with no resident KV then takes
    the longest common prefix's pages copy-on-write instead of computing it, and siblings
    with identical contexts in one call (a group's prompt) compute it once."""
    images: Any = None
    """The images whose placeholder runs `tokens[:true_length]` holds, in order (each a
    `vision_inputs.PatchedImage`: the image processor's patch rows and grid_thw); a
    vision-language policy only."""


@dataclasses.dataclass
class ResultTokens:
    """One decode step's results, from one device→host copy, one row per decoded slot."""

    slots: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    """Context length of the slot's task after this token."""
    stop_reasons: np.ndarray
    filtered: bool = False
    """True when top-k/top-p truncated sampling; logprobs are still full-vocabulary."""

    def get_result_at_slot(self, slot: int) -> tuple[int, float, StopReason]:
        (row,) = np.flatnonzero(self.slots == slot)
        return int(self.tokens[row]), float(self.logprobs[row]), StopReason(self.stop_reasons[row])


@dataclasses.dataclass
class EngineCounters:
    """Token accounting (vLLM prefix-cache definitions, in tokens) and step counts."""

    prompt_tokens_queried: int = 0
    prompt_tokens_served: int = 0
    computed_new: int = 0
    recomputed_evicted: int = 0
    recomputed_version: int = 0
    decode_tokens: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    page_copies: int = 0
    prompt_tokens_shared: int = 0
    """Of `prompt_tokens_served`, tokens taken from a sibling's pages (prefix sharing)."""
    shared_samples: int = 0
    """Prefills that computed nothing: the first token was sampled from a sibling's logits."""
    images_encoded: int = 0
    """Images the vision tower encoded (a vision-language policy; again after an eviction)."""
    prompt_tokens_restored: int = 0
    """Of `prompt_tokens_served`, tokens copied back from the host KV tier (not resident on
    the device when queried; `rollout.host_kv_pages`)."""
    host_offloads: int = 0
    """Evictions whose KV the host tier kept."""
    host_restores: int = 0
    """Prefills that copied a task's KV back from the host tier."""

    @property
    def kv_hit_rate(self) -> float:
        return self.prompt_tokens_served / max(1, self.prompt_tokens_queried)

    @property
    def kv_device_hit_rate(self) -> float:
        """Prompt tokens found resident on the device (the host tier's restores left out)."""
        return ((self.prompt_tokens_served - self.prompt_tokens_restored)
                / max(1, self.prompt_tokens_queried))

    def count_prefill(self, h: Any, start: int, end: int) -> None:
        """A prefill of `h`'s context `[start, end)` on top of `start` resident tokens: the
        queried/served prompt tokens, and what was computed split into new tokens and tokens
        computed before whose KV was dropped (evicted, or stale after a weight version)."""
        h.prefill_computed, h.prefill_cached = end - start, start
        self.prompt_tokens_queried += end
        self.prompt_tokens_served += start
        redo = max(0, min(end, h.computed_max) - start)
        if h.drop_reason == "evicted":
            self.recomputed_evicted += redo
        elif h.drop_reason == "version":
            self.recomputed_version += redo
        else:
            self.computed_new += redo
        self.computed_new += end - start - redo


def common_prefix(a, b, limit: int) -> int:
    """Length of the common prefix of sequences `a` and `b`, at most `limit` (slice compares
    run in C: a binary search over them beats a Python loop over thousands of tokens)."""
    if tuple(a[:limit]) == tuple(b[:limit]):
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tuple(a[lo:mid]) == tuple(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def best_source(h: Prefix, ctx, share, version: int,
                spans: Any = ()) -> tuple[Prefix | None, int]:
    """The sibling in `share` whose resident KV of weight `version` covers the longest prefix
    of `ctx` (h's context, with images `spans`), and that length (prefix sharing of GRPO
    siblings): equal token ids and, up to there, the same images."""
    best, best_n = None, 0
    for s in share:
        if s is h or s.slot is None or not s.kv_length or s.kv_version != version:
            continue
        n = common_prefix(ctx, s.tokens, min(len(ctx), s.kv_length))
        if spans or s.images:
            n = shared_prefix(spans, s.images, n)
        if n > best_n:
            best, best_n = s, n
    return best, best_n


def fork_children(h: Prefix, n: int, task_ids, version: int) -> list[Prefix]:
    """`fork`'s n siblings of `h` holding its resident context (no slot yet): its tokens up to
    `kv_length` and the action's logprobs so far. Raises ValueError, naming the task, when the
    ids do not match `n` or `h` has no current resident KV."""
    if len(task_ids) != n:
        raise ValueError(f"fork: got {len(task_ids)} task_ids for n={n} siblings")
    if h.slot is None or not h.kv_length or h.kv_version != version:
        raise ValueError(f"fork: task {h.task_id} has no current resident KV; prefill it "
                         "first")
    n_act = max(0, h.kv_length - h.action_start)
    children = []
    for tid in task_ids:
        child = Prefix(task_id=int(tid), tokens=h.tokens[: h.kv_length],
                       kv_length=h.kv_length, kv_version=h.kv_version,
                       action_start=min(h.action_start, h.kv_length),
                       temperature=h.temperature, max_action_tokens=h.max_action_tokens,
                       computed_max=h.kv_length,
                       images=[s for s in h.images if s.end <= h.kv_length])
        child.logprobs, child.versions = h.logprobs[:n_act], h.versions[:n_act]
        children.append(child)
    return children
