"""Kernel parity on a real GPU (skipped elsewhere): the compiled Pallas decode and flash
attention kernels and cuDNN attention against the XLA references, pinned_host offload, the
KV pool sized from free device memory. Run on a GPU machine with

    JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu tests/test_gpu.py

(tests/conftest.py defaults JAX_PLATFORMS to cpu.) The same kernels run in interpret mode on
the CPU in tests/test_gpu_path.py.

Tolerances: bf16 2e-2 × max(1, |reference|); fp32 2e-3 (Triton runs fp32 dots in TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]

TOL = {jnp.bfloat16: 2e-2, jnp.float32: 2e-3}


def _assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    assert np.abs(got - want).max() <= TOL[dtype] * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("pm", [8, 64, 128])
def test_pallas_decode_compiled_matches_gather(dtype, pm):
    """Qwen2.5-1.5B's attention shape (12 q heads on 2 kv heads, head_dim 128), 16-token pages,
    random lengths; the kernel's own split choice for the table width."""
    from tiderl.serving.kv import append_mask, gather_attend, pallas_paged_decode

    rng = np.random.default_rng(pm)
    b, h, k, dh, s = 8, 12, 2, 128, 16
    p = b * pm + 3
    kp, vp = (jnp.asarray(rng.standard_normal((k, p + 1, s, dh)), dtype) for _ in range(2))
    table = jnp.asarray(rng.permutation(p)[: b * pm].reshape(b, pm), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, pm * s + 1, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, h, dh)), dtype)
    got = jax.jit(lambda *a: pallas_paged_decode(*a, interpret=False))(q, kp, vp, table,
                                                                       lengths)
    want = gather_attend(q[:, None], kp, vp, table,
                         append_mask((lengths - 1)[:, None], lengths, pm * s))[:, 0]
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_training_attention_kernels_match_xla(impl, head_dim):
    from tiderl.models.attention import train_attention

    rng = np.random.default_rng(head_dim)
    b, t, h, k = 2, 1024, 12, 2
    seg = np.zeros((b, t), np.int32)
    seg[0, :300], seg[0, 300:900] = 1, 2
    seg[1, :], seg[1, 512:] = 1, 2
    seg = jnp.asarray(seg)
    q = jnp.asarray(rng.standard_normal((b, t, h, head_dim)), jnp.bfloat16)
    kk, vv = (jnp.asarray(rng.standard_normal((b, t, k, head_dim)), jnp.bfloat16)
              for _ in range(2))
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * (seg > 0)[:, :, None, None]

    def run(which):
        def loss(q, k, v):
            return jnp.sum(train_attention(q, k, v, seg, which).astype(jnp.float32) * ct)
        return jax.jit(lambda *a: (train_attention(*a, seg, which),
                                   jax.grad(loss, argnums=(0, 1, 2))(*a)))(q, kk, vv)

    out, grads = run(impl)
    ref, ref_grads = run("xla")
    real = np.asarray(seg > 0)[:, :, None, None]
    _assert_close(np.where(real, out, 0), np.where(real, ref, 0), jnp.bfloat16)
    for a, r in zip(grads, ref_grads, strict=True):
        _assert_close(a, r, jnp.bfloat16)


def test_engine_pallas_matches_reference_on_gpu():
    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import init_policy
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine
    from tiderl.serving.weights import serving_weights

    mcfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2,
                       head_dim=64, mlp_dim=512, compute_dtype="bfloat16")
    graphdef, params = init_policy(mcfg, seed=0)
    params = serving_weights(params, mcfg)
    logs = {}
    for attention in ("reference", "pallas"):
        rc = RolloutConfig(page_size=16, num_pages=64, max_slots=4, max_context=256,
                           max_action_tokens=4, decode_buckets=(4,), prefill_buckets=(64,),
                           temperature=0.0, attention=attention)
        eng = Engine(graphdef, params, mcfg, rc, seed=0, keep_logits=True)
        assert eng.attention == attention and not eng.interpret
        state = eng.init_decode_state()
        hs = [eng.prefill(None, None, list(range(3 + i, 40 + 5 * i)), 37 + 4 * i, task_id=i)
              for i in range(4)]
        for hh in hs:
            state = eng.insert(hh, state)
        state, _ = eng.generate(None, state)
        logs[attention] = eng.logits_log
    for (t0, p0, l0), (t1, p1, l1) in zip(logs["reference"], logs["pallas"], strict=True):
        assert (t0, p0) == (t1, p1)
        _assert_close(l1, l0, jnp.bfloat16)


def test_swap_to_pinned_host_frees_device_memory():
    from tiderl.models.config import ModelConfig
    from tiderl.models.sharding import make_mesh
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.config import TrainerConfig

    dev = jax.devices()[0]
    mcfg = ModelConfig(vocab_size=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2,
                       head_dim=64, mlp_dim=2048)
    be = TrainerBackend(TrainerConfig(kl_coef=0.0, offload="never"), mcfg,
                        actor_mesh=make_mesh([dev]))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(be.state))
    before = dev.memory_stats()["bytes_in_use"]
    be.swap("actor", "host")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(be.state)} == {"pinned_host"}
    assert before - dev.memory_stats()["bytes_in_use"] >= 0.9 * nbytes
    be.swap("actor", "device")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(be.state)} == {"device"}
    be.close()


def test_kv_pool_sized_from_free_memory():
    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import init_policy
    from tiderl.serving.config import RolloutConfig, page_bytes, pages_for_memory
    from tiderl.serving.engine import Engine

    dev = jax.devices()[0]
    mcfg = ModelConfig(compute_dtype="bfloat16")
    graphdef, params = init_policy(mcfg, seed=0)
    rc = RolloutConfig(kv_memory_fraction=0.001, num_pages=16, max_slots=4096,
                       decode_buckets=(4096,), max_context=1024)
    st = dev.memory_stats()
    per = page_bytes(n_layers=mcfg.n_layers, n_kv_heads=mcfg.n_kv_heads,
                     head_dim=mcfg.head_dim, page_size=rc.page_size, dtype_bytes=2)
    want = pages_for_memory(rc, free_bytes=st["bytes_limit"] - st["bytes_in_use"],
                            page_bytes=per)
    eng = Engine(graphdef, params, mcfg, rc)
    assert 16 < eng.cfg.num_pages < rc.max_slots * rc.max_pages_per_slot  # not capped
    assert abs(eng.cfg.num_pages - want) <= 0.01 * want
    state = eng.init_decode_state()
    assert state.pools.k[0].shape[1] == eng.cfg.num_pages + 1
