"""Prefix sharing of GRPO siblings: exact prefill counts, and forked siblings sample exactly
what unshared ones do (logprobs within 1e-5, fp32), at the engine and through the rollout."""

from __future__ import annotations

import numpy as np
import pytest
from test_serving_engine import MODEL, _check_against_full, _decode_until_done, _engine

from tiderl.serving.pages import PrefillRequest

G = 8


@pytest.fixture(scope="module")
def model():
    from test_serving_engine import _params

    return _params(0)


def _start_group(eng, state, prompt, ids, *, share: bool, split: int | None = None):
    """Prefills G siblings' identical prompt (in one call, or `split` first then the rest)."""
    hs: list = []
    parts = [ids] if split is None else [ids[:split], ids[split:]]
    for part in parts:
        reqs = [PrefillRequest(None, prompt, len(prompt), task_id=i,
                               share=hs if share else None) for i in part]
        new = eng.prefill_many(None, reqs)
        for h in new:
            state = eng.insert(h, state)
        hs += new
    return state, hs


@pytest.mark.parametrize("split", [None, 1])
def test_siblings_compute_the_prompt_once_and_sample_as_if_unshared(model, split):
    graphdef, params = model
    prompt = list(np.random.default_rng(3).integers(0, MODEL.vocab_size, 13))
    ids = list(range(40, 40 + G))
    runs = {}
    for share in (False, True):
        eng, state = _engine(model, temperature=1.0)
        state, hs = _start_group(eng, state, prompt, ids, share=share, split=split)
        first = [(h.tokens[-1], h.logprobs[0]) for h in hs]
        state = _decode_until_done(eng, state, hs)
        runs[share] = (eng, hs, first)
    (off, hs_off, first_off), (on, hs_on, first_on) = runs[False], runs[True]
    # Exact counts: unshared, every sibling computes the prompt; shared, one does and the
    # other G-1 compute nothing (their first token comes from its logits, their own keys).
    p = len(prompt)
    assert off.counters.computed_new - on.counters.computed_new == (G - 1) * p
    assert on.counters.prompt_tokens_shared == (G - 1) * p
    assert on.counters.shared_samples == G - 1
    assert on.pages.pages_in_use < off.pages.pages_in_use
    # Forked siblings sample what unshared ones do: same tokens, logprobs within 1e-5.
    for (t0, lp0), (t1, lp1) in zip(first_off, first_on, strict=True):
        assert t0 == t1 and abs(lp0 - lp1) <= 1e-5
    for a, b in zip(hs_off, hs_on, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        _check_against_full(on, graphdef, params, b)  # and equal a full recompute (1e-4)
    on.pages.check()


def test_an_evicted_sibling_takes_the_prompt_pages_and_computes_only_its_own_tokens(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=1.0)
    prompt = list(range(5, 5 + 13))  # 13 tokens: 3 full pages of 4, one partial
    state, (a, b) = _start_group(eng, state, prompt, [1, 2], share=True)
    state = _decode_until_done(eng, state, [a, b])
    eng.evict(b)
    before = eng.counters.computed_new + eng.counters.recomputed_evicted
    shared = eng.counters.prompt_tokens_shared
    b = eng.prefill_many(None, [PrefillRequest(b, [7, 8], 2, share=[a, b])])[0]
    computed = eng.counters.computed_new + eng.counters.recomputed_evicted - before
    # The common prefix with a's resident KV is the prompt (their actions differ): only b's
    # action and observation are recomputed.
    assert eng.counters.prompt_tokens_shared - shared == len(prompt)
    assert computed == len(b.tokens) - 1 - len(prompt) and b.prefill_cached == len(prompt)
    state = eng.insert(b, state)
    state = _decode_until_done(eng, state, [b])
    _check_against_full(eng, graphdef, params, b)
    eng.pages.check()


def test_the_engine_is_what_sibling_sharing_takes(model):
    """Sharing sees the engine only through `SharingHost`: an object it owns, not a base."""
    from tiderl.serving.share import SharingHost, SiblingSharing

    eng, _ = _engine(model)
    assert isinstance(eng, SharingHost) and not isinstance(eng, SiblingSharing)
    assert isinstance(eng.sharing, SiblingSharing) and eng.sharing.host is eng
