"""Host tier of the paged KV cache: an evicted task's pages, kept in host memory. No JAX
(the store keeps what the engine copied: a JAX array in the backend's pinned host memory).

With `rollout.host_kv_pages` > 0, `Engine.evict` queues a copy of the task's resident pages
to pinned host memory before it frees them (it does not wait for it), and the task's next
prefill copies them back into fresh pages instead of computing that context again (what
SGLang's HiCache and vLLM's CPU offloading do for their prefix caches). On a CPU the copy is
a memcpy; on a GPU it crosses PCIe (a 7B model's 57 KB of KV per token: ~1 ms per thousand
tokens at 55 GB/s, against tens of milliseconds to prefill them). It is an engine option, so
both schedulers get it.

An entry belongs to one task handle and one weight version: it holds the KV of the handle's
first `n_tokens` tokens, the tokens it was computed on and the version. It is restorable while
the engine is at that version and those tokens still open the handle's context (a handle's
context only grows; the check guards the rest). A weight sync clears the store (its KV is
stale), `free` and a migration drop the task's entry, and the oldest entries make room for a
new one when the store is full (an entry larger than the whole store is not kept).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass(eq=False)
class HostKV:
    """One evicted task's KV on the host: `kv` is `[n_layers, 2 (K, V), kv heads, pages,
    page_size, head_dim]` (a JAX array in pinned host memory, or a NumPy array), whose first
    `n_pages` pages hold its first `n_tokens` tokens (`tokens`), of weight version `version`.
    The engine copies pages in power-of-two buckets (one compiled copy per bucket): the
    pages past `n_pages` are padding, and count in the store as memory it holds."""

    tokens: tuple[int, ...]
    version: int
    kv: Any
    n_pages: int

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def held_pages(self) -> int:
        """Pages of host memory the entry holds (its padding included)."""
        return self.kv.shape[3]


class HostKVStore:
    """Evicted tasks' KV on the host, at most `capacity_pages` pages, oldest dropped first."""

    def __init__(self, capacity_pages: int):
        if capacity_pages <= 0:
            raise ValueError(f"host KV store needs capacity_pages > 0, got {capacity_pages}")
        self.capacity_pages = capacity_pages
        # id(handle) -> (handle, entry); the handle is held so its id is not reused meanwhile.
        self._entries: collections.OrderedDict[int, tuple[Any, HostKV]] = \
            collections.OrderedDict()
        self.pages_used = 0
        self.dropped = 0
        """Entries dropped to make room for newer ones."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, handle: Any, entry: HostKV) -> bool:
        """Keeps `entry` as `handle`'s (replacing any older one), dropping the oldest entries
        until it fits; False (nothing kept) when it alone is larger than the store."""
        self.drop(handle)
        if entry.held_pages > self.capacity_pages:
            return False
        while self.pages_used + entry.held_pages > self.capacity_pages:
            _, (_, old) = self._entries.popitem(last=False)
            self.pages_used -= old.held_pages
            self.dropped += 1
        self._entries[id(handle)] = (handle, entry)
        self.pages_used += entry.held_pages
        return True

    def lookup(self, handle: Any, version: int, context) -> HostKV | None:
        """`handle`'s entry if its KV can be restored now: of weight `version`, computed on
        tokens that open `context` (the handle's context with this prefill's new tokens)."""
        got = self._entries.get(id(handle))
        if got is None or got[0] is not handle:
            return None
        entry = got[1]
        n = entry.n_tokens
        if entry.version != version or n > len(context) or tuple(context[:n]) != entry.tokens:
            return None
        return entry

    def drop(self, handle: Any) -> None:
        """Forgets `handle`'s entry (restored, ended, migrated or replaced)."""
        got = self._entries.pop(id(handle), None)
        if got is not None:
            self.pages_used -= got[1].held_pages

    def clear(self) -> None:
        """Forgets every entry (a weight sync: their KV is of an older version)."""
        self._entries.clear()
        self.pages_used = 0
