"""The docs' "your model" path (docs/how-to/your-model.md), as a user runs it: a Hugging Face folder written by
transformers (tiny random weights, a BPE tokenizer trained here, the family's real chat template)
→ `python -m tiderl.launch model.checkpoint=DIR` → `python -m tiderl.export RUN OUT` →
transformers loads the export and its logits equal tiderl's (fp32, ≤ 1e-4)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml
from test_envs_chat_templates import LLAMA32, llama, qwen3, qwen25

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.entry, pytest.mark.slow]

# The docs' CPU smoke preset as written (four steps, a checkpoint at step 4). A tiny random
# model never wins the default task, so every group's rewards are equal: keep those groups and
# let an entropy bonus and a large learning rate move the weights, so the export can be told
# from the source.
RUN = ["--config", "configs/cpu-smoke.yaml", "trainer.zero_var_groups=keep",
       "trainer.entropy_coef=0.01", "trainer.lr=1e-3"]
SHAPE = dict(vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _folder(path, family, **shape):
    torch.manual_seed(0)
    shape = {**SHAPE, **shape}
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **shape, tie_word_embeddings=True))
        qwen25(path)
    elif family == "llama3.2":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **shape, tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
        llama(path, LLAMA32)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **shape, head_dim=16, tie_word_embeddings=False))
        qwen3(path)
    model.save_pretrained(path)
    return model


def _start(module, *args):
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(procs, timeout=900):
    """Waits for every named process; one assertion naming each that failed, with its tail."""
    failed = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{name}: rc={proc.returncode}\n{out[-1500:]}{err[-3000:]}")
    assert not failed, "\n\n".join(failed)


FAMILIES = ("qwen2", "llama3.2", "qwen3")


@pytest.mark.timeout(1800)  # three launches in one test (side by side)
def test_train_a_checkpoint_and_export_it_back(tmp_path):
    """The preset is model-independent: the same command trains each family. The three
    families' launches (then their exports) run side by side, as separate processes: each is
    mostly single-threaded compilation, so together they use the cores one alone leaves idle."""
    import jax
    from flax import nnx

    from tiderl.export import load_run_params

    dirs = {f: (tmp_path / f / "ckpt", tmp_path / f / "run", tmp_path / f / "export")
            for f in FAMILIES}
    sources = {f: _folder(dirs[f][0], f) for f in FAMILIES}
    _wait({f: _start("tiderl.launch", f"model.checkpoint={ckpt}", f"run_dir={run}", *RUN)
           for f, (ckpt, run, _) in dirs.items()})
    _wait({f: _start("tiderl.export", str(run), str(out)) for f, (_, run, out) in dirs.items()})
    for family, (ckpt, run, out) in dirs.items():
        # The resolved config is the checkpoint's shape, with its tokenizer.
        model = yaml.safe_load((run / "config.yaml").read_text())["model"]
        assert (model["vocab_size"], model["d_model"], model["n_layers"], model["mlp_dim"]) == (
            640, 32, 2, 64), family
        assert model["tokenizer"] == str(ckpt)
        assert (model["head_dim"], model["qk_norm"]) == (
            (16, True) if family == "qwen3" else (8, False)), family
        assert model["rope_scaling"] == ("llama3" if family == "llama3.2" else "none")
        assert model["scan_layers"] is True  # the preset's stacked layout, from an HF folder
        assert (run / "checkpoints" / "4").is_dir(), family
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["consumed_tokens"] > 0, (family, summary)
        assert summary["rollout"]["tasks_ended"] > 0, family

        source = sources[family]
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf) is type(source)
        tokens = np.random.default_rng(0).integers(0, 640, (2, 80))
        with torch.no_grad():
            want = hf(torch.tensor(tokens)).logits.numpy()
            before = source.eval()(torch.tensor(tokens)).logits.numpy()
        loaded = load_run_params(run)
        policy = nnx.merge(loaded.graphdef, loaded.params)
        pos = np.broadcast_to(np.arange(80), (2, 80))
        got, _ = policy(jax.numpy.asarray(tokens), jax.numpy.asarray(pos),
                        np.ones((2, 80), np.int32))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=family)
        assert np.abs(want - before).max() > 1e-4, family  # the export holds trained weights
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert tok.chat_template and len(tok) <= 640, family


@pytest.mark.parametrize("preset,devices", [("cpu-smoke", 2), ("gpu-1", 1), ("gpu-8", 8)])
def test_presets_compose_with_a_checkpoint(tmp_path, preset, devices):
    """Real-model presets start from the components' defaults (not the toy run's), take the
    shape from the checkpoint, and lay out their devices."""
    from tiderl.config import CONFIG_DIR, RunConfig, load_config

    ckpt = tmp_path / "ckpt"
    _folder(ckpt, "qwen2", max_position_embeddings=32768)  # the GPU presets' 4,096 contexts
    cfg = load_config(str(CONFIG_DIR / f"{preset}.yaml"), [f"model.checkpoint={ckpt}"])
    assert cfg.model.d_model == 32 and cfg.model.tokenizer == str(ckpt)
    toy = RunConfig()
    assert cfg.rollout.max_action_tokens > toy.rollout.max_action_tokens
    assert cfg.trainer.head_chunk > 0 and cfg.trainer.remat
    plan = cfg.device_plan(devices)
    assert plan.rollout and plan.actor
