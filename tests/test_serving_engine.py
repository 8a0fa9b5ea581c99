"""Engine numerics and contract: multi-turn appends vs full recompute, logprobs, batch
invariance, fork, weight versions, eviction, exhaustion, stop reasons, trace counts.

Tolerances (fp32): logits 1e-4 (whole model), logprobs 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine
from tiderl.serving.pages import PoolExhaustedError, StaleKVError, StopReason

MODEL = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, qkv_bias=True, tie_embeddings=False)
ROLLOUT = dict(page_size=4, num_pages=96, max_slots=8, max_context=96, max_action_tokens=6,
               decode_buckets=(1, 2, 4, 8), prefill_buckets=(4, 8, 16))


@functools.cache
def _base():
    return init_policy(MODEL, seed=0)


def _params(seed):
    graphdef, params = _base()
    # Non-zero biases and larger weights so the test sees a peaked, bias-dependent model; numpy
    # noise because one more jitted init costs seconds on a shared 2-core box.
    rng = np.random.default_rng(seed)
    noise = lambda x: x + (0.2 * rng.standard_normal(x.shape)).astype(np.float32)  # noqa: E731
    return graphdef, jax.tree.map(noise, params)


@pytest.fixture(scope="module")
def model():
    return _params(0)


def _engine(model, **kw):
    graphdef, params = model
    cfg = RolloutConfig(**{**ROLLOUT, **kw})
    eng = Engine(graphdef, params, MODEL, cfg, seed=1, keep_logits=True)
    return eng, eng.init_decode_state()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens_bt):
    positions_bt = jnp.arange(tokens_bt.shape[1])[None]
    return nnx.merge(graphdef, params)(tokens_bt, positions_bt, jnp.ones_like(tokens_bt))[0]


def _full_logits(graphdef, params, tokens):
    """Full-recompute forward (training path); padded to one length so it compiles once."""
    t = np.zeros((1, ROLLOUT["max_context"]), np.int32)
    t[0, : len(tokens)] = tokens  # causal: the padding after the tokens changes nothing before
    return np.asarray(_forward(graphdef, params, t)[0, : len(tokens)], np.float32)


def _decode_until_done(eng, state, handles):
    while any(h.decoding for h in handles):
        state, _ = eng.generate(None, state)
    return state


def _check_against_full(eng, graphdef, params, h, tol=1e-4):
    """Every logged logits row of task h equals the full forward at that position."""
    full = _full_logits(graphdef, params, h.tokens)
    rows = [(pos, lg) for tid, pos, lg in eng.logits_log if tid == h.task_id]
    assert rows
    for pos, lg in rows:
        np.testing.assert_allclose(lg, full[pos - 1], atol=tol, rtol=0)
    return full


def test_greedy_multiturn_matches_full_recompute(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=0.0)
    rng = np.random.default_rng(0)
    h = None
    for n_obs in [11, 3, 21, 1]:  # 21 > largest bucket: chunked prefill
        obs = rng.integers(0, MODEL.vocab_size, n_obs)
        h = eng.prefill(None, h, obs, n_obs, task_id=5)
        state = eng.insert(h, state)
        state = _decode_until_done(eng, state, [h])
        assert h.stop_reason == StopReason.MAX_ACTION_TOKENS and len(h.action_tokens) == 6
    full = _check_against_full(eng, graphdef, params, h)
    for _, pos, _ in eng.logits_log:
        assert h.tokens[pos] == int(np.argmax(full[pos - 1]))
    # Every turn served the resident context from KV: only new tokens were computed.
    c = eng.counters
    assert c.computed_new == 11 + (1 + 3) + (1 + 21) + (1 + 1) and c.recomputed_evicted == 0
    assert c.prompt_tokens_served == 0 + (17 - 1) + (26 - 1) + (53 - 1)
    # One trace per bucket used: decode at B=1; prefill at T=16 (11, the 21-chunk), 4 (4, 2), 8 (5)
    # (engines of one config share compiled kernels, so other tests may add buckets).
    assert {("decode", 1, 1), ("prefill", 1, 16), ("prefill", 1, 4),
            ("prefill", 1, 8)} <= {k[:3] for k in eng.trace_counts}
    assert all(n == 1 for n in eng.trace_counts.values()), eng.trace_counts
    # ... and per page-table width: each call attends over its context's pages rounded up to a
    # power of two (the context grew from 11 to 59 tokens, 3 to 15 pages of 4), never more
    # than a slot's 24 pages; the logits above equal the full recompute at every width.
    widths = {k[3] for k in eng.trace_counts if k[0] == "decode"}
    assert {4, 8, 16} <= widths <= {1, 2, 4, 8, 16, 24}, widths


def test_sampled_logprobs_equal_trainer_recompute(model):
    graphdef, params = model
    temp = 0.7
    eng, state = _engine(model, temperature=temp)
    h = eng.prefill(None, None, np.arange(9), 9, task_id=11)
    state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [h])
    first = list(h.action_tokens), list(h.logprobs)
    h = eng.prefill(None, h, [3, 1, 4], 3)
    state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [h])
    logp = jax.nn.log_softmax(_full_logits(graphdef, params, h.tokens) / temp, axis=-1)
    for start, (toks, lps) in [(9, first), (h.action_start, (h.action_tokens, h.logprobs))]:
        for i, (tok, lp) in enumerate(zip(toks, lps, strict=True)):
            np.testing.assert_allclose(lp, logp[start + i - 1, tok], atol=1e-5, rtol=0)
    # Greedy: the returned logprob is the untempered log_softmax (documented in sampling.py).
    eng0, state0 = _engine(model, temperature=0.0)
    g = eng0.prefill(None, None, np.arange(9), 9, task_id=11)
    ref = jax.nn.log_softmax(_full_logits(graphdef, params, g.tokens[:9]))[8, g.tokens[9]]
    np.testing.assert_allclose(g.logprobs[0], ref, atol=1e-5)


def _run_task(eng, state, task_id, prompt, obs, slot=None, others=()):
    """Two turns of `task_id`, optionally alongside other tasks; returns its tokens."""
    hs = [eng.prefill(None, None, p, len(p), task_id=t) for t, p in others]
    h = eng.prefill(None, None, prompt, len(prompt), task_id=task_id)
    for x in hs:
        state = eng.insert(x, state)
    state = eng.insert(h, state, slot)
    state = _decode_until_done(eng, state, [h, *hs])
    h = eng.prefill(None, h, obs, len(obs))
    state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [h])
    tokens = list(h.tokens)
    for x in [h, *hs]:
        eng.free(x)
    assert eng.pages.pages_in_use == 0
    return tokens


def test_tokens_independent_of_batch_padding_and_slot(model):
    eng, state = _engine(model, temperature=1.0, max_action_tokens=8)
    prompt, obs = np.arange(7), [5, 6, 7, 8, 9]
    alone = _run_task(eng, state, 42, prompt, obs)
    others = [(t, np.arange(t % 5 + 3)) for t in range(4)]  # 5 decoding → padded to bucket 8
    batched = _run_task(eng, state, 42, prompt, obs, others=others)
    moved = _run_task(eng, state, 42, prompt, obs, slot=6, others=others[:2])
    assert alone == batched == moved
    assert ("decode", 8, 1) in {k[:3] for k in eng.trace_counts}
    other_task = _run_task(eng, state, 43, prompt, obs)
    assert other_task != alone  # keys really depend on the task id


def test_fork_shares_pages_and_siblings_continue_correctly(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=1.0, max_action_tokens=5)
    parent = eng.prefill(None, None, np.arange(10), 10, task_id=0)  # 3 pages, last partial
    kids = eng.fork(parent, 3, task_ids=[1, 2, 3])
    table = eng.pages.tables[parent.slot]
    assert [int(eng.pages.refcount[p]) for p in table] == [4, 4, 4]
    assert eng.pages.pages_in_use == 3 and eng.pages.pages_shared == 3  # counted once
    assert all(k.tokens == parent.tokens[:10] and k.kv_length == 10 for k in kids)
    for k in kids[:2]:
        eng.prefill(None, k, [], 0)  # samples the sibling's own first token
    # Each sibling copied only the partial last page; the two full pages stay shared by all.
    assert [int(eng.pages.refcount[p]) for p in table] == [4, 4, 2]
    assert eng.pages.pages_in_use == 3 + 2 and eng.counters.page_copies == 2
    for h in [parent, *kids[:2]]:
        state = eng.insert(h, state)
    state, _ = eng.generate(None, state)  # the parent writes its shared page: copy in decode
    assert eng.counters.page_copies == 3 and eng.pages.pages_in_use == 3 + 3
    eng.prefill(None, kids[2], [], 0)  # the last holder of the page: no copy
    assert eng.counters.page_copies == 3
    state = eng.insert(kids[2], state)
    state = _decode_until_done(eng, state, [parent, *kids])
    actions = [tuple(h.action_tokens) for h in [parent, *kids]]
    assert len(set(actions)) > 1  # siblings diverged
    for h in [parent, *kids]:  # and each continued from the shared prompt correctly
        _check_against_full(eng, graphdef, params, h)
        eng.prefill(None, h, [7, 7], 2)  # appends after divergence
        state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [parent, *kids])
    for h in [parent, *kids]:
        _check_against_full(eng, graphdef, params, h)
        eng.free(h)
    eng.pages.check()
    assert eng.pages.pages_in_use == 0


def test_update_weights_no_retrace_and_stale_kv_never_attended(model):
    graphdef, params = model
    _, params_b = _params(7)
    eng, state = _engine(model, temperature=0.0)
    a = eng.prefill(None, None, np.arange(6), 6, task_id=1)
    b = eng.prefill(None, None, np.arange(5), 5, task_id=2)
    for h in (a, b):
        state = eng.insert(h, state)
    state, _ = eng.generate(None, state)
    traces = dict(eng.trace_counts)
    with pytest.raises(ValueError, match="not the engine's current weights"):
        eng.generate(params_b, state)

    # Lazy flush: decoding a stale slot is refused, prefill recomputes it.
    eng.update_weights(params_b, flush=False)
    assert eng.version == 1
    with pytest.raises(StaleKVError, match="version 0"):
        eng.generate(None, state)
    n_a = a.kv_length
    eng.prefill(None, a, [], 0)
    assert eng.counters.recomputed_version == n_a
    state = eng.insert(a, state)
    b.decoding = False  # b stays stale and paused; only a decodes
    state = _decode_until_done(eng, state, [a])
    logged = len(eng.logits_log)

    # Eager flush (the default): every slot loses its KV, resuming recomputes it.
    eng.update_weights(params, version=5)
    assert a.kv_length == 0 and b.kv_length == 0 and eng.pages.pages_in_use == 0
    with pytest.raises(ValueError, match="not prefilled"):
        eng.insert(b, state)
    eng.prefill(None, b, [], 0)
    state = eng.insert(b, state)
    state = _decode_until_done(eng, state, [b])
    # b's tokens after the flush come from version 5 (= the original params) over fresh KV.
    full = _full_logits(graphdef, params, b.tokens)
    for tid, pos, lg in eng.logits_log[logged:]:
        assert tid == 2
        np.testing.assert_allclose(lg, full[pos - 1], atol=1e-4)
    assert dict(eng.trace_counts) == traces | {k: 1 for k in eng.trace_counts if k not in traces}
    assert all(v == 1 for v in eng.trace_counts.values())

    bad = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="dtype"):
        eng.update_weights(bad)


def test_evict_then_resume_recomputes_only_what_is_missing(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=0.0)
    h = eng.prefill(None, None, np.arange(12), 12, task_id=3)
    state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [h])
    resident = h.kv_length
    eng.evict(h)
    assert h.slot is None and eng.pages.pages_in_use == 0 and len(h.tokens) == 18
    eng.prefill(None, h, [1, 2], 2)  # resume with the next observation
    assert eng.counters.recomputed_evicted == resident
    state = eng.insert(h, state)
    state = _decode_until_done(eng, state, [h])
    _check_against_full(eng, graphdef, params, h)
    stats = eng.stats()
    assert stats["prompt_tokens_queried"] == 12 + 20 and stats["prompt_tokens_served"] == 0


def test_pool_exhaustion_raises_and_other_slots_survive(model):
    graphdef, params = model
    eng, state = _engine(model, temperature=0.0, num_pages=6, max_context=64)
    a = eng.prefill(None, None, np.arange(9), 9, task_id=1)  # 3 pages
    state = eng.insert(a, state)
    with pytest.raises(PoolExhaustedError, match=r"rollout\.num_pages=6"):
        eng.prefill(None, None, np.arange(20), 20, task_id=2)  # needs 6
    assert eng.pages.pages_in_use == 3 and sum(s is not None for s in state.slots) == 1
    state = _decode_until_done(eng, state, [a])
    _check_against_full(eng, graphdef, params, a)
    eng.pages.check()


def test_stop_reasons(model):
    eng, state = _engine(model, temperature=0.0, max_context=24)
    probe = eng.prefill(None, None, np.arange(8), 8, task_id=9)
    state = eng.insert(probe, state)
    state = _decode_until_done(eng, state, [probe])
    eng.free(probe)
    stop = probe.action_tokens[2]
    eng2, state2 = _engine(model, temperature=0.0, max_context=24, stop_tokens=(stop,))
    h = eng2.prefill(None, None, np.arange(8), 8, task_id=9)
    state2 = eng2.insert(h, state2)
    state2 = _decode_until_done(eng2, state2, [h])
    assert h.stop_reason == StopReason.STOP_TOKEN and h.action_tokens[-1] == stop
    h = eng2.prefill(None, h, np.arange(9), 9, max_action_tokens=50)  # context now 20
    state2 = eng2.insert(h, state2)
    state2 = _decode_until_done(eng2, state2, [h])
    assert h.stop_reason in (StopReason.CONTEXT_LIMIT, StopReason.STOP_TOKEN)
    if h.stop_reason == StopReason.CONTEXT_LIMIT:
        assert len(h.tokens) == 24
    h2 = eng2.prefill(None, None, np.arange(30), 30, task_id=10)
    assert h2.stop_reason == StopReason.CONTEXT_LIMIT and h2.slot is None


def test_pallas_engine_matches_reference_engine(model):
    """The fast path (Pallas decode in interpret mode, dot_product_attention prefill)."""
    runs = []
    for attention in ("reference", "pallas"):
        eng, state = _engine(model, temperature=0.0, attention=attention)
        assert eng.attention == attention and eng.interpret
        hs = [eng.prefill(None, None, np.arange(n) + n, n, task_id=n) for n in (5, 13)]
        for h in hs:
            state = eng.insert(h, state)
        state = _decode_until_done(eng, state, hs)
        hs[0] = eng.prefill(None, hs[0], [1, 2, 3], 3)
        state = eng.insert(hs[0], state)
        state = _decode_until_done(eng, state, hs)
        runs.append(([h.tokens for h in hs], eng.logits_log))
    assert runs[0][0] == runs[1][0]
    for (t0, p0, l0), (t1, p1, l1) in zip(runs[0][1], runs[1][1], strict=True):
        assert (t0, p0) == (t1, p1)
        np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=0)


def test_prefill_many_matches_single_prefills_and_is_all_or_nothing(model):
    graphdef, params = model
    from tiderl.serving.engine import PrefillRequest

    eng, state = _engine(model, temperature=1.0)
    old = eng.prefill(None, None, np.arange(6), 6, task_id=20)  # resident, gets an observation
    gone = eng.prefill(None, None, np.arange(9), 9, task_id=21)
    eng.evict(gone)  # evicted: everything is recomputed
    reqs = [PrefillRequest(old, [4, 4, 4], 3), PrefillRequest(gone, [5], 1),
            PrefillRequest(None, np.arange(40) % 7, 40, task_id=22),  # chunked (16+16+8)
            PrefillRequest(None, [1, 2], 2, task_id=23)]
    hs = eng.prefill_many(None, reqs)
    assert ("prefill", 4, 16) in {k[:3] for k in eng.trace_counts}
    for h in hs:
        state = eng.insert(h, state)
    state = _decode_until_done(eng, state, hs)
    for h in hs:
        _check_against_full(eng, graphdef, params, h)
    # Same tasks one at a time on a fresh engine: identical tokens.
    eng2, _ = _engine(model, temperature=1.0)
    a = eng2.prefill(None, None, np.arange(6), 6, task_id=20)
    a = eng2.prefill(None, a, [4, 4, 4], 3)
    c = eng2.prefill(None, None, np.arange(40) % 7, 40, task_id=22)
    assert a.tokens[: len(a.tokens)] == hs[0].tokens[: len(a.tokens)]
    assert c.tokens == hs[2].tokens[: len(c.tokens)]
    # Capacity is checked for the whole batch before anything is allocated.
    in_use, free_slots = eng.pages.pages_in_use, int((~eng.pages.in_use).sum())
    with pytest.raises(PoolExhaustedError, match=r"rollout\.max_slots=8"):
        eng.prefill_many(None, [PrefillRequest(None, [1], 1, task_id=100 + i) for i in range(5)])
    assert eng.pages.pages_in_use == in_use and int((~eng.pages.in_use).sum()) == free_slots
    eng.pages.check()


def test_banned_tokens_are_never_sampled_and_logprobs_stay_full_vocabulary():
    """`sample(banned=...)` (a vision-language policy's image placeholders): rows whose
    logits favour a banned id never return it, greedy or sampled, and the returned logprob is
    the full-vocabulary log_softmax(logits / T) of the token drawn, as without a ban."""
    from tiderl.serving.sampling import sample

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    logits[:, 5] += 6.0  # the banned id holds most of the mass
    logits[:, 7] += 3.0
    keys = jax.random.split(jax.random.key(0), 64)
    for temp in (0.0, 1.0):
        t = np.full(64, temp, np.float32)
        free, _ = sample(jnp.asarray(logits), keys, jnp.asarray(t))
        toks, lps = sample(jnp.asarray(logits), keys, jnp.asarray(t), banned=(5, 9))
        toks = np.asarray(toks)
        assert (np.asarray(free) == 5).mean() > 0.5  # it would be drawn without the ban
        assert not np.isin(toks, (5, 9)).any()
        scaled = logits / (temp if temp > 0 else 1.0)
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(scaled), axis=-1))
        np.testing.assert_allclose(np.asarray(lps), ref[np.arange(64), toks], atol=1e-6)
    greedy, _ = sample(jnp.asarray(logits), keys, jnp.zeros(64, jnp.float32), banned=(5,))
    masked = logits.copy()
    masked[:, 5] = -np.inf
    np.testing.assert_array_equal(np.asarray(greedy), masked.argmax(-1))


def test_map_headroom_warns_once_before_the_kernel_limit(tmp_path, caplog, monkeypatch):
    """Compiling many kernels on CPU can exhaust Linux's per-process memory maps (XLA maps
    memory per executable); past vm.max_map_count the process dies with SIGSEGV. The check
    each new trace runs warns once, naming the limit and the fix."""
    import tiderl.serving.steps as steps

    monkeypatch.setattr(steps, "_maps_warned", False)
    limit, maps = tmp_path / "max_map_count", tmp_path / "maps"
    limit.write_text("100\n")
    maps.write_text("m\n" * 70)
    with caplog.at_level("WARNING", logger="tiderl.serving.steps"):
        assert steps.check_map_headroom(0.75, str(limit), str(maps)) == (70, 100)
        assert not caplog.records
        maps.write_text("m\n" * 80)
        assert steps.check_map_headroom(0.75, str(limit), str(maps)) == (80, 100)
        assert steps.check_map_headroom(0.75, str(limit), str(maps)) == (80, 100)
    assert len(caplog.records) == 1
    assert "vm.max_map_count" in caplog.text and "sysctl" in caplog.text
    assert steps.check_map_headroom(0.75, str(tmp_path / "absent"), str(maps)) is None
    if (real := steps.check_map_headroom(1.0)) is not None:  # Linux: this process's own maps
        assert 0 < real[0] and real[1] > 0
