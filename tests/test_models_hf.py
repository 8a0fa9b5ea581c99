"""HF parity, import/export round trip and checkpoint errors (tiny random models made here).

Families: Qwen2 (qkv bias), Llama 3 (with 'llama3' RoPE scaling), Qwen3 (q/k norm, head_dim ≠
d_model / n_heads). Tolerance: max |Δlogits| ≤ 1e-4 in fp32 against transformers' torch CPU
forward (whole-model fp32 tolerance), on one device and on a sharded fsdp×model mesh.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiderl.models.hf import (  # noqa: E402
    CheckpointMismatchError,
    from_pretrained,
    load_hf_config,
    save_pretrained,
)
from tiderl.models.policy import build_policy  # noqa: E402
from tiderl.models.sharding import make_mesh  # noqa: E402

# Llama 3.1-style scaling with a 16-token pre-training context, so that within 48 positions the
# low frequencies are divided by the factor and one band sits on the smoothing ramp (head_dim 16,
# theta 1e4: wavelengths 6.3 (ramp: between 16/4 and 16/1), 19.9, 62.8, ... (scaled)).
LLAMA3_ROPE = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=10000.0)
# The three families of the issue: vocab 300, d 64, 2 layers, GQA 4/2 heads.
FAMILIES = {
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                            tie_word_embeddings=True)),
    "llama3": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                            rope_theta=1e6, tie_word_embeddings=True)),
}
HF_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "llama": ("LlamaConfig", "LlamaForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}

CASES = {
    "qwen2_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                 tie_word_embeddings=True)),
    "qwen2_untied_mha": ("qwen2", dict(num_attention_heads=2, num_key_value_heads=2,
                                       rope_theta=1e6, tie_word_embeddings=False)),
    "llama_untied": ("llama", dict(num_attention_heads=8, num_key_value_heads=2,
                                   rope_theta=500000.0, tie_word_embeddings=False)),
    "llama_tied_mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1,
                                     rope_theta=10000.0, tie_word_embeddings=True)),
}


def make_hf(kind: str, extra: dict, path, seed: int, vocab: int = 97):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    conf_cls, model_cls = HF_CLASSES[kind]
    conf = getattr(transformers, conf_cls)(**common, **extra)
    model = getattr(transformers, model_cls)(conf)
    # Random biases and norm scales too, so every tensor's mapping is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, extra = CASES[case]
    hf_model = make_hf(kind, extra, tmp_path, seed=len(case))
    ours = from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, size=(3, 21))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(21), (3, 21))
    logits, _ = ours(jnp.asarray(tokens), jnp.asarray(positions), jnp.ones((3, 21), jnp.int32))
    err = float(np.max(np.abs(np.asarray(logits) - ref)))
    assert err <= 1e-4, f"{case}: max |Δlogits| = {err:.3g}"


def test_sharded_index_checkpoint_loads(tmp_path):
    hf_model = make_hf("qwen2", CASES["qwen2_untied_mha"][1], tmp_path / "one", seed=3)
    hf_model.save_pretrained(tmp_path / "sharded", safe_serialization=True,
                             max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = from_pretrained(tmp_path / "one")
    b = from_pretrained(tmp_path / "sharded")
    for x, y in zip(jax.tree.leaves(jax.tree.map(np.asarray, a)),
                    jax.tree.leaves(jax.tree.map(np.asarray, b)), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("qkv_bias,tied", [(True, False), (False, True)])
def test_export_import_round_trip_is_exact(tmp_path, qkv_bias, tied):
    from tiderl.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, mlp_dim=48, qkv_bias=qkv_bias, tie_embeddings=tied)
    model = build_policy(cfg, seed=7)
    save_pretrained(model, tmp_path)
    back = from_pretrained(tmp_path)
    from flax import nnx

    s1, s2 = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # And transformers reads our export as the same function.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    tokens = np.arange(12)[None] % 50
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours, _ = back(jnp.asarray(tokens), jnp.arange(12)[None], jnp.ones((1, 12), jnp.int32))
    assert float(np.max(np.abs(np.asarray(ours) - ref))) <= 1e-4


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf("llama", CASES["llama_untied"][1], tmp_path, seed=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors[
        "model.layers.0.self_attn.q_proj.weight"][:-1]
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError) as e:
        from_pretrained(tmp_path)
    msg = str(e.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.extra.weight" in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg


def test_unsupported_config_is_named(tmp_path):
    make_hf("llama", CASES["llama_untied"][1], tmp_path, seed=1)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="rope scaling"):
        load_hf_config(tmp_path)


def _torch_logits(hf_model, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


def _our_logits(model, tokens) -> np.ndarray:
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t), (b, t))
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.ones((b, t), jnp.int32))
    return np.asarray(logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_match_transformers(family, tmp_path):
    kind, extra = FAMILIES[family]
    hf_model = make_hf(kind, extra, tmp_path, seed=5, vocab=300)
    ours = from_pretrained(tmp_path, dtype="float32")
    cfg = ours.cfg
    assert cfg.qk_norm == (family == "qwen3") and cfg.qkv_bias == (family == "qwen2")
    assert cfg.rope_scaling == ("llama3" if family == "llama3" else "none")
    if family == "qwen3":
        assert cfg.head_dim == 24 != cfg.d_model // cfg.n_heads
    tokens = np.random.default_rng(1).integers(0, 300, size=(2, 48))
    ref = _torch_logits(hf_model, tokens)
    err = float(np.max(np.abs(_our_logits(ours, tokens) - ref)))
    assert err <= 1e-4, f"{family}: max |Δlogits| = {err:.3g}"


def test_llama3_scaling_changes_the_function(tmp_path):
    """The llama3 case is not vacuous: the same weights read without the scaling differ."""
    import dataclasses

    hf_model = make_hf("llama", FAMILIES["llama3"][1], tmp_path, seed=5, vocab=300)
    ours = from_pretrained(tmp_path)
    plain = build_policy(dataclasses.replace(ours.cfg, rope_scaling="none"))
    from flax import nnx

    nnx.update(plain, nnx.state(ours, nnx.Param))
    tokens = np.random.default_rng(1).integers(0, 300, size=(2, 48))
    ref = _torch_logits(hf_model, tokens)
    # Random-init logits are small (~0.3); unscaled RoPE misses by ~1e-2, 100× the tolerance.
    assert float(np.max(np.abs(_our_logits(plain, tokens) - ref))) > 1e-3


@pytest.mark.parametrize("family,fsdp,model", [("qwen2", 2, 2), ("llama3", 4, 2),
                                               ("qwen3", 2, 4)])
def test_sharded_load_places_params_and_matches(family, fsdp, model, tmp_path):
    from jax.sharding import PartitionSpec as P

    kind, extra = FAMILIES[family]
    hf_model = make_hf(kind, extra, tmp_path, seed=9, vocab=300)
    mesh = make_mesh(jax.devices()[: fsdp * model], fsdp=fsdp, model=model)
    ours = from_pretrained(tmp_path, mesh=mesh)
    attn = ours.layers[0].attn
    kv = "model" if 2 % model == 0 else None  # 2 kv heads over 4 model shards: replicated
    expect = {
        "embed_vd": (ours.embed_vd, P("model", "fsdp")),
        "wq_dhk": (attn.wq_dhk, P("fsdp", "model", None)),
        "wk_dkh": (attn.wk_dkh, P("fsdp", kv, None)),
        "wo_hkd": (attn.wo_hkd, P("model", None, "fsdp")),
        "w_down_fd": (ours.layers[1].mlp.w_down_fd, P("model", "fsdp")),
        "final_norm_d": (ours.final_norm_d, P(None)),
    }
    if family == "qwen3":
        expect["q_norm_dh"] = (attn.q_norm_dh, P(None))
    if family == "qwen2":
        expect["bq_hk"] = (attn.bq_hk, P("model", None))
    for name, (var, spec) in expect.items():
        arr = var[...]
        assert arr.sharding.mesh == mesh and arr.sharding.spec == spec, (name, arr.sharding)
        assert len(arr.sharding.device_set) == fsdp * model
    tokens = np.random.default_rng(2).integers(0, 300, size=(2, 32))
    ref = _torch_logits(hf_model, tokens)
    logits = jax.jit(lambda m, t: _our_logits_jit(m, t))(ours, jnp.asarray(tokens))
    err = float(np.max(np.abs(np.asarray(logits) - ref)))
    assert err <= 1e-4, f"{family} on fsdp={fsdp} model={model}: max |Δlogits| = {err:.3g}"


def _our_logits_jit(model, tokens_bt):
    b, t = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens_bt, positions, jnp.ones((b, t), jnp.int32))[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_export_loads_in_transformers(family, tmp_path):
    kind, extra = FAMILIES[family]
    hf_model = make_hf(kind, extra, tmp_path / "src", seed=4, vocab=300)
    ours = from_pretrained(tmp_path / "src")
    save_pretrained(ours, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    arch = {"qwen2": "Qwen2ForCausalLM", "llama3": "LlamaForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[family]
    assert conf["architectures"] == [arch] and conf["model_type"] == kind
    assert conf["torch_dtype"] == "float32" and conf["tie_word_embeddings"] == (family != "llama3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back).__name__ == arch
    if family == "llama3":
        assert back.config.rope_parameters["rope_type"] == "llama3"
        assert back.config.rope_parameters["original_max_position_embeddings"] == 16
    # Every tensor of the source comes back equal (q/k norms, biases, tied head included).
    src, out = hf_model.state_dict(), back.state_dict()
    assert sorted(src) == sorted(out)
    for k in src:
        torch.testing.assert_close(src[k], out[k], rtol=0, atol=0, msg=k)
    tokens = np.random.default_rng(3).integers(0, 300, size=(2, 40))
    err = float(np.max(np.abs(_torch_logits(back, tokens) - _our_logits(ours, tokens))))
    assert err <= 1e-4, f"{family}: max |Δlogits| = {err:.3g}"


@pytest.mark.parametrize("kind,change,key", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type='linear'"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "low_freq_factor"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen2", {"use_sliding_window": True}, "sliding-window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2", {"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
])
def test_unsupported_features_are_one_line_errors(tmp_path, kind, change, key):
    from tiderl.configlib import ConfigError

    make_hf(kind, {}, tmp_path, seed=1)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError) as e:
        load_hf_config(tmp_path)
    msg = str(e.value)
    assert key in msg and "model.checkpoint" in msg and "\n" not in msg, msg


def test_transformers4_style_llama3_config_loads(tmp_path):
    """Configs written by transformers 4 (Llama 3.2 on the Hub) carry rope_theta + rope_scaling
    with no original_max_position_embeddings fallback needed."""
    make_hf("llama", {}, tmp_path, seed=1)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.pop("rope_parameters", None)
    conf["rope_theta"] = 500000.0
    conf["rope_scaling"] = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = load_hf_config(tmp_path)
    assert cfg.llama3_rope == (32.0, 1.0, 4.0, 8192) and cfg.rope_theta == 500000.0


def test_launch_plan_loads_checkpoint_on_a_mesh(tmp_path):
    """`python -m tiderl.launch model.checkpoint=DIR` builds the sharded policy (it once failed
    with "'NamedSharding' object is not subscriptable")."""
    import subprocess
    import sys

    make_hf("qwen2", FAMILIES["qwen2"][1], tmp_path, seed=1, vocab=300)
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", "--plan", "--config",
                        "configs/tiny-8dev.yaml", f"model.checkpoint={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"{tmp_path}" in r.stdout and "actor: [2, 3, 4, 5]" in r.stdout


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_engine_cached_decode_matches_full_recompute(family, tmp_path):
    """q/k norm and llama3 RoPE on the serving path: greedy multi-turn decode from the paged KV
    cache equals the full-recompute forward at every position (fp32, logits 1e-4), past the
    16-token pre-training context of the llama3 scaling."""
    from flax import nnx

    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine

    kind, extra = FAMILIES[family]
    make_hf(kind, extra, tmp_path, seed=6, vocab=300)
    graphdef, params = nnx.split(from_pretrained(tmp_path))
    cfg = nnx.merge(graphdef, params).cfg
    rcfg = RolloutConfig(page_size=4, num_pages=32, max_slots=1, max_context=64,
                         max_action_tokens=5, decode_buckets=(1,), prefill_buckets=(8, 16),
                         temperature=0.0)
    eng = Engine(graphdef, params, cfg, rcfg, seed=1, keep_logits=True)
    state = eng.init_decode_state()
    rng = np.random.default_rng(0)
    h = None
    for n_obs in [13, 9]:
        obs = rng.integers(0, 300, n_obs)
        h = eng.prefill(None, h, obs, n_obs, task_id=1)
        state = eng.insert(h, state)
        while h.decoding:
            state, _ = eng.generate(None, state)
    tokens = np.asarray(h.tokens)[None]
    full = _our_logits(nnx.merge(graphdef, params), tokens)[0]
    rows = [(pos, lg) for tid, pos, lg in eng.logits_log if tid == 1]
    assert len(rows) == 10 and max(pos for pos, _ in rows) > 16
    for pos, lg in rows:
        np.testing.assert_allclose(lg, full[pos - 1], atol=1e-4, rtol=0)
        assert h.tokens[pos] == int(np.argmax(full[pos - 1]))
