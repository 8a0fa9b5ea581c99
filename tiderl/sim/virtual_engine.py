"""SimEngine: the engine contract on host data only, with a KV pool and a cost per call. No JAX.

It keeps what the real engine (`tiderl.serving.engine`) keeps on the host — each task's tokens,
which of them are resident in KV and of which weight version, pages per slot, the
vLLM-style prefix-cache counters — and follows its rules: `prefill_many` is all-or-nothing on
pages and slots, a prefill computes only what is not resident (everything after an eviction or
a weight flush), decode needs a page for every token it writes, a full pool raises
`PoolExhaustedError` with nothing changed, GRPO siblings share their context's compute as in
`tiderl.serving.share` (each sibling's pages are still charged to the pool: the simulator
does not count a shared page once). No numbers are computed: actions are drawn from an
`ActionModel` keyed by (task, position), so a trajectory does not depend on batching.

Time: every call adds its cost under a `SimCostModel` (the engine's batching rules applied: chunks,
buckets, padding) to a running total the rank reads with `take_cost_s()` and charges to the
loop's clock (see `tiderl.serving.rank`). With `decode_steps_per_call = k > 1`, one `generate`
runs up to k decode steps (vLLM's multi-step scheduling): slots whose action ends inside the
call stop there, and the call costs the sum of its steps over the shrinking batch.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tiderl.serving.pages import (
    EngineCounters,
    PoolExhaustedError,
    PrefillRequest,
    Prefix,
    ResultTokens,
    StopReason,
    best_source,
    fork_children,
)
from tiderl.sim.costs import SimCostModel

DIGITS = [ord(str(d)) for d in range(1, 10)]
FILLER = ord("a")


def _u64(*key: Any) -> int:
    # Stable across processes (str hashes are salted per process).
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class ActionModel(Protocol):
    filler: int | None
    """The token every action token but a stop is (None: ask `token` for each)."""

    def length(self, task_id: int, position: int) -> int:
        """Tokens of the action that starts at `position` of task `task_id` (stop included)."""

    def token(self, task_id: int, position: int, last: bool) -> int:
        """The token sampled at `position` (the stop token when `last` and the action stops)."""


class DigitActions:
    """The default task's actions: one random digit per token, `length` tokens (no stop)."""

    filler = None

    def __init__(self, seed: int, length: int = 1):
        self.seed, self.n = seed, length

    def length(self, task_id: int, position: int) -> int:
        return self.n

    def token(self, task_id: int, position: int, last: bool) -> int:
        return DIGITS[_u64(self.seed, task_id, position) % len(DIGITS)]


class SimEngine:
    """The engine contract without a model (see the module docstring)."""

    def __init__(self, *, seed: int = 0, max_action_tokens: int = 1, max_context: int = 512,
                 stop_tokens: tuple[int, ...] = (), costs: SimCostModel | None = None,
                 num_pages: int | None = None, page_size: int = 16,
                 max_slots: int | None = None, actions: ActionModel | None = None,
                 gpus: int = 1, decode_steps_per_call: int | None = None,
                 host: Any = None, image_token: int | None = None):
        self.seed, self.version = seed, 0
        self.image_token = image_token
        """The simulated image token: a prefill also runs the model's vision tower over the
        images of the image tokens it computes (`SimCostModel.prefill`)."""
        self.max_action_tokens, self.max_context = max_action_tokens, max_context
        self.stop_tokens = tuple(stop_tokens)
        self.costs, self.gpus = costs, gpus
        self.host = host
        """A `tiderl.sim.host.SharedHost` when rollout shares its host with the trainer."""
        self.num_pages, self.page_size = num_pages, page_size
        self.max_slots = max_slots
        self.actions = actions or DigitActions(seed)
        k = decode_steps_per_call or (costs.rules.decode_steps_per_call if costs else 1)
        self.decode_steps_per_call = max(1, int(k))
        self.counters = EngineCounters()
        self.slots: dict[int, Prefix] = {}
        self._pages: dict[int, int] = {}
        self.pages_free = num_pages if num_pages is not None else 1 << 62
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._planned_len: dict[tuple[int, int], int] = {}
        self._prompts: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        """First prompts whose logits the real engine keeps (context -> weight version)."""
        self._cost = 0.0
        self._decode_cost: Any = None
        self.busy_s = 0.0
        """Device seconds charged so far."""

    # -- cost report (read by RolloutRank) ---------------------------------------------------
    def take_cost_s(self) -> float:
        c, self._cost = self._cost, 0.0
        return self.host.fixed(c) if self.host is not None else c

    async def wait_device(self, seconds: float) -> float:
        """The rank's wait for a step of `seconds`; returns the seconds it waited beyond them
        (on a shared host, for the interpreter lock: `SharedHost.device_call`)."""
        if self.host is not None:
            return await self.host.device_call(seconds)
        await asyncio.sleep(seconds)
        return 0.0

    def _charge(self, seconds: float) -> None:
        self._cost += seconds
        self.busy_s += seconds

    # -- lifecycle ---------------------------------------------------------------------------
    def init_decode_state(self) -> dict:
        return {}

    def update_weights(self, params: Any, *, version: int | None = None,
                       flush: bool = True) -> None:
        self.version = self.version + 1 if version is None else version
        if flush:
            for p in self.slots.values():
                if p.kv_length and p.kv_version != self.version:
                    self._drop_kv(p, "version")

    # -- pages -------------------------------------------------------------------------------
    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _open(self, p: Prefix) -> None:
        if self._free_slots:
            p.slot = self._free_slots.pop()
        else:
            p.slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.slots[p.slot] = p
        self._pages[p.slot] = 0

    def _resize(self, p: Prefix, n_tokens: int) -> None:
        need = self._pages_for(n_tokens) - self._pages[p.slot]
        if need > 0:
            self.pages_free -= need
            self._pages[p.slot] += need

    def _drop_kv(self, p: Prefix, reason: str) -> None:
        if p.slot is not None:
            self.pages_free += self._pages[p.slot]
            self._pages[p.slot] = 0
        p.kv_length, p.decoding, p.drop_reason = 0, False, reason

    def _close(self, p: Prefix) -> None:
        if p.slot is None:
            return
        self.pages_free += self._pages.pop(p.slot)
        del self.slots[p.slot]
        self._free_slots.append(p.slot)
        p.slot, p.decoding = None, False

    @property
    def pages_in_use(self) -> int:
        return sum(self._pages.values())

    # -- the contract ------------------------------------------------------------------------
    def prefill(self, params, existing_prefix: Prefix | None, tokens, true_length: int, *,
                task_id: int | None = None, temperature: float | None = None,
                max_action_tokens: int | None = None) -> Prefix:
        return self.prefill_many(params, [PrefillRequest(
            existing_prefix, tokens, true_length, task_id=task_id, temperature=temperature,
            max_action_tokens=max_action_tokens)])[0]

    def prefill_many(self, params, requests: Sequence[PrefillRequest]) -> list[Prefix]:
        handles, sized = [], []
        for r in requests:
            n_new = r.true_length
            if not 0 <= n_new <= len(r.tokens):
                raise ValueError(f"true_length={n_new} exceeds "
                                 f"len(tokens)={len(list(r.tokens)[:n_new])}")
            h = r.existing_prefix
            if h is None:
                if r.task_id is None:
                    raise ValueError("prefill of a new task needs task_id= (it keys sampling)")
                h = Prefix(task_id=int(r.task_id), max_action_tokens=self.max_action_tokens)
            if not n_new and h.done:
                raise ValueError(f"task {h.task_id}: its action already ended "
                                 f"({h.stop_reason.name}); append the next observation")
            if not n_new and not h.tokens:
                raise ValueError(f"task {h.task_id}: nothing to prefill (empty context)")
            if r.max_action_tokens is not None:
                h.max_action_tokens = r.max_action_tokens
            if r.temperature is not None:
                h.temperature = r.temperature
            handles.append(h)
            sized.append((r, h, n_new))
        live = []  # (request, handle, end) of the rows that fit the context
        for r, h, n_new in sized:
            end = len(h.tokens) + n_new
            if end + 1 > self.max_context:
                h.stop_reason, h.decoding = StopReason.CONTEXT_LIMIT, False
                continue
            if h.slot is not None and h.kv_length and h.kv_version != self.version:
                self._drop_kv(h, "version")
            live.append((r, h, end))
        # Pages and slots depend only on each row's end (a row served by a sibling still
        # holds its whole context), so capacity is checked before the new tokens are copied
        # and the sharing below compares whole contexts: a full pool (the rank then evicts one
        # task and retries) costs a pass over the rows. A stale sibling is skipped by
        # `best_source` whether or not its KV was dropped yet, so dropping them all first
        # changes no source.
        self._check_capacity([(h, end) for _, h, end in live])
        rows = []  # (handle, new tokens, start, end, tokens taken from a sibling)
        follow = []  # (handle, new tokens, end): whole context at a sibling, nothing computed
        leaders: dict[tuple[int, ...], Prefix] = {}
        firsts: list[tuple[int, ...]] = []
        for r, h, end in live:
            tokens = r.tokens
            new = tokens[:r.true_length] if type(tokens) is list else list(tokens)[
                :r.true_length]
            start, taken = min(h.kv_length, end - 1), 0
            if r.share is not None and not h.kv_length:
                # The real engine's sibling sharing (tiderl.serving.share): the same context
                # computed by a row of this call or resident at a sibling with its prompt's
                # logits kept costs nothing; else the longest resident common prefix of at
                # least a page is taken and only the rest computed.
                ctx = (*h.tokens, *new)
                src, n = (None, 0) if ctx in leaders else best_source(h, ctx, r.share,
                                                                     self.version)
                if ctx in leaders or (n == end and self._prompts.get(ctx) == self.version):
                    follow.append((h, new, end))
                    continue
                if src is not None and n >= self.page_size:
                    start = taken = min(n, end - 1)
                leaders[ctx] = h
                if not h.tokens:
                    firsts.append(ctx)
            rows.append((h, new, start, end, taken))
        for h, _, _start, end, _ in rows:
            if h.slot is None:
                self._open(h)
            self._resize(h, end)
        for h, _, end in follow:
            if h.slot is None:
                self._open(h)
            self._resize(h, end)
        if self.costs is not None and rows:
            self._charge(self.costs.prefill([(s, e - s) for _, _, s, e, _ in rows], self.gpus,
                                            image_tokens=self._image_tokens(rows)))
        if follow and self.costs is not None:
            self._charge(self.costs.sample(len(follow)))
        c = self.counters
        for h, new, start, end, taken in rows:
            self._after_prefill(h, new, start, end)
            c.prompt_tokens_shared += taken
        for h, new, end in follow:
            self._after_prefill(h, new, end, end)
            c.prompt_tokens_shared += end
            c.shared_samples += 1
        for ctx in firsts:  # the real engine keeps these prompts' logits (LRU, max_slots)
            self._prompts[ctx] = self.version
            self._prompts.move_to_end(ctx)
            while len(self._prompts) > (self.max_slots or 1 << 30):
                self._prompts.popitem(last=False)
        return handles

    def _image_tokens(self, rows: Sequence[tuple[Prefix, list[int], int, int, int]]) -> int:
        """Image tokens among the positions [start, end) the rows compute (of each context,
        its resident tokens followed by the new ones)."""
        tok = self.image_token
        if tok is None:
            return 0
        n = 0
        for h, new, start, end, _ in rows:
            held = len(h.tokens)
            if start < held:
                n += h.tokens[start:min(end, held)].count(tok)
            n += new[max(0, start - held):max(0, end - held)].count(tok)
        return n

    def _after_prefill(self, h: Prefix, new: list[int], start: int, end: int) -> None:
        c = self.counters
        h.tokens.extend(new)
        if new:
            h.action_start, h.logprobs, h.versions = end, [], []
            h.stop_reason = StopReason.NONE
        c.count_prefill(h, start, end)
        h.kv_length, h.kv_version, h.drop_reason = end, self.version, "new"
        h.computed_max = max(h.computed_max, end)
        c.prefill_calls += 1
        self._sample(h, 1)
        h.decoding = False

    def _check_capacity(self, rows: Sequence[tuple[Prefix, int]]) -> None:
        """Raises PoolExhaustedError, changing nothing, unless every (handle, end) of `rows`
        can hold its context up to `end`: a slot for each handle without one, and pages."""
        pages, ps = self._pages, self.page_size
        new_slots = need = 0
        for h, end in rows:
            slot = h.slot
            if slot is None:
                new_slots += 1
                need += -(-end // ps)
            else:
                need += -(-end // ps) - pages[slot]
        if self.max_slots is not None and len(self.slots) + new_slots > self.max_slots:
            raise PoolExhaustedError(
                f"no free slot: {new_slots} new tasks but {self.max_slots - len(self.slots)} "
                f"of max_slots={self.max_slots} free")
        if need > self.pages_free:
            raise PoolExhaustedError(f"KV page pool exhausted: prefill needs {need} pages, "
                                     f"{self.pages_free} free of {self.num_pages}")

    def _planned(self, h: Prefix) -> int:
        """Tokens the current action will have (its model length, capped)."""
        key = (h.task_id, h.action_start)
        n = self._planned_len.get(key)
        if n is None:
            n = self._planned_len[key] = min(self.actions.length(h.task_id, h.action_start),
                                             h.max_action_tokens)
        return n

    def _sample(self, h: Prefix, n: int) -> None:
        """Appends the next `n` tokens of the current action and sets its stop reason."""
        planned = self._planned(h)
        k0 = len(h.tokens) - h.action_start  # tokens of the action so far
        n = min(n, max(1, planned - k0), h.max_action_tokens - k0,
                self.max_context - len(h.tokens))
        n = max(1, n)
        k = k0 + n
        ends = k >= planned
        stop = bool(self.stop_tokens) and ends and k < h.max_action_tokens
        filler = self.actions.filler
        if filler is not None:
            toks = [filler] * n
        else:
            toks = [self.actions.token(h.task_id, len(h.tokens) + j, j == n - 1)
                    for j in range(n)]
        if stop:
            toks[-1] = self.stop_tokens[0]
        h.tokens.extend(toks)
        h.logprobs.extend([-2.2] * n)
        h.versions.extend([self.version] * n)
        if stop or toks[-1] in self.stop_tokens:
            h.stop_reason = StopReason.STOP_TOKEN
        elif k >= h.max_action_tokens or (ends and not self.stop_tokens):
            h.stop_reason = StopReason.MAX_ACTION_TOKENS
        elif len(h.tokens) >= self.max_context:
            h.stop_reason = StopReason.CONTEXT_LIMIT
        if h.stop_reason != StopReason.NONE:
            h.decoding = False
            self._planned_len.pop((h.task_id, h.action_start), None)

    def insert(self, prefix: Prefix, state: dict, slot: int | None = None) -> dict:
        if prefix.slot is None or prefix.kv_length != len(prefix.tokens) - 1:
            raise ValueError(f"task {prefix.task_id} is not prefilled (evicted or flushed); "
                             "call prefill(params, prefix, [], 0) first")
        prefix.decoding = not prefix.done
        return state

    def _left(self, h: Prefix) -> int:
        """Decode steps until the action ends (stop, action cap or context limit)."""
        produced = len(h.tokens) - h.action_start
        return max(1, min(self._planned(h) - produced, h.max_action_tokens - produced,
                          self.max_context - len(h.tokens)))

    def generate(self, params, state: dict) -> tuple[dict, ResultTokens]:
        active = [p for p in self.slots.values() if p.decoding]
        if not active:
            empty = np.zeros(0, np.int32)
            return state, ResultTokens(empty, empty, np.zeros(0, np.float32), empty, empty)
        # `_left` inlined (this runs once per simulated decode call, for every row).
        planned_len, cap_ctx = self._planned_len, self.max_context
        left = []
        for p in active:
            n = planned_len.get((p.task_id, p.action_start))
            if n is None:
                n = self._planned(p)
            produced = len(p.tokens) - p.action_start
            left.append(max(1, min(n - produced, p.max_action_tokens - produced,
                                   cap_ctx - len(p.tokens))))
        k = min(self.decode_steps_per_call, max(left))
        pages, ps = self._pages, self.page_size
        while True:  # the most steps whose new pages fit (every step writes one token per row)
            need = 0
            for p, n in zip(active, left, strict=True):
                more = -(-(len(p.tokens) - 1 + min(k, n)) // ps) - pages[p.slot]
                if more > 0:
                    need += more
            if need <= self.pages_free:
                break
            if k == 1:
                raise PoolExhaustedError(
                    f"KV page pool exhausted: this decode step needs {need} pages, "
                    f"{self.pages_free} free of {self.num_pages}")
            k = max(1, k // 2)
        # One pass over the rows: the decode cost's step counts (from the contexts before this
        # call), then each row's KV pages and sampled tokens.
        cnt = [0] * (k + 1)
        base = [0] * (k + 1)
        steps = 0
        slots, last, lengths, reasons = [], [], [], []
        sample, none = self._sample, StopReason.NONE
        for p, n in zip(active, left, strict=True):
            m = k if k < n else n
            n_tok = len(p.tokens)
            cnt[m] += 1
            base[m] += n_tok
            kv = n_tok - 1 + m
            more = -(-kv // ps) - pages[p.slot]  # `_resize` inlined
            if more > 0:
                self.pages_free -= more
                pages[p.slot] += more
            p.kv_length = kv
            if kv > p.computed_max:
                p.computed_max = kv
            sample(p, m)
            steps += m
            p.decoding = p.stop_reason == none
            slots.append(p.slot)
            last.append(p.tokens[-1])
            lengths.append(len(p.tokens))
            reasons.append(p.stop_reason)
        if self.costs is not None:
            if self._decode_cost is None:
                self._decode_cost = self.costs.decode_fn(self.gpus)
            decode = self._decode_cost
            # Step j decodes the rows with more than j steps left, each at its context + j.
            rows = ctx = 0
            cost = 0.0
            for j in range(k - 1, -1, -1):  # rows alive at step j: those with m > j
                rows += cnt[j + 1]
                ctx += base[j + 1]
                cost += decode(rows, ctx + j * rows)
            self._charge(cost)
        self.counters.decode_steps += k
        self.counters.decode_tokens += steps
        res = ResultTokens(np.array(slots, np.int32), np.array(last, np.int32),
                           np.full(len(active), -2.2, np.float32),
                           np.array(lengths, np.int32), np.array(reasons, np.int32))
        return state, res

    def evict(self, prefix: Prefix | int, *, offload: bool = True) -> Prefix:
        """The real engine's `evict`; there is no host KV tier here (`offload` is ignored)."""
        p = prefix if isinstance(prefix, Prefix) else self.slots[prefix]
        if p.slot is not None:
            self._drop_kv(p, "evicted")
            self._close(p)
        return p

    def free(self, prefix: Prefix | int) -> None:
        p = prefix if isinstance(prefix, Prefix) else self.slots[prefix]
        self._close(p)
        p.kv_length, p.decoding = 0, False

    def fork(self, prefix: Prefix | int, n: int, task_ids: list[int]) -> list[Prefix]:
        """n siblings holding the task's resident context (the real engine's `fork`); each is
        then prefilled with `true_length=0` to sample its own first token."""
        h = prefix if isinstance(prefix, Prefix) else self.slots[prefix]
        children = fork_children(h, n, task_ids, self.version)
        if self.max_slots is not None and len(self.slots) + n > self.max_slots:
            raise PoolExhaustedError(f"no free slot: fork of {n} siblings")
        if n * self._pages_for(h.kv_length) > self.pages_free:
            raise PoolExhaustedError(f"KV page pool exhausted: fork of {n} siblings")
        for child in children:
            self._open(child)
            self._resize(child, h.kv_length)
        return children

    def stats(self) -> dict[str, float]:
        return {"slots_in_use": len(self.slots), "pages_in_use": self.pages_in_use,
                "version": self.version, "kv_hit_rate": self.counters.kv_hit_rate,
                "busy_s": self.busy_s}
