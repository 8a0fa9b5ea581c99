"""The host KV tier (`rollout.host_kv_pages`): an evicted task's pages copied to host memory
and back instead of computed again — logits equal to the full recompute (1e-4, fp32, as the
engine's other numerics tests), tokens equal to an engine without the tier, the accounting,
capacity, weight versions, sibling sharing, migration, and the store alone (no JAX)."""

import numpy as np
import pytest

from tests.test_serving_engine import (
    MODEL,
    _check_against_full,
    _decode_until_done,
    _engine,
    _params,
)
from tiderl.configlib import ConfigError
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import PrefillRequest
from tiderl.serving.hostkv import HostKV, HostKVStore


@pytest.fixture(scope="module")
def model():
    return _params(0)


def _play(eng, state, turns, *, evict_between: bool, task_id: int = 3):
    """One task over `turns` observations, evicted after every turn when asked."""
    h = None
    for obs in turns:
        h = eng.prefill(None, h, obs, len(obs), task_id=task_id)
        state = eng.insert(h, state)
        state = _decode_until_done(eng, state, [h])
        if evict_between:
            eng.evict(h)
    return h, state


def test_evicted_context_is_restored_not_recomputed(model):
    graphdef, params = model
    rng = np.random.default_rng(1)
    turns = [rng.integers(0, MODEL.vocab_size, n) for n in (13, 5, 22, 3)]  # 22: chunked
    eng, state = _engine(model, temperature=1.0, host_kv_pages=64)
    h, state = _play(eng, state, turns, evict_between=True)
    # The last eviction's copy: in pinned host memory, its pages rounded up to a power of two.
    entry = eng.host_kv.lookup(h, eng.version, h.tokens)
    assert entry.kv.sharding.memory_kind == "pinned_host"
    assert entry.n_pages == -(-entry.n_tokens // eng.cfg.page_size)
    assert entry.n_pages <= entry.held_pages < 2 * entry.n_pages
    _check_against_full(eng, graphdef, params, h)
    c = eng.counters
    # Every resume copied the whole evicted context back: only first-time tokens computed.
    assert c.recomputed_evicted == 0 and c.host_restores == 3 and c.host_offloads == 4
    assert c.prompt_tokens_restored == c.prompt_tokens_served > 0
    assert eng.stats()["kv_device_hit_rate"] == 0.0
    # The same tokens as an engine without the tier (it computes the evicted context again).
    ref, ref_state = _engine(model, temperature=1.0)
    h_ref, _ = _play(ref, ref_state, turns, evict_between=True)
    assert h_ref.tokens == h.tokens
    np.testing.assert_allclose(h_ref.logprobs, h.logprobs, atol=1e-5)
    assert ref.counters.recomputed_evicted > 0 and ref.counters.prompt_tokens_restored == 0
    assert c.computed_new == ref.counters.computed_new
    eng.free(h)
    assert len(eng.host_kv) == 0 and eng.pages.pages_in_use == 0
    eng.pages.check()


def test_capacity_versions_and_migration(model):
    graphdef, params = model
    # 4 host pages of 4 tokens; an entry holds its pages rounded up to a power of two: a
    # 9-token context (3 pages, held as 4) fits, a second one does not, a 17-token one never.
    eng, state = _engine(model, temperature=0.0, host_kv_pages=4, max_action_tokens=2)
    a = eng.prefill(None, None, np.arange(9), 9, task_id=1)  # 9 resident: 3 pages
    b = eng.prefill(None, None, np.arange(8) + 1, 8, task_id=2)
    eng.evict(a)
    assert eng.host_kv.pages_used == 4
    eng.evict(b)  # the older entry (a) makes room
    assert eng.host_kv.pages_used == 2
    assert len(eng.host_kv) == 1 and eng.host_kv.dropped == 1
    eng.prefill(None, a, [5], 1)  # a: computed again
    assert eng.counters.recomputed_evicted == 9 and eng.counters.host_restores == 0
    eng.prefill(None, b, [6], 1)  # b: restored
    assert eng.counters.host_restores == 1 and eng.counters.prompt_tokens_restored == 8
    big = eng.prefill(None, None, np.arange(17), 17, task_id=4)  # 5 pages, held as 8
    eng.evict(big)  # larger than the whole tier: not kept
    assert eng.counters.host_offloads == 2 and len(eng.host_kv) == 0
    # A weight sync clears the tier: KV of older weights is never restored.
    state = eng.insert(b, state)
    state = _decode_until_done(eng, state, [b])
    eng.evict(b)
    assert len(eng.host_kv) == 1
    eng.update_weights(params, version=3)
    assert len(eng.host_kv) == 0
    eng.prefill(None, b, [7], 1)
    state = eng.insert(b, state)
    state = _decode_until_done(eng, state, [b])
    _check_against_full(eng, graphdef, params, b)
    # A task leaving the engine (a migration) leaves nothing in its tier.
    eng.evict(b, offload=False)
    assert len(eng.host_kv) == 0 and b.slot is None
    # A handle whose tokens no longer open the entry's context is not restored.
    eng.prefill(None, b, [8], 1)
    eng.evict(b)
    b.tokens[0] += 1
    eng.prefill(None, b, [9], 1)
    assert eng.counters.host_restores == 1
    eng.pages.check()


def test_siblings_share_or_restore_and_all_or_nothing(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=1.0, host_kv_pages=64, max_slots=4,
                         decode_buckets=(1, 2, 4))
    prompt = np.arange(11) % 9
    hs = eng.prefill_many(None, [PrefillRequest(None, prompt, 11, task_id=10 + i, share=[])
                                 for i in range(3)])
    for h in hs:
        state = eng.insert(h, state)
    state = _decode_until_done(eng, state, hs)
    eng.evict(hs[1])
    eng.evict(hs[2])
    # hs[1] restores its own context (longer than the prompt hs[0] holds); hs[2]'s entry is
    # dropped by hand: it takes the shared prompt pages from hs[0] and computes the rest.
    eng.host_kv.drop(hs[2])
    got = eng.prefill_many(None, [PrefillRequest(hs[1], [1, 2], 2, share=hs),
                                  PrefillRequest(hs[2], [1, 2], 2, share=hs)])
    assert eng.counters.host_restores == 1 and eng.counters.prompt_tokens_shared >= 8
    for h in got:
        state = eng.insert(h, state)
    state = _decode_until_done(eng, state, got)
    for h in hs:
        _check_against_full(eng, graphdef, params, h)
    # No room: nothing is allocated and the entry stays for a later try.
    eng.evict(hs[1])
    n_pages = eng.pages.pages_in_use
    with pytest.raises(Exception, match="max_slots"):
        eng.prefill_many(None, [PrefillRequest(hs[1], [3], 1)] +
                         [PrefillRequest(None, [1], 1, task_id=50 + i) for i in range(3)])
    assert eng.pages.pages_in_use == n_pages and len(eng.host_kv) == 1
    eng.prefill(None, hs[1], [3], 1)
    assert eng.counters.host_restores == 2
    eng.pages.check()


def test_store_alone_and_config():
    kv = lambda n: np.zeros((2, 2, 1, n, 4, 8), np.float32)  # noqa: E731
    s = HostKVStore(4)
    h1, h2, h3 = object(), object(), object()
    assert s.put(h1, HostKV((1, 2, 3), 0, kv(1), 1)) and s.put(h2, HostKV((4,), 0, kv(2), 1))
    assert s.lookup(h1, 0, [1, 2, 3, 9]) is not None
    assert s.lookup(h1, 1, [1, 2, 3]) is None  # another weight version
    assert s.lookup(h1, 0, [1, 2]) is None and s.lookup(h1, 0, [1, 5, 3]) is None
    assert s.put(h3, HostKV((5,), 0, kv(2), 1))  # h1 (oldest) makes room
    assert s.lookup(h1, 0, [1, 2, 3]) is None and s.pages_used == 4 and s.dropped == 1
    assert not s.put(h1, HostKV((1,), 0, kv(5), 3))  # holds more than the store
    s.drop(h2)
    assert s.pages_used == 2 and len(s) == 1
    s.clear()
    assert s.pages_used == 0 and len(s) == 0
    with pytest.raises(ConfigError, match="rollout.host_kv_pages"):
        RolloutConfig(host_kv_pages=-1)


def test_prime_engine_compiles_the_tiers_page_copies(model):
    from tiderl.serving.warmup import prime_host_tier

    eng, _ = _engine(model, host_kv_pages=64)
    cfg = eng.cfg
    n = prime_host_tier(eng, cfg, iter(range(1 << 30, 1 << 31)))
    # Buckets 1, 2, 4, 8, 16 and the full context's 24 pages; nothing left behind.
    assert n == 6 and eng.counters.host_restores == 6
    assert eng.pages.pages_in_use == 0 and len(eng.host_kv) == 0
    plain, _ = _engine(model)
    assert prime_host_tier(plain, plain.cfg, iter(range(10))) == 0
