"""Prefix sharing of GRPO siblings inside one engine (its `prefill_many` calls these).

A task with no resident KV takes the pages of the longest common prefix a sibling holds
resident, copy-on-write (the first write into a shared page copies it), and computes only the
rest; a sibling whose whole context is a group's prompt resident at a sibling samples its
first token, with its own key, from the logits kept from that prompt's prefill.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from tiderl.serving.pages import Prefix, best_source


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


class SiblingSharing:
    """Engine mixin: sources, page attachment, kept prompt logits, followers' sampling.
    Uses the engine's `cfg`, `pages`, `version`, `counters`, `_prompt_logits`, `_sample_fn`,
    `run_key`, `keep_logits`, `_state`, `_count_compute`, `_append` and `_take_sample`."""

    cfg: Any
    pages: Any
    version: int
    counters: Any
    keep_logits: bool
    run_key: Any

    def _best_source(self, h: Prefix, full: tuple[int, ...],
                     share) -> tuple[Prefix | None, int]:
        """The sibling whose resident KV covers the longest prefix of `full`, and its length."""
        return best_source(h, full, share, self.version)

    def _attach(self, h: Prefix, src: Prefix, n: int) -> None:
        """Gives `h` (no resident KV) the pages of `src` that hold its first `n` tokens."""
        if h.slot is None:
            h.slot = self.pages.open()
            self._state().slots[h.slot] = h
        else:
            self.pages.release_pages(h.slot)
        self.pages.share(h.slot, src.slot, -(-n // self.cfg.page_size))

    def _cached_logits(self, full: tuple[int, ...]):
        hit = self._prompt_logits.get(full)
        if hit is None or hit[0] != self.version:
            return None
        self._prompt_logits.move_to_end(full)
        return hit[1]

    def _keep_logits(self, full: tuple[int, ...], logits_v) -> None:
        self._prompt_logits[full] = (self.version, logits_v)
        self._prompt_logits.move_to_end(full)
        while len(self._prompt_logits) > self.cfg.max_slots:
            self._prompt_logits.popitem(last=False)

    def _sample_followers(self, follow: list, results: dict[int, tuple]) -> None:
        """Siblings whose whole context is resident elsewhere: share its pages and sample the
        first token from its logits (their own keys), computing nothing."""
        rows_v = []
        for *_, src, logits_v in follow:
            if logits_v is None:
                _, logits_bv, i, _ = results[id(src)]
                logits_v = logits_bv[i]
            rows_v.append(logits_v)
        n = len(follow)
        b = bucket(n, self.cfg.decode_buckets) if n <= self.cfg.decode_buckets[-1] else n
        logits_nv = jnp.stack(rows_v + [rows_v[0]] * (b - n))
        pad = [0] * (b - n)
        packed = np.asarray(self._sample_fn(
            logits_nv, self.run_key,
            np.array([h.task_id for h, *_ in follow] + pad, np.int32),
            np.array([end for _, _, end, *_ in follow] + pad, np.int32),
            np.array([temp for _, _, _, temp, *_ in follow] + [0.0] * (b - n), np.float32)))
        host = np.asarray(logits_nv) if self.keep_logits else None
        for i, (h, new, end, temp, cap, src, _) in enumerate(follow):
            self._attach(h, src, end)
            self._count_compute(h, end, end)
            self._append(h, new, end, temp, cap)
            self.counters.prompt_tokens_shared += end
            self.counters.shared_samples += 1
            self._take_sample(h, packed[i], None if host is None else host[i])
