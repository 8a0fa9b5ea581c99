"""Decoder: packing, sharded init, optimizer-state shardings, one trace per train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tiderl.models.config import ModelConfig
from tiderl.models.policy import build_policy, init_policy
from tiderl.models.sharding import make_mesh, optimizer_shardings, state_shardings

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qkv_bias=True)


def test_packed_row_equals_separate_sequences():
    """Tolerance 1e-5 (fp32): a row packing three sequences vs each run alone."""
    model = build_policy(CFG, seed=1)
    rng = np.random.default_rng(0)
    lens = [5, 9, 4]
    seqs = [rng.integers(0, 64, size=n) for n in lens]
    pad = 3
    tokens = np.concatenate(seqs + [np.zeros(pad, np.int64)])[None]
    positions = np.concatenate([np.arange(n) for n in lens] + [np.zeros(pad, np.int64)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)]
                              + [np.zeros(pad, np.int64)])[None]
    packed, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    start = 0
    for s in seqs:
        alone, _ = model(jnp.asarray(s)[None], jnp.arange(len(s))[None],
                         jnp.ones((1, len(s)), jnp.int32))
        err = float(jnp.max(jnp.abs(packed[0, start:start + len(s)] - alone[0])))
        assert err <= 1e-5, err
        start += len(s)
    assert bool(jnp.all(jnp.isfinite(packed)))


def test_bf16_runs_and_is_close_to_fp32():
    m32 = build_policy(CFG, seed=2)
    m16 = build_policy(ModelConfig(**{**CFG.__dict__, "param_dtype": "bfloat16",
                                      "compute_dtype": "bfloat16"}), seed=2)
    t = jnp.arange(10)[None] % 64
    l32, _ = m32(t, jnp.arange(10)[None], jnp.ones((1, 10), jnp.int32))
    l16, _ = m16(t, jnp.arange(10)[None], jnp.ones((1, 10), jnp.int32))
    # bf16 compute, but the vocab head accumulates in and returns fp32 (logits feed fp32
    # softmaxes in sampling and training).
    assert l16.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(l16.astype(jnp.float32) - l32))) < 0.05


def _spec(x):
    return x.sharding.spec


def test_sharded_params_and_optimizer_moments_and_single_trace():
    devices = jax.devices()
    assert len(devices) == 8, "conftest must give 8 fake CPU devices"
    mesh = make_mesh(devices, data=2, fsdp=2, model=2)
    graphdef, params = init_policy(CFG, seed=0, mesh=mesh)
    layer = params["layers"][0]
    assert _spec(params["embed_vd"][...]) == PartitionSpec("model", "fsdp")
    assert _spec(layer["attn"]["wq_dhk"][...]) == PartitionSpec("fsdp", "model", None)
    assert _spec(layer["attn"]["wo_hkd"][...]) == PartitionSpec("model", None, "fsdp")
    assert _spec(layer["mlp"]["w_gate_df"][...]) == PartitionSpec("fsdp", "model")
    assert _spec(layer["mlp"]["w_down_fd"][...]) == PartitionSpec("model", "fsdp")
    assert _spec(layer["attn_norm_d"][...]) == PartitionSpec(None)

    tx = optax.adamw(1e-3)
    p_sh = state_shardings(params, mesh)
    o_sh = optimizer_shardings(tx, params, p_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    mu = opt_state[0].mu
    nu = opt_state[0].nu
    for tree in (mu, nu):
        assert _spec(tree["layers"][1]["mlp"]["w_up_df"][...]) == PartitionSpec("fsdp", "model")
        assert _spec(tree["embed_vd"][...]) == PartitionSpec("model", "fsdp")
    assert _spec(opt_state[0].count) == PartitionSpec()

    traces = []
    batch_sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))

    def loss_fn(p, tokens):
        model = nnx.merge(graphdef, p)
        b, t = tokens.shape
        logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                          jnp.ones((b, t), jnp.int32))
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    def step(p, o, tokens):
        traces.append(1)
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    step_jit = jax.jit(step, in_shardings=(p_sh, o_sh, batch_sh),
                       out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(4):
        tokens = jax.device_put(jnp.asarray(rng.integers(0, 64, (8, 16))), batch_sh)
        params, opt_state, loss = step_jit(params, opt_state, tokens)
        losses.append(float(loss))
    assert len(traces) == 1
    assert _spec(params["layers"][0]["attn"]["wq_dhk"][...]) == PartitionSpec(
        "fsdp", "model", None)
    assert _spec(opt_state[0].mu["layers"][0]["attn"]["wk_dkh"][...]) == PartitionSpec(
        "fsdp", "model", None)
    assert all(np.isfinite(losses))


def test_custom_policy_from_config():
    from tiderl.models.policy import policy_class

    cfg = ModelConfig(policy="examples.custom_policy:MiniTransformer", vocab_size=64, d_model=32)
    cls = policy_class(cfg)
    model = build_policy(cfg, seed=0)
    assert type(model) is cls
    t = jnp.arange(6)[None]
    logits, cache = model(t, jnp.arange(6)[None], jnp.ones((1, 6), jnp.int32))
    assert logits.shape == (1, 6, 64) and cache is None
    graphdef, params = init_policy(cfg, seed=0, mesh=make_mesh(jax.devices()[:2], data=2))
    assert nnx.merge(graphdef, params)(t, jnp.arange(6)[None], jnp.ones((1, 6), jnp.int32))[
        0].shape == (1, 6, 64)


def test_bad_policy_path_is_a_config_error():
    from tiderl.configlib import ConfigError
    from tiderl.models.policy import policy_class

    with pytest.raises(ConfigError, match="model.policy"):
        policy_class(ModelConfig(policy="no_such_module_xyz:Thing"))
