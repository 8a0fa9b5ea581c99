"""HF parity, import/export round trip and checkpoint errors (tiny random models made here).

Tolerance: max |Δlogits| ≤ 1e-4 in fp32 against transformers' torch CPU forward (whole-model
fp32 tolerance).
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


def make_hf(kind: str, extra: dict, path, seed: int):
    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "qwen2":
        conf = transformers.Qwen2Config(**common, **extra)
        model = transformers.Qwen2ForCausalLM(conf)
    else:
        conf = transformers.LlamaConfig(**common, **extra)
        model = transformers.LlamaForCausalLM(conf)
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
