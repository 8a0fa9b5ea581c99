"""The GPU path, checked on the CPU: platform handling, KV pool sizing, the Pallas kernels in
interpret mode, the fused training attention, bf16 serving weights, and `gpu_check --cpu-smoke`.

Tolerances: fp32 1e-5 (one attention layer, values and gradients; a whole model's logits
1e-5 at these sizes); bf16 kernels 2e-2 × max(1, |reference|) (inputs rounded to bf16 at
different points); bf16 engine vs bf16 trainer logprobs 5e-2 (KV cached in bf16 vs recomputed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl.config import load_config
from tiderl.configlib import ConfigError
from tiderl.models.attention import (
    dpa_attention,
    pallas_attention,
    resolve_impl,
    train_attention,
    unsupported,
)
from tiderl.models.config import ModelConfig
from tiderl.models.layers import attend, packed_causal_mask
from tiderl.runtime.devices import ClusterConfig
from tiderl.runtime.platforms import (
    CPU_LOW_MEMORY_FLAG,
    GPU_XLA_FLAGS,
    check_platform,
    launch_env,
    resolve_colocate,
)
from tiderl.serving.config import RolloutConfig, page_bytes, pages_for_memory
from tiderl.serving.kv import (
    append_mask,
    decode_splits,
    gather_attend,
    pallas_paged_decode,
    pool_pages,
    resolve_decode_attention,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ platform handling
def test_launch_env_per_platform():
    gpu = launch_env("gpu", fake_cpu_devices=2, memory_fraction=0.9, environ={})
    assert gpu.jax_platforms == "cuda,cpu" and gpu.num_cpu_devices == 0  # no fake devices
    assert gpu.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    assert gpu.env["XLA_FLAGS"].split() == list(GPU_XLA_FLAGS)
    cpu = launch_env("cpu", fake_cpu_devices=2, memory_fraction=0.9, environ={},
                     low_memory=True)
    assert cpu.jax_platforms == "cpu" and cpu.num_cpu_devices == 2
    assert cpu.env == {"XLA_FLAGS": CPU_LOW_MEMORY_FLAG}
    auto = launch_env("auto", fake_cpu_devices=2, memory_fraction=0.5, environ={})
    assert auto.jax_platforms is None and auto.num_cpu_devices == 2
    assert auto.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    # The user's own environment wins and is kept; no flag twice.
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6",
            "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d"}
    env = launch_env("gpu", fake_cpu_devices=0, memory_fraction=0.9, environ=mine)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env.env and "XLA_FLAGS" not in env.env
    assert any("from the environment" in n for n in env.notes)
    with pytest.raises(ConfigError, match="cluster.platform"):
        launch_env("metal", fake_cpu_devices=0, memory_fraction=0.9, environ={})


def test_our_xla_flags_parse_with_this_jaxlib():
    """XLA aborts the process on an unknown flag, on any backend: the flags the launcher sets
    for a GPU must exist in the installed jaxlib (checked here on the CPU)."""
    flags = " ".join([*GPU_XLA_FLAGS, CPU_LOW_MEMORY_FLAG])
    r = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                       env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
                            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "cpu", r.stderr[-2000:]


def test_platform_gpu_alone_composes_and_one_gpu_colocates():
    cfg = load_config(None, ["cluster.platform=gpu"])  # the CPU fake-device default is ignored
    assert cfg.cluster.platform == "gpu" and cfg.cluster.fake_cpu_devices == 2
    plan = cfg.device_plan(1, "gpu")  # one rollout rank + one actor device on one GPU
    assert plan.rollout == ((0,),) and plan.actor == (0,)
    with pytest.raises(ConfigError, match="fake_cpu_devices"):
        cfg.device_plan(1, "cpu")  # CPU: the roles stay apart, fake devices are the remedy
    big = load_config(None, ["rollout.ranks=2", "trainer.actor_devices=4",
                             "trainer.fsdp=4", "cluster.colocate_rollout=false"])
    with pytest.raises(ConfigError) as e:
        big.device_plan(4, "gpu")
    msg = str(e.value)
    assert "cluster.colocate_rollout=true" in msg and "CUDA_VISIBLE_DEVICES" in msg
    assert "fake_cpu_devices" not in msg
    two = cfg.device_plan(2, "gpu")  # two GPUs: each role its own
    assert two.rollout == ((0,),) and two.actor == (1,)


def test_resolve_colocate():
    kw = dict(separate_need=2, colocated_need=1)
    assert resolve_colocate("auto", platform="gpu", n_devices=1, **kw)
    assert not resolve_colocate("auto", platform="gpu", n_devices=2, **kw)
    assert not resolve_colocate("auto", platform="cpu", n_devices=1, **kw)
    assert not resolve_colocate("auto", platform="tpu", n_devices=1, separate_need=9,
                                colocated_need=5)  # does not fit shared either: plain error
    assert resolve_colocate(True, platform="cpu", n_devices=8, **kw)
    assert not resolve_colocate(False, platform="gpu", n_devices=1, **kw)


def test_asking_for_a_gpu_never_silently_runs_on_the_cpu():
    check_platform("auto", "cpu")
    check_platform("gpu", "gpu")
    with pytest.raises(ConfigError, match=r"\.\[gpu\]"):
        check_platform("gpu", "cpu")
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", "--plan", "cluster.platform=gpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": ""})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cluster.platform" in lines[0] and "no GPU" in lines[0], r.stderr


def test_cluster_config_validation():
    with pytest.raises(ConfigError, match="cluster.memory_fraction"):
        ClusterConfig(memory_fraction=1.5)
    with pytest.raises(ConfigError, match="rollout.kv_memory_fraction"):
        RolloutConfig(kv_memory_fraction=1.0)


# ------------------------------------------------------------------ KV pool from memory
def test_pool_pages_from_free_memory():
    cfg = RolloutConfig(num_pages=16, page_size=16, max_slots=4, max_context=512,
                        kv_memory_fraction=0.5)
    per = page_bytes(n_layers=2, n_kv_heads=2, head_dim=64, page_size=16, dtype_bytes=2)
    assert per == 2 * 2 * 2 * 16 * 64 * 2
    assert pages_for_memory(cfg, free_bytes=per * 41, page_bytes=per) == 19  # 20.5 → 20, −1
    # Capped at what max_slots full contexts can use (4 × 32 pages).
    assert pages_for_memory(cfg, free_bytes=per * 10_000, page_bytes=per) == 128
    with pytest.raises(ConfigError, match="rollout.kv_memory_fraction.*rollout.num_pages=16"):
        pages_for_memory(cfg, free_bytes=per * 20, page_bytes=per)
    # The CPU reports no memory: the pool keeps rollout.num_pages.
    cpu = jax.devices()[0]
    assert cpu.memory_stats() is None
    assert pool_pages(cfg, n_layers=2, n_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                      device=cpu) == 16

    class Reports:  # the two numbers a GPU's memory_stats() gives (none on this CPU)
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": per * 100, "bytes_in_use": per * 60}

    assert pool_pages(cfg, n_layers=2, n_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                      device=Reports()) == 19


# ------------------------------------------------------------------ Pallas paged decode
def _decode_case(seed, b, h, k, dh, s, pm, dtype):
    rng = np.random.default_rng(seed)
    p = b * pm + 3
    pools = [jnp.asarray(rng.standard_normal((k, p + 1, s, dh)), dtype) for _ in range(2)]
    table = jnp.asarray(rng.permutation(p)[: b * pm].reshape(b, pm), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, pm * s + 1, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, h, dh)), dtype)
    return q, *pools, table, lengths


def _gather_decode(q, kp, vp, table, lengths):
    n_keys = table.shape[1] * kp.shape[2]
    return gather_attend(q[:, None], kp, vp, table,
                         append_mask((lengths - 1)[:, None], lengths, n_keys))[:, 0]


def test_pallas_decode_interpret_matches_gather_fp32():
    """Qwen2.5-0.5B's head grouping (14 q heads on 2 kv heads, padded to the kernel's 16-row
    head block), random lengths up to a full table, and the GPU's split-and-merge (4 splits)
    run on the CPU in interpret mode. (One split: tests/test_serving_engine_kv.py; bf16 on an
    engine's own pool: the smoke run below.)"""
    q, kp, vp, table, lengths = _decode_case(0, 3, 14, 2, 16, 4, 8, jnp.float32)
    got = pallas_paged_decode(q, kp, vp, table, lengths, interpret=True, k_splits=4)
    np.testing.assert_allclose(got, _gather_decode(q, kp, vp, table, lengths), atol=1e-5,
                               rtol=0)


def test_decode_kernel_choice():
    assert decode_splits(128, interpret=False) == (16, 8)  # 1,024-token blocks of 8 pages
    assert decode_splits(80, interpret=False) == (16, 1)  # 5-page partitions: 1-page blocks
    assert decode_splits(8, interpret=True) == (1, 8)
    kw = dict(head_dim=64, page_size=16)
    assert resolve_decode_attention("auto", platform="gpu", **kw) == "pallas"
    assert resolve_decode_attention("auto", platform="cpu", **kw) == "reference"
    assert resolve_decode_attention("auto", platform="gpu", head_dim=80,
                                    page_size=16) == "reference"
    assert resolve_decode_attention("pallas", platform="cpu", head_dim=80,
                                    page_size=12) == "pallas"  # interpret mode takes any shape
    with pytest.raises(ValueError, match="rollout.page_size=12"):
        resolve_decode_attention("pallas", platform="gpu", head_dim=64, page_size=12)


# ------------------------------------------------------------------ training attention
def _packed(seed, b, t, h, k, dh, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    seg[0, :7], seg[0, 7:40], seg[0, 40:50] = 1, 2, 3  # padding after position 50
    seg[1, :], seg[1, 30:] = 1, 2
    q = jnp.asarray(rng.standard_normal((b, t, h, dh)), dtype)
    kv = [jnp.asarray(rng.standard_normal((b, t, k, dh)), dtype) for _ in range(2)]
    ct = jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.float32)
    return q, *kv, jnp.asarray(seg), ct


def _fwd_bwd(fn, q, k, v, ct):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)  # noqa: E731
    return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(
        q, k, v)


@pytest.fixture(scope="module")
def packed_case():
    q, k, v, seg, ct = _packed(0, 2, 64, 4, 2, 16)
    ref = _fwd_bwd(lambda q, k, v: attend(q, k, v, packed_causal_mask(seg)), q, k, v, ct)
    return q, k, v, seg, ct, ref


def test_pallas_flash_attention_equals_dense_fp32(packed_case):
    """Values and gradients on every position, padding included (each padding token sees only
    itself, as the dense mask says), GQA 2:1, three segments and padding in one row."""
    q, k, v, seg, ct, (out, grads) = packed_case
    got, got_g = _fwd_bwd(lambda q, k, v: pallas_attention(q, k, v, seg, interpret=True),
                          q, k, v, ct)
    np.testing.assert_allclose(got, out, atol=1e-5, rtol=0)
    for a, b in zip(got_g, grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_dot_product_attention_path_equals_dense_fp32(packed_case):
    """The 'cudnn' kernel's call — jax.nn.dot_product_attention with the packed mask — run with
    its XLA implementation (cuDNN needs a GPU)."""
    q, k, v, seg, ct, (out, grads) = packed_case
    got, got_g = _fwd_bwd(lambda q, k, v: dpa_attention(q, k, v, seg, implementation="xla"),
                          q, k, v, ct)
    np.testing.assert_allclose(got, out, atol=1e-5, rtol=0)
    for a, b in zip(got_g, grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_training_attention_choice():
    kw = dict(head_dim=64, seq_len=4096)
    assert resolve_impl("auto", backend="cpu", compute_dtype="bfloat16", **kw) == "xla"
    assert resolve_impl("auto", backend="gpu", compute_dtype="bfloat16", **kw) == "cudnn"
    assert resolve_impl("auto", backend="gpu", compute_dtype="float32", **kw) == "pallas"
    assert resolve_impl("auto", backend="gpu", compute_dtype="float32", head_dim=64,
                        seq_len=100) == "xla"
    assert resolve_impl("pallas", backend="cpu", compute_dtype="float32", **kw) == "pallas"
    with pytest.raises(ValueError, match="model.attention_impl='cudnn'.*GPU"):
        resolve_impl("cudnn", backend="cpu", compute_dtype="bfloat16", **kw)
    assert "bf16" in unsupported("cudnn", backend="gpu", compute_dtype="float32", **kw)
    with pytest.raises(ConfigError, match="model.attention_impl"):
        load_config(None, ["model.attention_impl=flash"])
    # Segment ids given to the xla kernel build the dense mask themselves.
    q, k, v, seg, _ = _packed(1, 2, 64, 4, 2, 16)
    np.testing.assert_array_equal(train_attention(q, k, v, seg, "xla"),
                                  attend(q, k, v, packed_causal_mask(seg)))


def test_decoder_with_pallas_attention_equals_xla():
    """The whole model's logits with model.attention_impl=pallas equal those of xla (fp32,
    1e-5): segment ids, not the dense mask, reach the kernel through the blocks. (Gradients go
    through the kernel's own backward, checked above.)"""
    from flax import nnx

    from tiderl.models.policy import abstract_policy, init_policy

    base = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=64, qkv_bias=True)
    seg = jnp.asarray([[1] * 10 + [2] * 16 + [0] * 6, [1] * 20 + [2] * 12], jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, seg.shape), jnp.int32)
    pos = jnp.asarray([list(range(10)) + list(range(16)) + [0] * 6,
                       list(range(20)) + list(range(12))], jnp.int32)
    _, params = init_policy(base, seed=0)  # one init: the kernel choice is not a parameter
    logits = {}
    for impl in ("xla", "pallas"):
        graphdef, _ = abstract_policy(dataclasses.replace(base, attention_impl=impl))
        fwd = jax.jit(lambda p, g=graphdef: nnx.merge(g, p)(tokens, pos, seg)[0])
        logits[impl] = np.asarray(fwd(params))
    np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ bf16 serving weights
def test_serving_weights_are_bf16_and_change_nothing_the_engine_computes():
    from tiderl.models.policy import init_policy
    from tiderl.serving.engine import Engine
    from tiderl.serving.weights import serving_weights
    from tiderl.train.ref_actor import make_logprobs

    mcfg = ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=64, qkv_bias=True, qk_norm=True,
                       compute_dtype="bfloat16")
    graphdef, master = init_policy(mcfg, seed=0)
    served = serving_weights(master, mcfg)
    for m, s in zip(jax.tree.leaves(master), jax.tree.leaves(served), strict=True):
        assert m.dtype == jnp.float32
        assert s.dtype == (jnp.bfloat16 if m.ndim >= 2 else jnp.float32)  # norm scales stay
    assert serving_weights(master, dataclasses.replace(mcfg, compute_dtype="float32")) is master
    rc = RolloutConfig(page_size=4, num_pages=32, max_slots=2, max_context=32,
                       max_action_tokens=4, decode_buckets=(2,), prefill_buckets=(16,),
                       temperature=1.0)
    def engine(params):
        eng = Engine(graphdef, params, mcfg, rc, seed=3, keep_logits=True)
        state = eng.init_decode_state()
        hs = [eng.prefill(None, None, list(range(1 + i, 12 + i)), 11, task_id=i)
              for i in range(2)]
        return eng, state, hs

    eng_m, _, h_m = engine(master)
    eng_s, state, h_s = engine(served)
    assert [h.tokens for h in h_m] == [h.tokens for h in h_s]
    for (_, _, a), (_, _, b) in zip(eng_m.logits_log, eng_s.logits_log, strict=True):
        np.testing.assert_array_equal(a, b)  # identical values from half the weight bytes
    for h in h_s:
        state = eng_s.insert(h, state)
    while any(h.decoding for h in h_s):
        state, _ = eng_s.generate(None, state)
    # The bf16 engine's logprobs against the bf16 trainer's recompute from the fp32 master
    # weights: the same quantity, KV cached in bf16 vs recomputed (5e-2).
    toks = np.asarray(h_s[0].tokens, np.int32)[None]
    batch = {"tokens_bt": toks, "positions_bt": np.arange(toks.shape[1])[None].astype(np.int32),
             "segment_ids_bt": np.ones_like(toks)}
    trainer_lp = np.asarray(jax.jit(make_logprobs(graphdef, 1.0))(master, batch))[0]
    start = h_s[0].action_start
    np.testing.assert_allclose(h_s[0].logprobs, trainer_lp[start:], atol=5e-2, rtol=0)


# ------------------------------------------------------------------ the prepared GPU check
@pytest.mark.entry
def test_gpu_check_cpu_smoke_passes():
    """`benchmarks/gpu_check.py --cpu-smoke`: every part's code path at toy sizes on the CPU
    (decode and prefill through the engine with the Pallas kernel checked in interpret mode,
    the host KV tier's round trip, the trainer step and each training attention kernel,
    pinned_host swaps, and a 2-step launch of configs/gpu-1.yaml with rollout and training
    sharing one device)."""
    r = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": ROOT})
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["ok"], r.stdout[-4000:] + r.stderr[-2000:]
    assert set(out["parts"]) == {"decode+prefill toy", "train toy", "swap toy", "launch toy"}
    assert out["launch:toy:launch_steps"] == 2
    assert out["decode+prefill:toy:decode_kernel_err_b2"] <= 2e-2
    # The host KV tier's round trip: pinned_host entries (checked inside), restored logprobs.
    assert out["decode+prefill:toy:tier_restore_err"] <= 2e-2
    assert out["decode+prefill:toy:tier_out_gb_s"] > 0 and out["decode+prefill:toy:tier_in_gb_s"] > 0
    assert out["train:toy:attention_pallas_ms"] > 0
