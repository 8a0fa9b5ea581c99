"""Prefill of many tasks in shared device calls, for the engine (`Engine.prefill_many`).

A call validates every request before touching any state, plans which handles compute and
which sample their first token from a sibling's logits (prefix sharing, `share.py`), checks
that pages and slots fit (all-or-nothing), then runs the chunked device calls — long inputs
advance one chunk of the largest prefill bucket per call, rows padded to a decode bucket — with
the vision tower over the images those calls compute, and commits each handle only once its
device work succeeded. A mixin so `engine.py` stays about the engine's contract and state; it
reads the engine's state (`cfg`, `pages`, `version`, `sharing`, `counters`, `vision`, ...) and
calls its methods (`_check_params`, `_state`, `_run`, `_apply_copies`, `_close`, `_drop_kv`,
`ensure_slot`, `restore_kv`, `commit_prefill`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiderl.serving.imagefeed import ImageFeatures, needed_spans, text_delta
from tiderl.serving.mrope import ImageSpan, context_key, spans_in
from tiderl.serving.pages import PoolExhaustedError, PrefillRequest, Prefix, StopReason
from tiderl.serving.share import bucket as _bucket


class Prefilling:
    """`prefill` and `prefill_many` of the engine (see the module docstring)."""

    cfg: Any
    pages: Any
    version: int
    params: Any
    sharing: Any
    host_kv: Any
    counters: Any
    vision: Any
    keep_logits: bool
    _incoming: dict[int, list[ImageSpan]]
    _prefill_fn: Any
    _encode_fn: Any
    _mm_fn: Any

    def prefill(self, params, existing_prefix: Prefix | None, tokens, true_length: int, *,
                task_id: int | None = None, temperature: float | None = None,
                max_action_tokens: int | None = None, images=None) -> Prefix:
        """Appends tokens[:true_length] to the task's context (with `images`, the images of
        its placeholder runs), computes missing KV, samples."""
        req = PrefillRequest(existing_prefix, tokens, true_length, task_id=task_id,
                             temperature=temperature, max_action_tokens=max_action_tokens,
                             images=images)
        return self.prefill_many(params, [req])[0]

    def prefill_many(self, params, requests: list[PrefillRequest]) -> list[Prefix]:
        """`prefill` for several tasks in shared device calls (rows padded to a decode bucket).

        All-or-nothing on capacity: if the pages or slots for every request do not fit,
        PoolExhaustedError is raised before anything is allocated.
        """
        self._check_params(params)
        self._state()
        handles, news, spans = self._take_requests(requests)
        self._incoming = {id(h): sp for h, sp in zip(handles, spans, strict=True) if sp}
        try:
            return self._prefill_handles(requests, handles, news)
        finally:
            self._incoming = {}

    def _prefill_handles(self, requests, handles, news) -> list[Prefix]:
        """`prefill_many` once its requests are validated (`_incoming` holds their images)."""
        temps = [h.temperature if r.temperature is None else r.temperature
                 for r, h in zip(requests, handles, strict=True)]
        caps = [h.max_action_tokens if r.max_action_tokens is None else r.max_action_tokens
                for r, h in zip(requests, handles, strict=True)]
        rows, follow, attached, prompts, restores = self._plan_rows(requests, handles, news,
                                                                    temps, caps)
        try:
            self._check_capacity(rows, extra_slots=len(follow))
        except PoolExhaustedError:
            for h in attached:
                self._close(h)
            raise
        # Pages and slots are taken here, but a handle's contents (tokens, action, logprobs)
        # change only after the device calls succeed: if one raises, every handle is as it was
        # and its task can migrate to another rank with exactly its unfed tokens.
        copies = []
        for h, _, start, end, *_ in rows:
            self.ensure_slot(h)
            copies += self.pages.reserve(h.slot, start, end)
        self._apply_copies(copies)
        for h, entry in restores.values():
            self.restore_kv(h, entry)
        results = self._compute_rows(rows)
        for h, new, start, end, temp, cap in rows:
            packed_2, logits_bv, i, host_v = results[id(h)]
            self.counters.prompt_tokens_shared += start if h in attached else 0
            if id(h) in restores:
                self.host_kv.drop(h)
                self.counters.prompt_tokens_restored += start
                self.counters.host_restores += 1
            if id(h) in prompts:
                self.sharing.remember_logits(prompts[id(h)], logits_bv[i])
            self.commit_prefill(h, new, start, end, temp, cap, packed_2, host_v)
        if follow:
            self.sharing.sample_followers(follow, results)
        return handles

    def _take_requests(self, requests: list[PrefillRequest]
                       ) -> tuple[list[Prefix], list[list[int]], list[list[ImageSpan]]]:
        """Each request's handle (a new one for a new task), new tokens and the spans of its
        images; validates every request before touching any state."""
        handles, news, spans = [], [], []
        for r in requests:
            new = [int(t) for t in np.asarray(r.tokens).reshape(-1)[: r.true_length]]
            if len(new) != r.true_length:
                raise ValueError(f"true_length={r.true_length} exceeds len(tokens)={len(new)}")
            h = r.existing_prefix
            if h is None:
                if r.task_id is None:
                    raise ValueError("prefill of a new task needs task_id= (it keys sampling)")
                h = Prefix(task_id=r.task_id, temperature=self.cfg.temperature,
                           max_action_tokens=self.cfg.max_action_tokens)
            if not new and h.done:
                raise ValueError(f"task {h.task_id}: its action already ended "
                                 f"({h.stop_reason.name}); append the next observation")
            if not new and not h.tokens:
                raise ValueError(f"task {h.task_id}: nothing to prefill (empty context)")
            if any(h is x for x in handles):
                raise ValueError(f"task {h.task_id} appears twice in one prefill_many")
            handles.append(h)
            news.append(new)
            v = self.vision
            spans.append([] if v is None and not r.images else spans_in(
                new, len(h.tokens), r.images, None if v is None else v.image_token_id,
                1 if v is None else v.spatial_merge_size))
        return handles, news, spans

    def _spans(self, h: Prefix) -> list[ImageSpan]:
        """The images of `h`'s context once this call's new tokens are in."""
        return h.images + self._incoming.get(id(h), [])

    def _plan_rows(self, requests, handles, news, temps, caps):
        """Which handles compute (`rows`: handle, new tokens, start, end, temperature, action
        cap) and which sample from a sibling's logits (`follow`: handle, new, end,
        temperature, cap, source handle, kept logits or None); the handles that took a
        sibling's pages (`attached`, undone on no room), the first prefills whose logits
        are kept for later siblings (`prompts`: id(handle) -> context) and the handles whose
        KV the host tier restores (`restores`: id(handle) -> (handle, entry); a sibling's
        resident prefix is preferred when it is as long)."""
        rows: list[tuple] = []
        follow: list[tuple] = []
        attached: list[Prefix] = []
        leaders: dict[tuple[int, ...], Prefix] = {}  # context -> the row computing it
        prompts: dict[int, tuple[int, ...]] = {}
        restores: dict[int, tuple] = {}
        ps = self.cfg.page_size
        for r, h, new, temp, cap in zip(requests, handles, news, temps, caps, strict=True):
            end = len(h.tokens) + len(new)
            if end + 1 > self.cfg.max_context:
                h.stop_reason, h.decoding = StopReason.CONTEXT_LIMIT, False
                continue
            if h.slot is not None and h.kv_length and h.kv_version != self.version:
                self._drop_kv(h, "version")  # stale KV is never attended
            # Nothing missing (a forked sibling): recompute the last token to get its logits.
            start = min(h.kv_length, end - 1)
            entry = None
            if self.host_kv is not None and h.slot is None:
                entry = self.host_kv.lookup(h, self.version, h.tokens + new)
            if r.share is not None and not h.kv_length:
                toks, spans = tuple(h.tokens) + tuple(new), self._spans(h)
                ctx = context_key(toks, spans) if spans else toks
                lead = leaders.get(ctx)
                if lead is not None:  # a sibling in this call computes the same context
                    follow.append((h, new, end, temp, cap, lead, None))
                    continue
                src, n = self.sharing.best_source(h, toks, r.share, spans)
                logits = self.sharing.cached_logits(ctx) if src is not None and n == end \
                    else None
                if logits is not None:  # all resident at a sibling, logits kept: no compute
                    follow.append((h, new, end, temp, cap, src, logits))
                    continue
                if src is not None and n >= ps and (entry is None or n >= entry.n_tokens):
                    self.sharing.attach(h, src, n)
                    attached.append(h)
                    start = min(n, end - 1)
                    entry = None
                leaders[ctx] = h
                if not h.tokens:
                    prompts[id(h)] = ctx
            if entry is not None:
                restores[id(h)] = (h, entry)
                start = min(entry.n_tokens, end - 1)
            rows.append((h, new, start, end, temp, cap))
        return rows, follow, attached, prompts, restores

    def _compute_rows(self, rows: list[tuple]) -> dict[int, tuple]:
        """The device calls of a prefill: long inputs advance one chunk per call, so rows
        finish in different calls. id(handle) -> (packed sample, device logits, row, host
        logits when keep_logits)."""
        full = {id(h): h.tokens + new for h, new, *_ in rows}
        temp_of = {id(h): temp for h, _, _, _, temp, _ in rows}
        pos = {id(h): start for h, _, start, *_ in rows}
        spans = {id(h): self._spans(h) for h, *_ in rows}
        feats = self._image_features(rows, spans)
        results: dict[int, tuple] = {}
        chunk = self.cfg.prefill_buckets[-1]
        while pending := [(h, end) for h, _, _, end, *_ in rows if pos[id(h)] < end]:
            n = [min(chunk, end - pos[id(h)]) for h, end in pending]
            t = _bucket(max(n), self.cfg.prefill_buckets)
            b = _bucket(len(pending), self.cfg.decode_buckets)
            tokens_bt = np.zeros((b, t), np.int32)
            for i, (h, _) in enumerate(pending):
                tokens_bt[i, : n[i]] = full[id(h)][pos[id(h)]: pos[id(h)] + n[i]]
            image = None if feats is None else feats.chunk(
                tokens_bt, [(spans[id(h)], pos[id(h)], n[i]) for i, (h, _) in enumerate(pending)])
            packed, logits_bv = self._run(self._prefill_fn, [h for h, _ in pending], tokens_bt,
                                          [pos[id(h)] for h, _ in pending], n, b,
                                          temps=[temp_of[id(h)] for h, _ in pending],
                                          delta=[text_delta(spans[id(h)], pos[id(h)])
                                                 for h, _ in pending], image=image)
            host = np.asarray(logits_bv) if self.keep_logits else None
            for i, (h, end) in enumerate(pending):
                pos[id(h)] += n[i]
                if pos[id(h)] == end:
                    results[id(h)] = (packed[i], logits_bv, i, None if host is None else host[i])
        return results

    def _image_features(self, rows: list[tuple], spans: dict[int, list[ImageSpan]]
                        ) -> ImageFeatures | None:
        """The vision tower over the images whose placeholders `rows` compute (None: none)."""
        if self._encode_fn is None:
            return None
        need = needed_spans([(spans[id(h)], start, end) for h, _, start, end, *_ in rows])
        if not need:
            return None
        feats = ImageFeatures(self._encode_fn, self._mm_fn, self.params, self.vision, need)
        self.counters.images_encoded += feats.images
        return feats

    def _check_capacity(self, rows, *, extra_slots: int = 0) -> None:
        slots = sum(h.slot is None for h, *_ in rows) + extra_slots
        free_slots = int(np.count_nonzero(~self.pages.in_use))
        if slots > free_slots:
            raise PoolExhaustedError(
                f"no free slot: {slots} new tasks but {free_slots} of rollout.max_slots="
                f"{self.cfg.max_slots} free; raise rollout.max_slots or evict/free tasks")
        ps = self.cfg.page_size
        need = sum(-(-end // ps) if h.slot is None else self.pages.pages_needed(h.slot, start, end)
                   for h, _, start, end, *_ in rows)
        if need > self.pages.pages_free:
            raise PoolExhaustedError(
                f"KV page pool exhausted: prefill needs {need} pages, {self.pages.pages_free} "
                f"free of rollout.num_pages={self.cfg.num_pages} (page_size={ps}); raise "
                "rollout.num_pages, lower rollout.max_slots, or evict/pause tasks")
