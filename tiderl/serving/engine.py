"""JetStream-style rollout engine over a paged KV cache, extended for multi-turn agent tasks.

Contract for the caller (a RolloutRank: one worker thread does all device work; it drives many
tasks across turns). A task is a `Prefix` handle (pages.py) that the caller keeps for the task's
whole life; it holds the context as token ids (token in, token out) and where its KV lives.

    engine = Engine(graphdef, params, model_cfg, rollout_cfg, seed=run_seed)
    state = engine.init_decode_state()                        # pools allocated once, here
    p = engine.prefill(params, None, prompt, len(prompt), task_id=7)   # turn 1: new task
    state = engine.insert(p, state)                           # p.slot joins the decode batch
    state, res = engine.generate(params, state)               # one token for every decoding slot
    ...until p.done (p.stop_reason: STOP_TOKEN | MAX_ACTION_TOKENS | CONTEXT_LIMIT);
    p.action_tokens / p.logprobs are the action; the slot's KV stays resident (pause = keep).
    p = engine.prefill(params, p, obs, len(obs))              # turn 2: append the observation
    state = engine.insert(p, state)                           # and decode the next action

- `prefill(params, existing_prefix, tokens, true_length)` appends `tokens[:true_length]` to the
  task's context and computes KV only for what is not resident: the new tokens, the last
  sampled token of the previous action (never fed yet), and, after `evict` or a weight flush,
  everything (resume = re-prefill only what is missing). It then samples the first token of the
  action (key from (task_id, position)). Long inputs run in chunks of the largest prefill
  bucket; each chunk is padded to a length bucket. `true_length == 0` continues the current
  action (resume after eviction/flush, or a forked sibling's first token). If the context cannot
  fit `max_context` the prefix comes back with `stop_reason == CONTEXT_LIMIT` and nothing ran.
- `prefill_many(params, [PrefillRequest(...), ...])` does the same for many tasks in shared
  device calls (rows padded to a decode bucket); all-or-nothing on pages and slots.
- `insert(prefix, state, slot=None)` makes a prefilled task decode; a different `slot` moves its
  page table there (no KV copy).
- `generate(params, state)` decodes one token for every decoding slot (batch padded to a decode
  bucket) with one device→host copy, appends to each handle and reports stop reasons. Stopped
  slots leave the decode batch but keep their KV.
- `evict(prefix)` frees the task's pages and slot but keeps its tokens (pause = evict);
  `free(prefix)` ends a task. Both accept a slot number too. With `rollout.host_kv_pages` > 0
  `evict` first copies the task's pages to a host-memory tier (serving/hostkv.py) and its next
  prefill copies them back instead of computing them (`counters.prompt_tokens_restored`);
  a prefix a sibling holds resident is still taken from the sibling when it is as long.
- Prefix sharing: a `PrefillRequest` with `share=[handles of its GRPO siblings]` lets a task
  with no resident KV take the pages of the longest common prefix a sibling holds resident
  (copy-on-write: the first write into a shared page copies it) and compute only the rest;
  siblings with identical contexts in one call compute it once, and a sibling whose whole
  context (a group's prompt) is resident samples its first token, with its own key, from the
  logits kept from that prompt's prefill, computing nothing. `counters.prompt_tokens_shared`
  counts the tokens taken from siblings.
- `fork(prefix, n, task_ids)` makes n GRPO siblings sharing the resident pages copy-on-write
  (the parent's unfed last token is not inherited); prefill each with `true_length=0` to sample
  its own first token, then insert it.
- `update_weights(params, version=None)` swaps weights of identical tree structure, shapes,
  dtypes and shardings (so never recompiles) and by default flushes every slot's KV: a flushed
  task must be prefilled again (`true_length=0` to continue its action) and re-inserted. With
  `flush=False`, a stale slot is flushed by its next `prefill` and `generate` refuses it
  (StaleKVError): KV of an older version is never attended.
- Errors: PoolExhaustedError (pages or slots; names the setting; nothing changed, other slots
  intact), StaleKVError. `params` passed to prefill/generate must be the engine's current
  weights (or None); weights only change through `update_weights`.
- `counters` (EngineCounters) and `stats()`: prompt tokens queried/served from resident KV,
  tokens computed by reason (new / evicted / version), pages in use and shared. Per task,
  `Prefix.versions` holds the weight version of each sampled token and
  `prefill_computed` / `prefill_cached` the last prefill's accounting.
- Vision-language policies (`model.vision`): a request's `images` (`PatchedImage`s: patch rows
  and grid) are the images of its new tokens' placeholder runs, in order; the handle keeps them
  (`Prefix.images`, host memory) for its whole life. Prefill runs the vision tower once per call
  over every image some row computes (batched across tasks, padded to a patch bucket;
  serving/imagefeed.py), image tokens enter the paged KV like text, and a chunk holding image
  tokens runs at its [B, T, 3] M-RoPE positions; text, decode included, runs at token index +
  `Prefix.rope_delta` (serving/mrope.py). After an eviction, a flush or a migration the images
  are encoded again; forks inherit them; prefix sharing stops at the first image two contexts
  do not share (equal placeholder ids, different pixels).
- Compilation: decode traces once per (decode bucket, page-table width), prefill once per
  (batch bucket, length bucket, width) and, for chunks holding image tokens, once more
  ("prefill+image"); the vision tower once per patch bucket; a call's page table is cut to
  its longest context's pages rounded up to a power of two (so at most
  log2(max_pages_per_slot) + 1 widths; the Pallas decode kernel keeps the full width);
  engines of one model and config in a process share compiled kernels.
- Not thread-safe: drive an engine from one thread (the rank's device worker).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from flax import nnx

from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES
from tiderl.serving.config import RolloutConfig
from tiderl.serving.hostkv import HostKV, HostKVStore
from tiderl.serving.imagefeed import make_encoder, make_mm_inputs
from tiderl.serving.kv import KVPools, init_pools, pool_pages, resolve_decode_attention
from tiderl.serving.mrope import ImageSpan
from tiderl.serving.pages import (
    EngineCounters,
    PageAllocator,
    PoolExhaustedError,
    PrefillRequest,
    Prefix,
    ResultTokens,
    StaleKVError,
    StopReason,
    fork_children,
)
from tiderl.serving.prefill import Prefilling
from tiderl.serving.share import SiblingSharing
from tiderl.serving.share import bucket as _bucket
from tiderl.serving.steps import (
    cell_of,
    copy_pages_fn,
    make_sampler,
    make_step,
    page_io_fns,
    pool_sharding_for,
    replicated,
    tier_shardings,
)

log = logging.getLogger(__name__)

__all__ = ["DecodeState", "Engine", "Prefix", "PrefillRequest", "ResultTokens", "StopReason",
           "PoolExhaustedError", "StaleKVError"]


@dataclasses.dataclass
class DecodeState:
    """The engine's device pools and which task occupies each slot (one per engine)."""

    pools: KVPools
    slots: list[Prefix | None]


def _spec(params) -> tuple[Any, list[tuple]]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return treedef, [(jax.tree_util.keystr(p), x.shape, x.dtype, getattr(x, "sharding", None))
                     for p, x in leaves]


class Engine(Prefilling):
    """Paged-KV rollout engine for one rank (see the module docstring for the contract)."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, model_cfg: ModelConfig,
                 cfg: RolloutConfig, *, seed: int = 0, version: int = 0,
                 keep_logits: bool = False):
        self.model_cfg, self.cfg = model_cfg, cfg
        self.params, self.version = params, version
        self._param_spec = _spec(params)
        # One device, or a tensor-parallel cell: params sharded over a mesh whose 'model' axis
        # spans the rank's devices; the kernels then run SPMD over the cell (XLA inserts the
        # head/vocab collectives), pools sharded on kv heads.
        self.device, self.mesh = cell_of(params)
        self.pool_sharding = (None if self.mesh is None
                              else pool_sharding_for(self.mesh, model_cfg.n_kv_heads))
        placement = self.device if self.mesh is None else replicated(self.pool_sharding)
        first = self.device if self.mesh is None else self.mesh.devices.flat[0]
        on_gpu = first.platform == "gpu"
        self.attention = resolve_decode_attention(
            cfg.attention, platform=first.platform, head_dim=model_cfg.head_dim,
            page_size=cfg.page_size)
        self.interpret = cfg.pallas_interpret or not on_gpu
        # The pool's size is decided once, here (rollout.kv_memory_fraction: from the free
        # device memory); self.cfg.num_pages is what this engine holds.
        self.cfg = cfg = dataclasses.replace(cfg, num_pages=pool_pages(
            cfg, n_layers=model_cfg.n_layers, n_kv_heads=model_cfg.n_kv_heads,
            head_dim=model_cfg.head_dim, dtype=DTYPES[model_cfg.compute_dtype],
            device=first))  # a tensor-parallel cell: sized by one device's free memory
        self.filtered = cfg.top_k > 0 or cfg.top_p < 1.0
        if self.filtered:
            log.warning("top-k/top-p sampling is on: returned logprobs are full-vocabulary "
                        "log_softmax(logits/T) and results are flagged `filtered`")
        self.run_key = jax.device_put(jax.random.key(seed), placement)
        self.keep_logits = keep_logits
        self.logits_log: list[tuple[int, int, np.ndarray]] = []
        """(task_id, position, logits_v) of every sampled token when keep_logits (tests)."""
        # A vision-language policy never samples its image placeholders (an action holding one
        # would read as an image that is not there).
        v = model_cfg.vision
        banned = () if v is None else tuple(sorted({v.image_token_id, v.vision_start_token_id}))
        common = dict(impl=self.attention, interpret=self.interpret, top_k=cfg.top_k,
                      top_p=cfg.top_p, keep_logits=keep_logits, pool_sharding=self.pool_sharding,
                      banned=banned)
        self._prefill_fn = make_step(graphdef, kind="prefill", **common)
        self._decode_fn = make_step(graphdef, kind="decode", **common)
        self._sample_fn = make_sampler(top_k=cfg.top_k, top_p=cfg.top_p, banned=banned)
        # A vision-language policy: the tower runs in prefill over the images being computed.
        self.vision = model_cfg.vision
        self._encode_fn = None if self.vision is None else make_encoder(graphdef)
        self._mm_fn = None if self.vision is None else make_mm_inputs(graphdef)
        self._incoming: dict[int, list[ImageSpan]] = {}
        """id(handle) -> the spans of the images a prefill call appends (until committed)."""
        self.sharing = SiblingSharing(self)
        """Prefix sharing of GRPO siblings (it keeps recent group prompts' logits)."""
        self._copy_fn = copy_pages_fn(self.pool_sharding)
        self._tier_device, self._tier_host = tier_shardings(self.device, self.pool_sharding)
        self._read_fn, self._write_fn = page_io_fns(self.pool_sharding, self._tier_host)
        self.host_kv = HostKVStore(cfg.host_kv_pages) if cfg.host_kv_pages else None
        """The host KV tier (`rollout.host_kv_pages`), or None."""
        self.counters = EngineCounters()
        self.pages: PageAllocator | None = None
        self.state: DecodeState | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        """Allocates the page pools (once per engine) and an empty slot table."""
        c, m = self.cfg, self.model_cfg
        self.pages = PageAllocator(num_pages=c.num_pages, page_size=c.page_size,
                                   max_slots=c.max_slots, max_pages_per_slot=c.max_pages_per_slot)
        pools = init_pools(n_layers=m.n_layers, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                           num_pages=c.num_pages, page_size=c.page_size,
                           dtype=DTYPES[m.compute_dtype], device=self.device,
                           sharding=self.pool_sharding)
        self.state = DecodeState(pools=pools, slots=[None] * c.max_slots)
        self.sharing.forget()
        if self.host_kv is not None:
            self.host_kv.clear()
        return self.state

    def update_weights(self, params: nnx.State, *, version: int | None = None,
                       flush: bool = True) -> None:
        """New weights of identical structure/shapes/dtypes/shardings; bumps the version."""
        treedef, leaves = _spec(params)
        old_treedef, old_leaves = self._param_spec
        if treedef != old_treedef:
            raise ValueError("update_weights: params tree structure differs from the engine's; "
                             "export weights from the same policy class and config")
        for new, old in zip(leaves, old_leaves, strict=True):
            if new != old:
                raise ValueError(
                    f"update_weights: param {new[0]} is shape={new[1]} dtype={new[2]} "
                    f"sharding={new[3]} but the engine compiled for shape={old[1]} "
                    f"dtype={old[2]} sharding={old[3]}; reshard/cast before syncing (a "
                    "mismatch would recompile every kernel)")
        self.params = params
        self.version = self.version + 1 if version is None else version
        self.sharing.forget()
        if self.host_kv is not None:
            self.host_kv.clear()  # KV of the older weights is never restored
        if flush:
            self.flush()

    def flush(self) -> int:
        """Drops every slot's KV older than the current version; returns tokens dropped."""
        dropped = 0
        for h in self._state().slots:
            if h is not None and h.kv_length and h.kv_version != self.version:
                dropped += h.kv_length
                self._drop_kv(h, "version")
        return dropped

    # -- what prefix sharing uses (`share.SharingHost`) ----------------------------------------
    def ensure_slot(self, h: Prefix) -> None:
        """Gives `h` a slot if it has none and records it as that slot's task."""
        if h.slot is None:
            h.slot = self.pages.open()
        self._state().slots[h.slot] = h

    def sample_rows(self, logits_nv, task_ids_n: np.ndarray, positions_n: np.ndarray,
                    temperature_n: np.ndarray) -> np.ndarray:
        """Samples one token per logits row, keyed by (task id, position): packed
        (token, logprob bits) per row, on the device."""
        return self._sample_fn(logits_nv, self.run_key, task_ids_n, positions_n, temperature_n)

    def commit_prefill(self, h: Prefix, new: list[int], start: int, end: int, temp: float,
                       cap: int, packed_2, logits_v) -> None:
        """A prefill of `h` succeeded: `[start, end)` computed (on `start` resident tokens),
        `new` appended and the sampled token (`packed_2`, with `logits_v` when kept) taken."""
        self._count_compute(h, start, end)
        self._append(h, new, end, temp, cap)
        self._take_sample(h, packed_2, logits_v)

    def _append(self, h: Prefix, new: list[int], end: int, temp: float, cap: int) -> None:
        """A prefilled handle's new state (after its device work succeeded)."""
        h.temperature, h.max_action_tokens = temp, cap
        h.tokens.extend(new)
        h.images.extend(self._incoming.pop(id(h), ()))
        if new:
            h.action_start, h.logprobs, h.versions = end, [], []
            h.stop_reason = StopReason.NONE
        h.kv_length, h.kv_version, h.drop_reason = end, self.version, "new"
        h.computed_max = max(h.computed_max, end)
        h.decoding = False
        self.counters.prefill_calls += 1

    # -- the JetStream contract (prefill, prefill_many: `prefill.Prefilling`) -----------------
    def insert(self, prefix: Prefix, decode_state: DecodeState,
               slot: int | None = None) -> DecodeState:
        """Puts a prefilled task into the decode batch (moving its page table to `slot`)."""
        st = self._state(decode_state)
        if prefix.slot is None or prefix.kv_length != len(prefix.tokens) - 1:
            raise ValueError(f"task {prefix.task_id} is not prefilled (evicted or flushed); "
                             "call prefill(params, prefix, [], 0) first")
        if prefix.kv_version != self.version:
            raise StaleKVError(f"task {prefix.task_id}: KV is of version {prefix.kv_version}, the "
                               f"engine is at {self.version}; prefill it again")
        if slot is not None and slot != prefix.slot:
            self.pages.move(prefix.slot, slot)
            st.slots[prefix.slot], st.slots[slot] = None, prefix
            prefix.slot = slot
        prefix.decoding = not prefix.done
        return st

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One token for every decoding slot; one device→host copy."""
        self._check_params(params)
        st = self._state(decode_state)
        active = [h for h in st.slots if h is not None and h.decoding]
        if not active:
            empty = np.zeros(0, np.int32)
            return st, ResultTokens(empty, empty, np.zeros(0, np.float32), empty, empty,
                                    self.filtered)
        for h in active:
            if h.kv_version != self.version:
                raise StaleKVError(
                    f"slot {h.slot} (task {h.task_id}) holds KV of weight version {h.kv_version} "
                    f"but the engine is at {self.version}; call engine.flush() and prefill it "
                    "again")
        pos = [len(h.tokens) - 1 for h in active]
        need = sum(self.pages.pages_needed(h.slot, p, p + 1)
                   for h, p in zip(active, pos, strict=True))
        if need > self.pages.pages_free:
            raise PoolExhaustedError(
                f"KV page pool exhausted: this decode step needs {need} pages, "
                f"{self.pages.pages_free} free of rollout.num_pages={self.cfg.num_pages}; "
                "raise rollout.num_pages or pause/evict tasks")
        copies = [c for h, p in zip(active, pos, strict=True)
                  for c in self.pages.reserve(h.slot, p, p + 1)]
        self._apply_copies(copies)
        b = _bucket(len(active), self.cfg.decode_buckets)
        tokens_bt = np.zeros((b, 1), np.int32)
        tokens_bt[: len(active), 0] = [h.tokens[-1] for h in active]
        packed, logits = self._run(self._decode_fn, active, tokens_bt, pos, [1] * len(active), b,
                                   delta=[h.rope_delta for h in active])
        logits = None if logits is None else np.asarray(logits)
        self.counters.decode_steps += 1
        self.counters.decode_tokens += len(active)
        for i, h in enumerate(active):
            h.kv_length = pos[i] + 1
            h.computed_max = max(h.computed_max, h.kv_length)
            self._take_sample(h, packed[i], None if logits is None else logits[i])
        res = ResultTokens(
            slots=np.array([h.slot for h in active], np.int32),
            tokens=packed[: len(active), 0].copy(),
            logprobs=packed[: len(active), 1].view(np.float32).copy(),
            lengths=np.array([len(h.tokens) for h in active], np.int32),
            stop_reasons=np.array([int(h.stop_reason) for h in active], np.int32),
            filtered=self.filtered)
        return st, res

    def evict(self, prefix: Prefix | int, *, offload: bool = True) -> Prefix:
        """Frees the task's pages and slot; its tokens stay (a later prefill recomputes them,
        or, with the host KV tier and `offload`, copies them back). `offload=False`: the task
        leaves this engine (a migration), so the tier keeps nothing of it."""
        h = self._resolve(prefix)
        if self.host_kv is not None:
            if offload and h.slot is not None:
                self._offload(h)
            elif not offload:
                self.host_kv.drop(h)
        if h.slot is not None:
            self._drop_kv(h, "evicted")
            self._close(h)
        return h

    def free(self, prefix: Prefix | int) -> None:
        """Ends a task: releases its pages and slot."""
        h = self._resolve(prefix)
        if h.slot is not None:
            self._close(h)
        if self.host_kv is not None:
            self.host_kv.drop(h)
        h.kv_length, h.decoding = 0, False

    def fork(self, prefix: Prefix | int, n: int, task_ids: list[int]) -> list[Prefix]:
        """n siblings sharing the task's resident KV pages copy-on-write (GRPO groups)."""
        h = self._resolve(prefix)
        children = fork_children(h, n, task_ids, self.version)
        st = self._state()
        for slot, child in zip(self.pages.fork(h.slot, n), children, strict=True):
            child.slot = slot
            st.slots[slot] = child
        return children

    # -- views ---------------------------------------------------------------------------------
    @property
    def trace_counts(self) -> collections.Counter:
        """Traces per (kind, B, T, page-table width) of this engine's kernels (shared by
        same-config engines)."""
        out = self._prefill_fn.trace_counts + self._decode_fn.trace_counts
        return out if self._encode_fn is None else out + self._encode_fn.trace_counts

    def stats(self) -> dict[str, float]:
        """Counters plus gauges (pages in use / shared, KV hit rate with and without the host
        tier's restores, host tier pages in use)."""
        out = dataclasses.asdict(self.counters)
        out.update(kv_hit_rate=self.counters.kv_hit_rate,
                   kv_device_hit_rate=self.counters.kv_device_hit_rate,
                   host_kv_pages_used=self.host_kv.pages_used if self.host_kv else 0,
                   pages_in_use=self.pages.pages_in_use if self.pages else 0,
                   pages_shared=self.pages.pages_shared if self.pages else 0,
                   version=self.version)
        return out

    # -- internals -----------------------------------------------------------------------------
    def _run(self, fn, rows: list[Prefix], tokens_bt, start, n_new, b, temps=None, delta=None,
             image=None):
        """One device call over `rows`; `delta`: each row's M-RoPE delta (text), `image`:
        a chunk's (positions [B, T, 3], input embeddings) when it holds image tokens."""
        st = self._state()
        pad = b - len(rows)
        start_b = np.array(list(start) + [0] * pad, np.int32)
        n_new_b = np.array(list(n_new) + [0] * pad, np.int32)
        delta_b = np.zeros(b, np.int32)
        if delta is not None:
            delta_b[: len(rows)] = delta
        table_bp = self.pages.table_array([h.slot for h in rows], b)
        if self.attention != "pallas" or tokens_bt.shape[1] > 1:
            table_bp = table_bp[:, :self._table_width(int(np.max(start_b + n_new_b)))]
        task_b = np.array([h.task_id for h in rows] + [0] * pad, np.int32)
        temps = [h.temperature for h in rows] if temps is None else temps
        temp_b = np.array(list(temps) + [0.0] * pad, np.float32)
        extra = () if image is None else image
        st.pools, packed, logits = fn(self.params, st.pools, self.run_key, tokens_bt, start_b,
                                      n_new_b, table_bp, task_b, temp_b, delta_b, *extra)
        return np.asarray(packed), logits

    def _table_width(self, n_keys: int) -> int:
        """Page-table columns a call attends over: the pages of its longest row's context
        (`n_keys` tokens), rounded up to a power of two, at most `max_pages_per_slot`. The
        gather-based attention reads every column, so a full-width table made a short context
        cost as much as `max_context` tokens (SmolLM2-135M, batch 8, 50 tokens resident: 386
        ms a step at max_context 1024 vs 211 ms at 48); the Pallas decode kernel stops at each
        row's length and keeps the full table. One trace per width bucket used."""
        pages = max(1, -(-n_keys // self.cfg.page_size))
        return min(1 << (pages - 1).bit_length(), self.cfg.max_pages_per_slot)

    def _take_sample(self, h: Prefix, packed_2, logits_v) -> None:
        token = int(packed_2[0])
        h.tokens.append(token)
        h.logprobs.append(float(np.asarray(packed_2[1], np.int32).view(np.float32)))
        h.versions.append(self.version)
        if logits_v is not None:
            self.logits_log.append((h.task_id, len(h.tokens) - 1, logits_v))
        if token in self.cfg.stop_tokens:
            h.stop_reason = StopReason.STOP_TOKEN
        elif len(h.tokens) - h.action_start >= h.max_action_tokens:
            h.stop_reason = StopReason.MAX_ACTION_TOKENS
        elif len(h.tokens) >= self.cfg.max_context:
            h.stop_reason = StopReason.CONTEXT_LIMIT
        if h.done:
            h.decoding = False

    def _count_compute(self, h: Prefix, start: int, end: int) -> None:
        self.counters.count_prefill(h, start, end)

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        st = self._state()
        # Fixed length (max_slots, padded trash → trash) so the copy kernel traces once.
        n = max(self.cfg.max_slots, len(copies))
        src = np.full(n, self.pages.trash, np.int32)
        dst = np.full(n, self.pages.trash, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        st.pools = self._copy_fn(st.pools, src, dst)
        self.counters.page_copies += len(copies)

    def _page_bucket(self, n_pages: int) -> int:
        """Pages one host-tier copy moves: `n_pages` rounded up as a page table's width is
        (a power of two, at most a full context's; one trace per bucket)."""
        return self._table_width(n_pages * self.cfg.page_size)

    def _offload(self, h: Prefix) -> None:
        """Copies `h`'s resident KV of the current weights to the host tier (before it is
        evicted)."""
        if not h.kv_length or h.kv_version != self.version:
            self.host_kv.drop(h)
            return
        n_pages = -(-h.kv_length // self.cfg.page_size)
        idx = np.full(self._page_bucket(n_pages), self.pages.trash, np.int32)
        idx[:n_pages] = self.pages.tables[h.slot][:n_pages]
        # Queued, not waited for: the pages go to pinned host memory in the bucket's shape
        # (its padding is trash pages' KV, written back to trash on restore).
        kv = self._read_fn(self._state().pools, idx)
        if self._tier_host is None:
            kv = np.asarray(kv)
        entry = HostKV(tuple(h.tokens[: h.kv_length]), self.version, kv, n_pages)
        if self.host_kv.put(h, entry):
            self.counters.host_offloads += 1

    def restore_kv(self, h: Prefix, entry: HostKV) -> None:
        """Writes a host-tier entry into the first pages of `h`'s (just reserved) table."""
        st = self._state()
        idx = np.full(entry.held_pages, self.pages.trash, np.int32)
        idx[: entry.n_pages] = self.pages.tables[h.slot][: entry.n_pages]
        st.pools = self._write_fn(st.pools, jax.device_put(entry.kv, self._tier_device), idx)

    def _drop_kv(self, h: Prefix, reason: str) -> None:
        self.pages.release_pages(h.slot)
        h.kv_length, h.decoding, h.drop_reason = 0, False, reason

    def _close(self, h: Prefix) -> None:
        self.pages.close(h.slot)
        self._state().slots[h.slot] = None
        h.slot, h.decoding = None, False

    def _resolve(self, prefix: Prefix | int) -> Prefix:
        if isinstance(prefix, Prefix):
            return prefix
        h = self._state().slots[prefix]
        if h is None:
            raise ValueError(f"slot {prefix} holds no task")
        return h

    def _check_params(self, params) -> None:
        if params is not None and params is not self.params:
            raise ValueError("params passed to prefill/generate are not the engine's current "
                             "weights; call engine.update_weights(params) first so every slot's "
                             "KV version is tracked")

    def _state(self, decode_state: DecodeState | None = None) -> DecodeState:
        if self.state is None:
            raise RuntimeError("call engine.init_decode_state() first")
        if decode_state is not None and decode_state is not self.state:
            raise ValueError("decode_state is not this engine's current state")
        return self.state
