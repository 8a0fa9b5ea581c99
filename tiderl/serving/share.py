"""Prefix sharing of GRPO siblings inside one engine (its `prefill_many` uses it).

A task with no resident KV takes the pages of the longest common prefix a sibling holds
resident, copy-on-write (the first write into a shared page copies it), and computes only the
rest; a sibling whose whole context is a group's prompt resident at a sibling samples its
first token, with its own key, from the logits kept from that prompt's prefill.

The engine owns a `SiblingSharing`; it sees the engine only through `SharingHost`.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np

from tiderl.serving.pages import Prefix, best_source


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


@runtime_checkable
class SharingHost(Protocol):
    """What sibling sharing reads from and does to its engine (`Engine`)."""

    cfg: Any
    """The engine's RolloutConfig (`page_size`, `max_slots`, `decode_buckets`)."""
    pages: Any
    """The engine's PageAllocator (`open`, `release_pages`, `share`)."""
    version: int
    counters: Any
    """The engine's EngineCounters (`prompt_tokens_shared`, `shared_samples`)."""
    keep_logits: bool

    def ensure_slot(self, h: Prefix) -> None: ...

    def sample_rows(self, logits_nv, task_ids_n: np.ndarray, positions_n: np.ndarray,
                    temperature_n: np.ndarray) -> np.ndarray: ...

    def commit_prefill(self, h: Prefix, new: list[int], start: int, end: int, temp: float,
                       cap: int, packed_2, logits_v) -> None: ...


class SiblingSharing:
    """Sources, page attachment, kept prompt logits and followers' sampling of one engine."""

    def __init__(self, host: SharingHost):
        self.host = host
        self._prompt_logits: collections.OrderedDict[tuple[int, ...], tuple[int, Any]] = \
            collections.OrderedDict()
        """Context -> (version, device logits row) of recent first prefills (group prompts),
        so a sibling starting later samples without computing anything; bounded by
        max_slots entries."""

    def forget(self) -> None:
        """Drops the kept prompt logits (new weights, new pools)."""
        self._prompt_logits.clear()

    def best_source(self, h: Prefix, full: tuple[int, ...], share,
                    spans=()) -> tuple[Prefix | None, int]:
        """The sibling whose resident KV covers the longest prefix of `full` (with images
        `spans`), and its length."""
        return best_source(h, full, share, self.host.version, spans)

    def attach(self, h: Prefix, src: Prefix, n: int) -> None:
        """Gives `h` (no resident KV) the pages of `src` that hold its first `n` tokens."""
        pages = self.host.pages
        if h.slot is None:
            self.host.ensure_slot(h)
        else:
            pages.release_pages(h.slot)
        pages.share(h.slot, src.slot, -(-n // self.host.cfg.page_size))

    def cached_logits(self, full: tuple[int, ...]):
        hit = self._prompt_logits.get(full)
        if hit is None or hit[0] != self.host.version:
            return None
        self._prompt_logits.move_to_end(full)
        return hit[1]

    def remember_logits(self, full: tuple[int, ...], logits_v) -> None:
        self._prompt_logits[full] = (self.host.version, logits_v)
        self._prompt_logits.move_to_end(full)
        while len(self._prompt_logits) > self.host.cfg.max_slots:
            self._prompt_logits.popitem(last=False)

    def sample_followers(self, follow: list, results: dict[int, tuple]) -> None:
        """Siblings whose whole context is resident elsewhere: share its pages and sample the
        first token from its logits (their own keys), computing nothing."""
        host = self.host
        rows_v = []
        for *_, src, logits_v in follow:
            if logits_v is None:
                _, logits_bv, i, _ = results[id(src)]
                logits_v = logits_bv[i]
            rows_v.append(logits_v)
        n = len(follow)
        buckets = host.cfg.decode_buckets
        b = bucket(n, buckets) if n <= buckets[-1] else n
        logits_nv = jnp.stack(rows_v + [rows_v[0]] * (b - n))
        pad = [0] * (b - n)
        packed = np.asarray(host.sample_rows(
            logits_nv,
            np.array([h.task_id for h, *_ in follow] + pad, np.int32),
            np.array([end for _, _, end, *_ in follow] + pad, np.int32),
            np.array([temp for _, _, _, temp, *_ in follow] + [0.0] * (b - n), np.float32)))
        kept = np.asarray(logits_nv) if host.keep_logits else None
        for i, (h, new, end, temp, cap, src, _) in enumerate(follow):
            self.attach(h, src, end)
            host.commit_prefill(h, new, end, end, temp, cap, packed[i],
                                None if kept is None else kept[i])
            host.counters.prompt_tokens_shared += end
            host.counters.shared_samples += 1
