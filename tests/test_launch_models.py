"""Bringing a model: the checkpoint defines the shape everywhere, the tokenizer must fit it, a
custom policy is checked against the contract, then served and trained; `model.init_from` starts
from another run's weights."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from tiderl.config import load_config
from tiderl.configlib import ConfigError

pytestmark = pytest.mark.entry

TINY = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
        "model.head_dim=8", "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
        "controller.eval_every=0", "controller.console=false", "env.group_size=4",
        "controller.checkpoint_every=1"]


def _qwen2_folder(path, *, vocab=512, tokenizer_vocab=None):
    """A tiny random Qwen2 saved by transformers, with a byte-level BPE tokenizer beside it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["user assistant system\n", "Guess a number from 1 to 8. higher lower correct"] * 20,
        trainers.BpeTrainer(vocab_size=tokenizer_vocab or 300,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path


def test_the_checkpoint_defines_the_shape_and_disagreeing_keys_are_one_line(tmp_path):
    ckpt = _qwen2_folder(tmp_path / "qwen")
    cfg = load_config(None, [f"model.checkpoint={ckpt}"])
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim,
            m.mlp_dim, m.max_seq_len, m.qkv_bias) == (512, 32, 2, 4, 2, 8, 64, 256, True)
    assert m.tokenizer == str(ckpt)  # the folder holds a tokenizer.json
    assert "d_model: 32" in cfg.to_yaml()
    # The run's own choices stay the run's.
    cfg = load_config(None, [f"model.checkpoint={ckpt}", "model.compute_dtype=bfloat16",
                             "model.tokenizer=byte"])
    assert cfg.model.compute_dtype == "bfloat16" and cfg.model.tokenizer == "byte"
    # A key that agrees is fine; one that disagrees names itself, the checkpoint and the fix.
    load_config(None, [f"model.checkpoint={ckpt}", "model.d_model=32"])
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.checkpoint={ckpt}", "model.n_layers=4"])
    msg = str(e.value)
    assert "'model.n_layers'" in msg and "the checkpoint has 2" in msg and "drop" in msg
    assert "\n" not in msg
    # The max_context check now sees the checkpoint's 256 positions, not the toy's 2048.
    with pytest.raises(ConfigError, match="model.max_seq_len=256"):
        load_config(None, [f"model.checkpoint={ckpt}", "rollout.max_context=512",
                           "trainer.row_len=512"])


def test_a_tokenizer_larger_than_the_embedding_is_rejected(tmp_path):
    from tiderl.launch import validate

    ckpt = _qwen2_folder(tmp_path / "qwen", vocab=280, tokenizer_vocab=300)
    with pytest.raises(ConfigError, match="model.vocab_size=280"):
        validate(load_config(None, [f"model.checkpoint={ckpt}"]))
    validate(load_config(None, [f"model.checkpoint={ckpt}", "model.tokenizer=byte"]))  # 272


class _NoCache:
    """Ignores the cache: the engine could never keep its KV."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens, positions, segment_ids, *, cache=None):
        logits, _ = self.inner(tokens, positions, segment_ids)
        return logits, cache


def test_policy_contract_is_checked_with_a_message_naming_the_policy():
    from flax import nnx

    from tiderl.models.config import ModelConfig
    from tiderl.models.decoder import Decoder
    from tiderl.models.policy import abstract_policy, check_contract

    cfg = ModelConfig(n_layers=1, d_model=32, mlp_dim=64, head_dim=8)
    graphdef, params = abstract_policy(cfg)
    check_contract(graphdef, params, cfg)

    class LogitsOnly(Decoder):
        def __call__(self, tokens, positions, segment_ids, *, cache=None):
            return super().__call__(tokens, positions, segment_ids, cache=cache)[0]

    class NoCache(Decoder):
        def __call__(self, tokens, positions, segment_ids, *, cache=None):
            return super().__call__(tokens, positions, segment_ids)[0], cache

    for cls, path, why in ((LogitsOnly, "training", "not (logits, cache)"),
                           (NoCache, "serving", "never called cache.attend")):
        named = dataclasses.replace(cfg, policy=f"tests:{cls.__name__}")
        graphdef, params = nnx.split(nnx.eval_shape(lambda c=cls: c(cfg, rngs=nnx.Rngs(0))))
        with pytest.raises(ConfigError) as e:
            check_contract(graphdef, params, named)
        msg = str(e.value)
        assert f"'model.policy'='tests:{cls.__name__}'" in msg and f"the {path} path" in msg
        assert why in msg and "cache.attend(layer, q, k, v)" in msg


def test_custom_policy_is_served_and_trained(tmp_path):
    """examples/custom_policy.py end to end: the engine serves it from the paged KV cache, the
    trainer updates it, and the checkpoint holds its weights."""
    from tiderl.runtime.job import run_job

    run = tmp_path / "run"
    cfg = load_config(None, [*TINY, f"run_dir={run}", "controller.steps=2",
                             "model.policy=examples.custom_policy:MiniTransformer",
                             "model.n_kv_heads=4"])
    summary = asyncio.run(run_job(cfg))
    assert summary["steps"] == 2 and summary["consumed_tokens"] > 0
    assert summary["rollout"]["tasks_ended"] > 0 and not summary["failed_tasks"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == "2"
    rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rec if r.get("kind") == "step"][-1] == 2


def test_init_from_starts_a_new_run_from_another_runs_weights(tmp_path):
    from tiderl.runtime.build import build
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.checkpoint import Checkpointer

    first = tmp_path / "first"
    from tiderl.launch import main

    assert main([*TINY, f"run_dir={first}", "controller.steps=2"]) == 0
    cfg = load_config(None, [f"model.init_from={first}:1", "cluster.fake_cpu_devices=8",
                             f"run_dir={tmp_path / 'second'}"])
    assert (cfg.model.d_model, cfg.model.n_layers) == (32, 1)  # the first run's shape
    with pytest.raises(ConfigError, match="'model.d_model'"):
        load_config(None, [f"model.init_from={first}", "model.d_model=64"])
    _, _, meshes, _, params = build(cfg)
    # The weights of step 1, as the first run's own checkpoint restores them.
    ref_cfg = load_config(str(first / "config.yaml"), [])
    backend = TrainerBackend(ref_cfg.trainer, ref_cfg.model, actor_mesh=meshes["actor"],
                             ref_mesh=None, temperature=1.0)
    ckpt = Checkpointer(first / "checkpoints")
    try:
        ckpt.restore(backend, step=1)
        want = backend.export_weights()
    finally:
        ckpt.close()
        backend.close()
    import jax

    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_vision_language_policy_trains_on_screenshots_through_launch(tmp_path):
    """configs/vlm-smoke.yaml (a tiny Qwen2.5-VL-layout policy from scratch, the gui suite):
    `python -m tiderl.launch` trains 2 steps and exits 0; every trajectory held screenshots
    as image tokens (60 per 320x200 screen, more than the text of a turn), the checkpoint
    holds the vision tower, and no action token is an image placeholder."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", "--config",
                        "configs/vlm-smoke.yaml", "controller.steps=2",
                        "controller.groups_per_step=2", "env.group_size=4",
                        "controller.checkpoint_every=2", f"run_dir={run_dir}"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["consumed_tokens"] > 0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert len(steps) == 2
    # Per turn: 60 image tokens + the observation's text; a text-only transcript of up to 4
    # turns would stay under ~400 tokens of text alone.
    assert all(s["traj_len_mean"] >= 60 * s["turns_mean"] for s in steps)
    from tiderl.export import load_run_params

    params = load_run_params(run_dir)
    assert params.model.vision is not None and params.model.vision.image_token_id == 262
