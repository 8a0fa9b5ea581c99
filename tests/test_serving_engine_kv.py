"""Attention kernels over pages: Pallas decode (interpret mode) and the dot_product_attention
prefill path against the pure-jnp gather reference; paged against a dense cache.

Tolerance (fp32, one attention layer): 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tiderl.serving.kv import DenseKV, KVPools, PagedKV

K, H, DH, S, P, PM = 2, 4, 16, 4, 40, 8  # kv heads, q heads, head dim, page size, pages, table


def _setup(seed, b, t, start):
    """Random pools (garbage in unowned pages), disjoint page tables, q/k/v for new tokens."""
    rng = np.random.default_rng(seed)
    pools = KVPools(k=(jnp.asarray(rng.standard_normal((K, P + 1, S, DH)), jnp.float32),),
                    v=(jnp.asarray(rng.standard_normal((K, P + 1, S, DH)), jnp.float32),))
    table = rng.permutation(P)[: b * PM].reshape(b, PM).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, t, H, DH)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, K, DH)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, K, DH)), jnp.float32)
    return pools, jnp.asarray(table), jnp.asarray(start, jnp.int32), q, k, v


def _attend(impl, pools, table, start, n_new, q, k, v):
    cache = PagedKV(pools, table, start, jnp.asarray(n_new, jnp.int32), impl=impl, interpret=True)
    out, cache = jax.jit(lambda c, q, k, v: c.attend(0, q, k, v))(cache, q, k, v)
    return np.asarray(out), cache


def test_pallas_decode_matches_gather_reference():
    start = [0, 5, 17, 31]  # resident lengths, incl. empty and a full table (31 + 1 = 32 = PM*S)
    args = _setup(0, 4, 1, start)
    ref, ref_cache = _attend("reference", *args[:3], [1, 1, 1, 1], *args[3:])
    got, got_cache = _attend("pallas", *args[:3], [1, 1, 1, 1], *args[3:])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got_cache.pools.k[0], ref_cache.pools.k[0])


def test_dot_product_attention_prefill_matches_reference():
    start = [0, 3, 9]
    args = _setup(1, 3, 6, start)
    n_new = [6, 2, 5]  # row 1 and 2 have padding tokens after their real ones
    ref, _ = _attend("reference", *args[:3], n_new, *args[3:])
    got, _ = _attend("pallas", *args[:3], n_new, *args[3:])
    for b, n in enumerate(n_new):  # padded query rows are garbage by contract
        np.testing.assert_allclose(got[b, :n], ref[b, :n], atol=1e-5, rtol=0)


def test_paged_matches_dense_cache_and_appends_are_bottom_right_causal():
    b, t, start, n_new = 2, 5, [4, 9], [5, 3]
    pools, table, start_b, q, k, v = _setup(2, b, t, start)
    # Dense cache with the same resident context the pages hold.
    dense_k = np.zeros((b, PM * S, K, DH), np.float32)
    dense_v = np.zeros_like(dense_k)
    for r in range(b):
        for pos in range(start[r]):
            page, off = int(table[r, pos // S]), pos % S
            dense_k[r, pos] = np.asarray(pools.k[0][:, page, off])
            dense_v[r, pos] = np.asarray(pools.v[0][:, page, off])
    paged, _ = _attend("reference", pools, table, start_b, n_new, q, k, v)
    dense = DenseKV((jnp.asarray(dense_k),), (jnp.asarray(dense_v),), start_b,
                    jnp.asarray(n_new, jnp.int32))
    out, _ = dense.attend(0, q, k, v)
    for r, n in enumerate(n_new):
        np.testing.assert_allclose(paged[r, :n], np.asarray(out)[r, :n], atol=1e-5, rtol=0)
    # The first appended token must not see the second: recompute row 0 with one token only.
    one, _ = _attend("reference", *_setup(2, b, t, start)[:3], [1, 0], q, k, v)
    np.testing.assert_allclose(one[0, 0], paged[0, 0], atol=1e-5, rtol=0)


def test_sampling_contract():
    """Temperature first over the full vocabulary; greedy at T=0; truncation only filters."""
    from tiderl.serving.sampling import sample, token_keys

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 50)) * 3, jnp.float32)
    keys = token_keys(jax.random.key(0), jnp.arange(4), jnp.full(4, 7))
    temp = jnp.asarray([0.0, 0.5, 1.0, 2.0], jnp.float32)
    tok, lp = sample(logits, keys, temp)
    assert int(tok[0]) == int(jnp.argmax(logits[0]))
    scaled = logits / jnp.where(temp > 0, temp, 1.0)[:, None]
    ref = jax.nn.log_softmax(scaled, axis=-1)[jnp.arange(4), tok]
    np.testing.assert_allclose(lp, ref, atol=1e-6)
    # Same key → same token whatever the row's neighbours (keys come from identities only).
    tok1, _ = sample(logits[2:3], keys[2:3], temp[2:3])
    assert int(tok1[0]) == int(tok[2])
    # An all-greedy batch (no Gumbel noise drawn): argmax and the untempered logprob.
    tg, lpg = sample(logits, keys, jnp.zeros(4))
    np.testing.assert_array_equal(tg, jnp.argmax(logits, -1))
    np.testing.assert_allclose(lpg, jax.nn.log_softmax(logits)[jnp.arange(4), tg], atol=1e-6)
    assert int(tg[0]) == int(tok[0])
    # top_k=1 is greedy at any T; the logprob stays full-vocabulary.
    tk, lpk = sample(logits, keys, jnp.ones(4), top_k=1)
    np.testing.assert_array_equal(tk, jnp.argmax(logits, -1))
    np.testing.assert_allclose(lpk, jax.nn.log_softmax(logits)[jnp.arange(4), tk], atol=1e-6)
    # top_p keeps the smallest prefix reaching p: a tiny p is greedy too.
    tp, _ = sample(logits, keys, jnp.ones(4), top_p=1e-6)
    np.testing.assert_array_equal(tp, jnp.argmax(logits, -1))
    # Many keys at T=1 sample roughly the softmax (frequency of the argmax token).
    keys_n = token_keys(jax.random.key(1), jnp.zeros(4000, jnp.int32), jnp.arange(4000))
    row = jnp.broadcast_to(logits[3] / 4, (4000, 50))
    draws, _ = sample(row, keys_n, jnp.ones(4000))
    p = jax.nn.softmax(logits[3] / 4)
    top = int(jnp.argmax(p))
    assert abs(float(jnp.mean(draws == top)) - float(p[top])) < 0.03
