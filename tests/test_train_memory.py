"""Memory features are exact: the chunked vocab head (values and gradients, deferred and fused,
vocabulary-tiled backward), per-block remat, stacked/scanned layers, query-chunked attention
and chunked MLPs, bf16 compute over fp32 master weights, an in-place optimizer update, no Ref
copy without a KL term, and the engine applying the head only at sampled positions on serving
weights (falling back to full logits for a custom policy).

Tolerances: chunked head vs whole-batch head in fp32 — values 1e-5 absolute, gradients 1e-5
relative to the largest gradient entry (the two sum logits in different orders); remat,
scanned layers and token chunks — values 1e-6 absolute, gradients 1e-6 relative (same ops,
recomputed or chunked; 1e-5 with the chunked head); bf16 compute vs fp32 compute on the same
data — loss and gradient global norm 2e-2 relative (bf16 has an 8-bit mantissa).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.decoder import Decoder
from tiderl.models.layers import attend, attend_query_chunked, packed_causal_mask
from tiderl.models.policy import abstract_policy, build_policy, convert_layout, init_policy
from tiderl.models.sharding import make_mesh
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine
from tiderl.train.backend import TrainerBackend
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.grpo import LossSpec, token_outputs
from tiderl.train.head import chunked_token_outputs
from tiderl.train.ref_actor import (
    make_kernels,
    make_logprobs,
    make_optimizer,
    make_outputs,
    train_shardings,
)
from tiderl.train.synthetic import synthetic_trajectories

VALUE_ATOL = 1e-5
GRAD_RTOL = 1e-5
REMAT_RTOL = 1e-6
BF16_RTOL = 2e-2

TIED = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, qkv_bias=True, max_seq_len=128)
UNTIED = dataclasses.replace(TIED, tie_embeddings=False)


def _batch(b=3, t=17, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.ones((b, t), np.int32)
    seg[1, 9:] = 2  # two packed sequences in row 1
    pos = np.tile(np.arange(t), (b, 1))
    pos[1, 9:] = np.arange(t - 9)
    return {"tokens_bt": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
            "positions_bt": jnp.asarray(pos, jnp.int32), "segment_ids_bt": jnp.asarray(seg)}


def _rel(a, b):
    """Largest entry difference over the largest entry of b, across a pytree."""
    num = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b), strict=True))
    return num / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))


def _value_and_grads(outputs, params, batch):
    """A loss that weighs every position and both outputs (entropy squared: a non-trivial
    cotangent for the entropy)."""
    w = jnp.linspace(-1.0, 2.0, batch["tokens_bt"].shape[1])

    def loss(p):
        lp, ent = outputs(p, batch)
        return jnp.sum(lp * w) + 0.3 * jnp.sum(ent * ent), (lp, ent)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


_REFERENCE: dict = {}


def _reference(cfg):
    """(graphdef, params, batch, whole-batch head values and grads) per config, computed once
    for the tests that compare against it."""
    if cfg not in _REFERENCE:
        graphdef, params = nnx.split(build_policy(cfg, seed=1))
        batch = _batch()
        _REFERENCE[cfg] = (graphdef, params, batch,
                           _value_and_grads(make_outputs(graphdef, 0.7), params, batch))
    return _REFERENCE[cfg]


# A chunk that does not divide B·(T−1) (padding, several chunks) with the tied head, one chunk
# larger than the batch with the untied one.
@pytest.mark.parametrize("cfg,chunk", [(TIED, 7), (UNTIED, 1000)], ids=["tied-7", "untied-1000"])
def test_chunked_head_equals_whole_batch_head(cfg, chunk):
    graphdef, params, batch, ((_, (lp0, ent0)), g0) = _reference(cfg)
    (_, (lp1, ent1)), g1 = _value_and_grads(make_outputs(graphdef, 0.7, head_chunk=chunk),
                                            params, batch)
    np.testing.assert_allclose(lp1, lp0, atol=VALUE_ATOL, rtol=0)
    np.testing.assert_allclose(ent1, ent0, atol=VALUE_ATOL, rtol=0)
    assert float(jnp.max(ent0)) > 1.0  # a spread distribution: the entropy term is exercised
    assert _rel(g1, g0) < GRAD_RTOL
    head = "embed_vd" if cfg.tie_embeddings else "lm_head_dv"
    assert float(jnp.max(jnp.abs(g1[head][...]))) > 0
    # The logprob-only kernel (Ref forward) agrees too.
    lp2 = jax.jit(make_logprobs(graphdef, 0.7, head_chunk=chunk))(params, batch)
    np.testing.assert_allclose(lp2, lp0, atol=VALUE_ATOL, rtol=0)


def test_chunked_head_function_against_token_outputs_directly():
    """The head function alone, on random hidden states, with a chunk not dividing B·(T−1)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k1, (2, 9, 16))
    w = 0.5 * jax.random.normal(k2, (50, 16))
    y = jax.random.randint(k3, (2, 9), 0, 50)
    cot = jnp.linspace(0.5, 1.5, 18).reshape(2, 9)

    def f(fn):
        def loss(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(cot * lp) - 0.7 * jnp.sum(cot * ent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, w)

    ref_v, ref_g = f(lambda h, w: token_outputs(jnp.einsum("btd,vd->btv", h, w), y, 1.3))
    # Vocabulary tiles of the backward: the default (one tile here), 7 (seven tiles and a
    # remainder of one row), one row per tile.
    for tile in (None, 7, 1):
        v, g = f(lambda h, w, tile=tile: chunked_token_outputs(h, w, y, 1.3, 5, tile))
        assert abs(float(v - ref_v)) <= VALUE_ATOL * max(1.0, abs(float(ref_v)))
        assert _rel(g, ref_g) < GRAD_RTOL, tile
    with pytest.raises(ValueError, match="head_chunk"):
        chunked_token_outputs(h, w, y, 1.0, 0)


def test_query_chunked_attention_equals_dense():
    """Packed rows (two segments, padding), GQA, a chunk that does not divide T."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    b, t, h, kh, dh = 2, 21, 4, 2, 8
    q = jax.random.normal(k1, (b, t, h, dh))
    k = jax.random.normal(k2, (b, t, kh, dh))
    v = jax.random.normal(k3, (b, t, kh, dh))
    seg = np.ones((b, t), np.int32)
    seg[1, 9:] = 2
    seg[0, 18:] = 0
    seg = jnp.asarray(seg)

    def f(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))),
                                          argnums=(0, 1, 2)))(q, k, v)

    ref_v, ref_g = f(lambda q, k, v: attend(q, k, v, packed_causal_mask(seg)))
    for chunk in (4, 21, 64):
        val, g = f(lambda q, k, v, c=chunk: attend_query_chunked(q, k, v, seg, c))
        # fp32 sums in another order under jit: measured 1.1e-5 on 33.9 (3.4e-7 relative).
        assert abs(float(val - ref_v)) <= 1e-6 * abs(float(ref_v)), chunk
        assert _rel(g, ref_g) < REMAT_RTOL * 10, chunk


def test_remat_scanned_layers_and_token_chunks_equal_the_plain_path():
    """Per-block remat (unrolled), then stacked layers scanned with the rematerialising scan,
    query-chunked attention, chunked MLPs and the chunked head: the same values and gradients
    as the plain forward."""
    cfg = dataclasses.replace(UNTIED, n_layers=3)
    scfg = dataclasses.replace(cfg, scan_layers=True)
    graphdef, params = nnx.split(build_policy(cfg, seed=2))
    sgraphdef = abstract_policy(scfg)[0]
    stacked = convert_layout(params, cfg, scan_layers=True)
    assert stacked["layers"]["attn"]["wq_dhk"][...].shape[0] == 3
    back = convert_layout(stacked, scfg, scan_layers=False)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                   jax.tree.leaves(params), strict=True))
    batch = _batch(seed=3)
    (_, (lp0, _)), g0 = _value_and_grads(make_outputs(graphdef, 1.0), params, batch)
    runs = {"remat": (graphdef, params, dict(remat=True), REMAT_RTOL),
            "scan-remat-chunks": (sgraphdef, stacked, dict(remat=True, token_chunk=4),
                                  REMAT_RTOL),
            "scan-remat-chunks-head": (sgraphdef, stacked,
                                       dict(remat=True, token_chunk=5, head_chunk=7), GRAD_RTOL)}
    for name, (gd, p, kw, rtol) in runs.items():
        (_, (lp1, _)), g1 = _value_and_grads(make_outputs(gd, 1.0, **kw), p, batch)
        np.testing.assert_allclose(lp1, lp0, atol=1e-6, rtol=0, err_msg=name)
        if gd is sgraphdef:
            g1 = convert_layout(g1, scfg, scan_layers=False)
        assert _rel(g1, g0) < rtol, name

    # Really rematerialised: the vjp keeps far less than without remat (block inputs only).
    def residual_elems(gd, p, remat):
        vjp = jax.eval_shape(  # shapes only: nothing runs
            lambda p: jax.vjp(lambda q: make_outputs(gd, 1.0, remat=remat)(q, batch), p)[1], p)
        return sum(x.size for x in jax.tree.leaves(vjp))

    assert residual_elems(graphdef, params, True) < 0.5 * residual_elems(graphdef, params, False)
    assert residual_elems(sgraphdef, stacked, True) < 0.5 * residual_elems(sgraphdef, stacked,
                                                                           False)


def test_grouped_remat_keeps_fewer_inputs_and_equals_the_plain_path():
    """trainer.remat_group: only every group-th block input is kept (the others recomputed in
    the backward); values and gradients are those of the plain forward (same per-block ops)."""
    cfg = dataclasses.replace(UNTIED, n_layers=4)
    scfg = dataclasses.replace(cfg, scan_layers=True)
    graphdef, params = nnx.split(build_policy(cfg, seed=4))
    sgraphdef = abstract_policy(scfg)[0]
    stacked = convert_layout(params, cfg, scan_layers=True)
    batch = _batch(seed=5)
    (_, (lp0, _)), g0 = _value_and_grads(make_outputs(graphdef, 1.0), params, batch)
    saved = {}
    for group in (2,):  # 1: test_remat_scanned_layers_and_token_chunks_equal_the_plain_path
        kw = dict(remat=True, token_chunk=5, remat_group=group)
        (_, (lp1, _)), g1 = _value_and_grads(make_outputs(sgraphdef, 1.0, **kw), stacked, batch)
        np.testing.assert_allclose(lp1, lp0, atol=1e-6, rtol=0, err_msg=str(group))
        assert _rel(convert_layout(g1, scfg, scan_layers=False), g0) < REMAT_RTOL, group
        vjp = jax.eval_shape(lambda p, kw=kw: jax.vjp(  # shapes only
            lambda q: make_outputs(sgraphdef, 1.0, **kw)(q, batch), p)[1], stacked)
        saved[group] = sum(x.size for x in jax.tree.leaves(vjp)
                           if x.ndim == 4 and x.shape[1:] == (3, 17, 32))  # [n, B, T, D] inputs
    assert saved == {2: 2 * 3 * 17 * 32}  # 2 of the 4 layers' inputs
    with pytest.raises(ValueError, match="trainer.remat_group=3"):
        make_outputs(sgraphdef, 1.0, remat=True, remat_group=3)(stacked, batch)
    with pytest.raises(ConfigError, match="trainer.remat_group"):
        TrainerConfig(remat_group=0)


def _backward_temp_bytes(n_layers):
    """XLA's temporaries of the Actor backward kernel (compile only) for a scanned,
    rematerialised, token-chunked stack of `n_layers` blocks, 2 rows × 256 tokens."""
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=16, mlp_dim=256, max_seq_len=512, scan_layers=True)
    graphdef, params = abstract_policy(cfg)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    tcfg = TrainerConfig(kl_coef=0.0, remat=True, token_chunk=32, head_chunk=64)
    tx = make_optimizer(tcfg)
    sh = train_shardings(params, tx, make_mesh(jax.devices()[:1], data=1))
    k = make_kernels(graphdef, tx, LossSpec.from_config(tcfg), 1.0, sh, head_chunk=64,
                     remat=True, token_chunk=32)
    S = jax.ShapeDtypeStruct
    ints = {"tokens_bt", "positions_bt", "segment_ids_bt", "versions_bt"}
    batch = {key: S((2, 256), jnp.int32 if key in ints else jnp.float32)
             for key in ("tokens_bt", "positions_bt", "segment_ids_bt", "loss_mask_bt",
                         "behaviour_logprobs_bt", "advantages_bt", "versions_bt")}
    outs, vjp = jax.eval_shape(k.actor_forward, params, batch)
    low = k.backward.lower(vjp, outs, S((2, 256), jnp.float32), batch, S((), jnp.int32), None)
    state = jax.eval_shape(lambda p: {"params": p, "opt": tx.init(p),
                                      "step": jnp.zeros((), jnp.int32)}, params)
    apply = k.apply.lower(state, params).compile().memory_analysis()
    scale = k.scale_grads.lower(params, S((), jnp.float32)).compile().memory_analysis()
    return low.compile().memory_analysis().temp_size_in_bytes, apply, scale


def test_scanned_backward_temporaries_stay_flat_and_the_update_is_in_place():
    """Compile-only sizes: with scanned, rematerialised layers the backward's temporaries do
    not grow with depth (one block is recomputed at a time), and the optimizer update keeps
    nothing gradient-sized beside the donated state (every leaf updated in place)."""
    t2, _, _ = _backward_temp_bytes(2)
    t8, apply, scale = _backward_temp_bytes(8)
    one_layer = 4 * (4 * 64 * 16 * 2 + 2 * 64 * 2 * 16 + 3 * 64 * 256)  # a block's fp32 params
    assert t8 <= t2 + one_layer, (t2, t8)
    # A few KiB of scalars and loop state, against 2 MB of block parameters (fp32): nothing
    # gradient-sized (measured: about 5 KB each; the bound is 1% of the blocks).
    small = 8 * one_layer // 100
    assert apply.temp_size_in_bytes < small and scale.temp_size_in_bytes < small, (
        apply.temp_size_in_bytes, scale.temp_size_in_bytes)
    # Every array updated in place; only scalars (step and schedule counts: measured 288 bytes
    # of the update's outputs) may be fresh buffers.
    assert apply.output_size_in_bytes - apply.alias_size_in_bytes < 1024  # the state
    assert scale.output_size_in_bytes - scale.alias_size_in_bytes < 1024  # the gradient sum


def test_custom_policy_falls_back_to_full_logits():
    cfg = ModelConfig(policy="examples.custom_policy:MiniTransformer", vocab_size=64, d_model=32,
                      n_kv_heads=4)
    graphdef, params = nnx.split(build_policy(cfg, seed=0))
    batch = _batch(vocab=64)
    (_, (lp0, _)), g0 = _value_and_grads(make_outputs(graphdef, 1.0), params, batch)
    (_, (lp1, _)), g1 = _value_and_grads(make_outputs(graphdef, 1.0, head_chunk=4), params,
                                         batch)
    np.testing.assert_array_equal(lp1, lp0)
    assert _rel(g1, g0) == 0.0
    with pytest.raises(ValueError, match="trainer.remat"):
        make_outputs(graphdef, 1.0, remat=True)(params, batch)


def _mbs(vocab, seed=0):
    trajs = synthetic_trajectories(12, vocab=vocab, min_len=6, max_len=30, seed=seed,
                                   versions=(0, 1))
    return microbatches(trajs, n_ranks=1, row_len=64, rows_per_rank=2)[0]


def test_backend_deferred_step_with_chunked_head_and_remat_equals_fused_whole_head():
    mesh = make_mesh(jax.devices()[:1], data=1)
    policy = init_policy(UNTIED, seed=0)
    base = TrainerConfig(kl_coef=0.1, entropy_coef=0.05, dual_clip=3.0)
    mbs = _mbs(UNTIED.vocab_size)
    assert len(mbs) >= 2
    ref = TrainerBackend(base, UNTIED, actor_mesh=mesh, temperature=0.8, policy=policy)
    ref.version = 1
    m0 = ref.fused_step(mbs)
    # Stacked layers, the rematerialising scan, token chunks and the chunked head.
    scan = dataclasses.replace(UNTIED, scan_layers=True)
    stacked = (abstract_policy(scan)[0], convert_layout(policy[1], UNTIED, scan_layers=True))
    chunked = TrainerBackend(dataclasses.replace(base, head_chunk=16, remat=True, token_chunk=8),
                             scan, actor_mesh=mesh, temperature=0.8, policy=stacked)
    chunked.version = 1
    m1 = chunked.train_step(mbs)  # the deferred path: Actor forward's vjp, Ref later
    assert abs(m1["loss"] - m0["loss"]) <= 1e-5 * max(1.0, abs(m0["loss"]))
    assert abs(m1["grad_norm"] - m0["grad_norm"]) <= GRAD_RTOL * m0["grad_norm"]
    assert _rel(convert_layout(chunked.state["params"], scan, scan_layers=False),
                ref.state["params"]) < 1e-5
    for be in (ref, chunked):
        be.close()


def test_bf16_compute_fp32_master_one_step():
    mesh = make_mesh(jax.devices()[:1], data=1)
    bf16 = dataclasses.replace(UNTIED, compute_dtype="bfloat16")
    cfg = TrainerConfig(kl_coef=0.1, entropy_coef=0.05, head_chunk=16)
    mbs = _mbs(UNTIED.vocab_size, seed=1)
    out = {}
    for name, mcfg in (("fp32", UNTIED), ("bf16", bf16)):
        be = TrainerBackend(cfg, mcfg, actor_mesh=mesh, policy=init_policy(mcfg, seed=0))
        for mb in mbs:
            b = be.put(mb, "actor")
            outs, vjp = be.actor_forward(b)
            be.actor_backward(vjp, outs, be.ref_forward(b), b, mb)
        grads = be._grads
        assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
        gnorm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
        loss = float(sum(m["loss_sum"] for m in be._metrics))
        be.apply()
        out[name] = (loss, gnorm)
        state_dtypes = {x.dtype for x in jax.tree.leaves(be.state["params"])}
        opt_dtypes = {x.dtype for x in jax.tree.leaves(be.state["opt"])
                      if jnp.issubdtype(x.dtype, jnp.floating)}
        assert state_dtypes == opt_dtypes == {jnp.dtype(jnp.float32)}
        be.close()
    (l32, g32), (l16, g16) = out["fp32"], out["bf16"]
    assert l16 != l32 and g16 != g32  # bf16 really ran
    print(f"bf16 vs fp32: loss {l16:.6g} vs {l32:.6g} (rel {abs(l16 - l32) / abs(l32):.2e}), "
          f"grad norm {g16:.6g} vs {g32:.6g} (rel {abs(g16 - g32) / g32:.2e})")
    assert abs(l16 - l32) <= BF16_RTOL * abs(l32)
    assert abs(g16 - g32) <= BF16_RTOL * g32


def test_memory_config_keys():
    assert TrainerConfig(head_chunk=512, remat=True, token_chunk=128).token_chunk == 128
    with pytest.raises(ConfigError, match="trainer.head_chunk"):
        TrainerConfig(head_chunk=-1)
    with pytest.raises(ConfigError, match="trainer.token_chunk"):
        TrainerConfig(token_chunk=-1)
    with pytest.raises(ConfigError, match="model.scan_layers"):
        ModelConfig(policy="examples.custom_policy:MiniTransformer", scan_layers=True)


def test_no_ref_copy_without_kl_and_checkpoints_either_way(tmp_path):
    """kl_coef = 0: no Ref copy of the weights; its checkpoints resume, and so does a
    checkpoint written with a KL term (its Ref is read and dropped)."""
    mesh = make_mesh(jax.devices()[:1], data=1)
    policy = init_policy(TIED, seed=0)
    mbs = _mbs(TIED.vocab_size, seed=2)
    with_kl = TrainerBackend(TrainerConfig(kl_coef=0.1), TIED, actor_mesh=mesh, policy=policy)
    no_kl = TrainerBackend(TrainerConfig(kl_coef=0.0), TIED, actor_mesh=mesh, policy=policy)
    assert with_kl.ref_params is not None and no_kl.ref_params is None
    with_kl.train_step(mbs)
    no_kl.train_step(mbs)
    for name, be in (("kl", with_kl), ("nokl", no_kl)):
        ckpt = Checkpointer(tmp_path / name, async_save=False)
        ckpt.save(be, wait=True)
        fresh = TrainerBackend(TrainerConfig(kl_coef=0.0), TIED, actor_mesh=mesh, policy=policy)
        assert ckpt.restore(fresh)[0] == 1 and fresh.ref_params is None and fresh.version == 1
        assert _rel(fresh.state, be.state) == 0.0
        fresh.train_step(mbs)  # and it trains on
        ckpt.close()
        for b in (be, fresh):
            b.close()


def test_engine_applies_the_head_only_at_sampled_positions(monkeypatch):
    seen = []
    real = Decoder.logits

    def spy(self, h_btd):
        seen.append(tuple(h_btd.shape))
        return real(self, h_btd)

    monkeypatch.setattr(Decoder, "logits", spy)
    # A config of its own: the engine's compiled steps are cached per graphdef.
    cfg = dataclasses.replace(UNTIED, vocab_size=301)
    graphdef, params = init_policy(cfg, seed=0)
    rollout = RolloutConfig(page_size=4, num_pages=32, max_slots=2, max_context=64,
                            max_action_tokens=3, decode_buckets=(1, 2), prefill_buckets=(8, 16))
    eng = Engine(graphdef, params, cfg, rollout, seed=0, keep_logits=True)
    state = eng.init_decode_state()
    prompt = list(range(1, 12))
    p = eng.prefill(params, None, prompt, len(prompt), task_id=1)
    state = eng.insert(p, state)
    while p.decoding:
        state, _ = eng.generate(None, state)
    assert seen and all(s[1] == 1 for s in seen), seen  # B×1×D only, never B×T×D
    # The sampled logits equal the full forward's at those positions.
    full = np.asarray(nnx.merge(graphdef, params)(
        jnp.asarray([p.tokens]), jnp.arange(len(p.tokens))[None],
        jnp.ones((1, len(p.tokens)), jnp.int32))[0][0])
    for _, pos, lg in eng.logits_log:
        np.testing.assert_allclose(lg, full[pos - 1], atol=1e-4, rtol=0)


def test_engine_runs_on_the_trainers_serving_weights():
    """A scanned, bf16-compute trainer feeds its engines per-layer weights whose matrices are
    bf16 (norm scales stay fp32): the engine samples what it samples on the fp32 master
    weights, to bf16 rounding (the decoder casts those to bf16 itself)."""
    mesh = make_mesh(jax.devices()[:1], data=1)
    cfg = dataclasses.replace(UNTIED, vocab_size=302, compute_dtype="bfloat16",
                              scan_layers=True)
    be = TrainerBackend(TrainerConfig(kl_coef=0.0), cfg, actor_mesh=mesh, seed=0)
    weights = be.export_weights()
    assert sorted(weights["layers"].keys()) == [0, 1]  # per layer, the engine's layout
    assert {(x.ndim >= 2, x.dtype) for x in jax.tree.leaves(weights)} == {
        (True, jnp.dtype(jnp.bfloat16)), (False, jnp.dtype(jnp.float32))}
    master = convert_layout(be.state["params"], cfg, scan_layers=False)
    rollout = RolloutConfig(page_size=4, num_pages=32, max_slots=2, max_context=64,
                            max_action_tokens=3, decode_buckets=(1, 2), prefill_buckets=(8, 16),
                            temperature=0.0)
    logs = []
    for params in (weights, master):
        eng = Engine(be.serving_graphdef, params, cfg, rollout, seed=0, keep_logits=True)
        state = eng.init_decode_state()
        p = eng.prefill(params, None, list(range(1, 12)), 11, task_id=1)
        state = eng.insert(p, state)
        while p.decoding:
            state, _ = eng.generate(None, state)
        logs.append(eng.logits_log)
    assert len(logs[0]) == len(logs[1]) == 3
    for (_, pa, la), (_, pb, lb) in zip(*logs, strict=True):
        assert pa == pb
        np.testing.assert_allclose(la, lb, atol=BF16_RTOL * max(1.0, float(np.abs(lb).max())),
                                   rtol=0)
    be.close()


def test_engine_serves_a_custom_policy_with_full_logits():
    cfg = ModelConfig(policy="examples.custom_policy:MiniTransformer", vocab_size=64, d_model=32,
                      n_kv_heads=4, max_seq_len=64)
    graphdef, params = init_policy(cfg, seed=0)
    rollout = RolloutConfig(page_size=4, num_pages=32, max_slots=2, max_context=64,
                            max_action_tokens=3, decode_buckets=(1, 2), prefill_buckets=(8, 16))
    eng = Engine(graphdef, params, cfg, rollout, seed=0, keep_logits=True)
    state = eng.init_decode_state()
    p = eng.prefill(params, None, [1, 2, 3, 4, 5], 5, task_id=1)
    state = eng.insert(p, state)
    while p.decoding:
        state, _ = eng.generate(None, state)
    full = np.asarray(nnx.merge(graphdef, params)(
        jnp.asarray([p.tokens]), jnp.arange(len(p.tokens))[None],
        jnp.ones((1, len(p.tokens)), jnp.int32))[0][0])
    assert len(eng.logits_log) == 3
    for _, pos, lg in eng.logits_log:
        np.testing.assert_allclose(lg, full[pos - 1], atol=1e-4, rtol=0)


REMAT_PROBE = r"""
import json, sys
from tiderl.runtime.devices import ClusterConfig, init_jax
init_jax(ClusterConfig(platform="cpu", fake_cpu_devices=1), low_memory=sys.argv[1] == "1")
import dataclasses
import jax
from flax import nnx
from tiderl.models.config import ModelConfig
from tiderl.models.policy import build_policy
cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                  mlp_dim=128, max_seq_len=512)
graphdef, params = nnx.split(build_policy(cfg, seed=0))
def loss(p, tokens):
    model = nnx.merge(graphdef, p)
    h, _ = model.hidden_states(tokens, pos, seg, remat=True)
    return (h * h).sum()
S = jax.ShapeDtypeStruct
tokens = S((4, 512), "int32")
pos = jax.numpy.broadcast_to(jax.numpy.arange(512), (4, 512))
seg = jax.numpy.ones((4, 512), "int32")
c = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
print(json.dumps({"temp": c.memory_analysis().temp_size_in_bytes}))
"""


def test_launch_keeps_remat_effective_on_the_cpu():
    """With trainer.remat, launch starts XLA:CPU with its memory-ordered scheduler: the default
    one runs all blocks' recomputations ahead of the backward, keeping every block's attention
    scores live at once (compile-only sizes, 6 layers × 4 rows × 512 tokens)."""
    import json
    import subprocess
    import sys

    temps = {}
    for low in ("0", "1"):
        env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
        r = subprocess.run([sys.executable, "-c", REMAT_PROBE, low], capture_output=True,
                           text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        temps[low] = json.loads(r.stdout.strip().splitlines()[-1])["temp"]
    scores = 4 * 4 * 512 * 512 * 4  # one layer's B×H×T×T fp32 attention scores
    # Measured: ~22 score-sized buffers (all 6 layers' recomputations live) against ~4.7 (one
    # layer's scores, probabilities and their cotangents at a time).
    assert temps["0"] > 16 * scores and temps["1"] < 8 * scores, {k: v / scores
                                                                  for k, v in temps.items()}


TRIM_PROBE = """
import sys
import jax
from tiderl.runtime import platforms
assert platforms.cpu_low_memory_malloc(trim=sys.argv[1] == "1")
before = platforms.TRIMS[0]
jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(3)).block_until_ready()
jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(3)).block_until_ready()  # cached: no compilation
print(platforms.TRIMS[0] - before)
"""


def test_cpu_low_memory_malloc_trims_the_heap_after_each_compilation():
    """With trainer.remat on the CPU, launch fixes glibc's mmap threshold and hands the
    compiler's freed working memory back after every XLA compilation (`malloc_trim`); the
    0.5B-shaped step of benchmarks/memory.py peaked 0.16 GiB lower with it. Two processes: the
    listener is process-wide."""
    import subprocess
    import sys

    got = {}
    for trim in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", TRIM_PROBE, trim], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got[trim] = int(r.stdout.strip().splitlines()[-1])
    # The jit compiles once (the second call hits its cache); jnp.ones may compile its own.
    assert got["1"] >= 1 and got["0"] == 0, got
