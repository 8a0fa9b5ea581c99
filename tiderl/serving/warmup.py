"""Compiling an engine's kernels before timed work (`prime_engine`), the host KV tier's page
copies included. No JAX.

The engine traces its prefill kernel per (rows bucket, length bucket, page-table width) and its
decode kernel per (rows bucket, width) (`tiderl.serving.engine`); a shape first met inside a
timed run compiles there. `prime_engine` calls each shape a run on this pool can meet once, in
the fewest pages, and frees what it made: the benchmarks and the simulator's validation time
runs after it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from tiderl.serving.pages import PoolExhaustedError, PrefillRequest, StopReason


def prime_engine(eng: Any, rcfg: Any, ids: Iterator[int] | None = None) -> int:
    """Compiles every prefill and decode bucket of `eng` (with `rcfg`, its RolloutConfig) and
    every prefill page-table width (`prime_widths`); `ids` gives the warm-up tasks' ids
    (default: from 2**30 up, clear of a run's). Needs `eng.init_decode_state()` done; returns
    the calls made."""
    ids = itertools.count(1 << 30) if ids is None else ids
    n, prev = 0, 0
    for b in rcfg.decode_buckets:
        # The fewest rows that land in bucket b, one of them t tokens long (the call's length
        # bucket), the others one token: the same compiled shape as any call of this bucket,
        # in the fewest pages (a tight pool holds b rows of t tokens at no point of a run).
        rows, prev = prev + 1, b
        for t in rcfg.prefill_buckets:
            if -(-t // rcfg.page_size) + rows > rcfg.num_pages:
                continue  # no call of this shape fits the pool: none can occur
            hs = eng.prefill_many(None, [PrefillRequest(None, [5] * k, k, task_id=next(ids))
                                         for k in [t] + [1] * (rows - 1)])
            for h in hs:  # decode them all, whatever they sampled first
                h.stop_reason, h.decoding = StopReason.NONE, True
            eng.generate(None, eng.state)
            for h in hs:
                eng.free(h)
            n += 2
    return n + prime_widths(eng, rcfg, ids) + prime_host_tier(eng, rcfg, ids)


def prime_host_tier(eng: Any, rcfg: Any, ids: Iterator[int]) -> int:
    """With a host KV tier (`rollout.host_kv_pages`): compiles its page copies, one per page
    bucket (powers of two up to a full context's pages), by evicting a context of that many
    pages and prefilling it again. Returns the buckets primed."""
    if getattr(eng, "host_kv", None) is None:
        return 0
    ps, top = rcfg.page_size, rcfg.max_pages_per_slot
    widths = sorted({min(1 << k, top) for k in range(top.bit_length() + 1)})
    done = 0
    for w in widths:
        tokens = min(w * ps, rcfg.max_context - 3)  # room for the next token and its sample
        if -(-tokens // ps) + 1 > min(rcfg.num_pages, rcfg.host_kv_pages):
            break
        (h,) = eng.prefill_many(None, [PrefillRequest(None, [5] * tokens, tokens,
                                                      task_id=next(ids), max_action_tokens=1)])
        eng.evict(h)  # the copy out, at this bucket
        eng.prefill_many(None, [PrefillRequest(h, [5], 1)])  # and back
        eng.free(h)
        done += 1
    return done


def prime_widths(eng: Any, rcfg: Any, ids: Iterator[int]) -> int:
    """Compiles the prefill (and decode) shapes of calls that attend over a resident context:
    the width follows the longest row's context (its pages, rounded up to a power of two), so
    a turn appended to a resident context can need a width no first prefill does. For each w,
    each length bucket t and the fewest rows of each row bucket: one row of n new tokens (in
    bucket t) on a resident context that ends at w pages (or one token short of the context
    limit), the others one token. Returns the shapes primed."""
    ps, n_primed, w = rcfg.page_size, 0, 1
    while w <= rcfg.max_pages_per_slot:
        keys = min(w * ps, rcfg.max_context - 1)  # the longest row's context after the call
        prev_t = 0
        for t in rcfg.prefill_buckets:
            n = min(t, keys - 1)  # new tokens computed: the pending sampled one and n - 1 more
            if n > prev_t and keys > (w // 2) * ps:
                n_primed += _prime_one_width(eng, rcfg, ids, keys, n)
            prev_t = t
        w *= 2
    return n_primed


def _prime_one_width(eng: Any, rcfg: Any, ids: Iterator[int], keys: int, n: int) -> int:
    done, prev = 0, 0
    for b in rcfg.decode_buckets:
        rows, prev = prev + 1, b
        if -(-keys // rcfg.page_size) + rows - 1 > rcfg.num_pages:
            continue  # no call of this shape fits the pool: none can occur
        # A resident context of keys - n tokens (plus its sampled, not yet computed, token).
        (h,) = eng.prefill_many(None, [PrefillRequest(None, [5] * (keys - n), keys - n,
                                                      task_id=next(ids), max_action_tokens=1)])
        hs = eng.prefill_many(None, [PrefillRequest(h, [5] * (n - 1), n - 1)] + [
            PrefillRequest(None, [5], 1, task_id=next(ids)) for _ in range(rows - 1)])
        # And a decode step of these rows at this width (the decode kernel is cut to it too),
        # where the pool has the page it may need.
        for x in hs:
            x.stop_reason, x.decoding = StopReason.NONE, True
        with contextlib.suppress(PoolExhaustedError):
            eng.generate(None, eng.state)
        for x in hs:
            eng.free(x)
        done += 1
    return done
