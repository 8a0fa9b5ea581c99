"""The entry point: runs on the embedded default and on a preset; bad input exits 2 in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.entry


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tiderl.launch", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_documents_flags():
    r = run("--help")
    assert r.returncode == 0
    assert "--config" in r.stdout and "key=value" in r.stdout


def test_preset_prints_plan_and_policy():
    r = run("--plan", "--config", "configs/tiny-8dev.yaml", "model.n_layers=1")
    assert r.returncode == 0, r.stderr
    assert "rollout rank 1: [1]" in r.stdout and "actor: [2, 3, 4, 5]" in r.stdout
    assert "ref:   [6, 7]" in r.stdout and "parameters" in r.stdout


@pytest.mark.parametrize("args,key", [
    (["trainer.lrr=1"], "trainer.lrr"),
    (["rollout.ranks=x"], "rollout.ranks"),
    (["--config", "configs/tiny-8dev.yaml", "rollout.ranks=5"], "rollout.ranks"),
])
def test_bad_config_is_one_line_error(args, key):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], r.stderr


def test_policy_without_gqa_is_rejected_before_any_work(tmp_path):
    """examples/custom_policy.py declares supports_gqa = False: n_kv_heads (2 by default) must
    equal n_heads (4), checked before the run folder or JAX is touched."""
    run_dir = tmp_path / "run"
    r = run("model.policy=examples.custom_policy:MiniTransformer", f"run_dir={run_dir}")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiderl.launch: error:"), r.stderr
    assert "'model.n_kv_heads'=2" in lines[0] and "model.n_kv_heads=4" in lines[0]
    assert not run_dir.exists()


def test_policy_gqa_declaration():
    from tiderl.configlib import ConfigError
    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import check_policy

    mini = "examples.custom_policy:MiniTransformer"
    with pytest.raises(ConfigError, match="supports_gqa"):
        check_policy(ModelConfig(policy=mini, n_heads=4, n_kv_heads=2))
    check_policy(ModelConfig(policy=mini, n_heads=4, n_kv_heads=4))
    check_policy(ModelConfig(policy="decoder", n_heads=4, n_kv_heads=2))  # the built-in has GQA


def _byte_level_hf_tokenizer(path):
    """A tokenizer.json whose ids are the bytes themselves: `template_for` picks the byte
    template for it, which has no system role."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {_byte_char(b): b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<bos>", "<|im_start|>", "<|im_end|>")])
    tok.save(str(path))
    return path


def _byte_char(b: int) -> str:
    """GPT-2's byte → printable character map (what ByteLevel pre-tokenization emits)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def test_system_prompt_needs_a_template_with_a_system_role(tmp_path):
    """model.tokenizer is a file, so the template is known only once it is read: launch's
    validation (before any work) rejects a system prompt the template cannot place."""
    from tiderl.config import load_config
    from tiderl.configlib import ConfigError
    from tiderl.launch import validate
    from tiderl.models.tokenizer import HFTokenizer

    path = _byte_level_hf_tokenizer(tmp_path / "tokenizer.json")
    assert HFTokenizer(path).encode("ab") == [97, 98]
    cfg = load_config(None, [f"model.tokenizer={path}", "controller.system_prompt=Play well."])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert "config key 'controller.system_prompt'" in msg and "'byte' turn template" in msg
    assert "controller.system_prompt=''" in msg and "\n" not in msg
    validate(load_config(None, [f"model.tokenizer={path}"]))  # no system prompt: fine


def test_new_run_sets_the_previous_one_aside(tmp_path):
    """A fresh run in a folder holding a run moves that run to `<dir>.<k>`; nothing is lost."""
    from tiderl.runtime.job import set_aside_previous_run

    run = tmp_path / "default"
    assert set_aside_previous_run(run) is None  # nothing there yet
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    assert set_aside_previous_run(run) is None  # a config alone is not a run
    (run / "metrics.jsonl").write_text('{"kind": "step"}\n')
    (run / "checkpoints" / "100").mkdir(parents=True)
    assert set_aside_previous_run(run) == tmp_path / "default.1" and not run.exists()
    run.mkdir()
    (run / "checkpoints").mkdir()
    assert set_aside_previous_run(run) == tmp_path / "default.2"
    assert (tmp_path / "default.1" / "metrics.jsonl").read_text() == '{"kind": "step"}\n'
    assert (tmp_path / "default.1" / "checkpoints" / "100").is_dir()


def test_messages_print_once_even_after_a_library_called_basic_config():
    """A library's module-level logging.warning() installs a plain stderr handler; launch's
    console handler replaces it instead of printing every message twice."""
    import logging

    from rich.logging import RichHandler

    from tiderl.control.logs import _PlainHandler
    from tiderl.launch import setup_logging

    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        for h in saved:
            root.removeHandler(h)
        logging.basicConfig()
        setup_logging()
        setup_logging()  # idempotent
        kinds = [type(h) for h in root.handlers]
        # Rich on a terminal, a plain unwrapped line otherwise (here: pytest captures stderr).
        assert kinds.count(RichHandler) + kinds.count(_PlainHandler) == 1
        assert logging.StreamHandler not in kinds
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)


def test_a_run_whose_groups_never_train_warns_then_stops_with_a_checkpoint(tmp_path):
    """The default task made unwinnable (target=0: no hidden number) with a hard limit: the
    console shows episodes finishing and groups dropped for zero variance, then the starvation
    warning, then one line saying why the run stopped; exit code 3, a checkpoint on disk."""
    run_dir = tmp_path / "run"
    r = run("env.options=[target=0]", "controller.warn_dropped_in_a_row=4",
            "controller.max_dropped_in_a_row=8", "controller.progress_every_s=0.5",
            "controller.eval_every=0", "controller.groups_per_step=2", "env.group_size=4",
            "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8",
            f"run_dir={run_dir}")
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    lines = out.splitlines()
    progress = [x for x in lines if " INFO filling · episodes: " in x]
    assert any(", 0 done" not in x and "zero_variance" in x for x in progress), out[-3000:]
    warned = [i for i, x in enumerate(lines) if "WARNING step 0: the last 4 groups" in x]
    stopped = [i for i, x in enumerate(lines) if x.startswith("tiderl.launch: stopped:")]
    assert warned and len(stopped) == 1 and warned[0] < stopped[0], out[-3000:]
    assert "8 groups in a row could not be trained" in lines[stopped[0]]
    assert "controller.max_dropped_in_a_row=8" in lines[stopped[0]]
    assert "Traceback" not in out
    assert (run_dir / "checkpoints" / "0").is_dir()
    assert "stopped at step 0" in json.loads((run_dir / "summary.json").read_text())["ended"]


def test_rejected_command_line_leaves_the_previous_run_in_place(tmp_path):
    """The README's two commands in order: the first leaves runs/default; a command line the
    device plan rejects (5 rollout ranks on 8 devices with 4 Actor and 2 Ref) then fails in one
    line and moves nothing."""
    root = Path(__file__).resolve().parent.parent
    previous = tmp_path / "runs" / "default"
    previous.mkdir(parents=True)
    (previous / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n')
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", "--config",
                        str(root / "configs" / "tiny-8dev.yaml"), "rollout.ranks=5"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.ranks" in lines[0], r.stderr
    assert (previous / "metrics.jsonl").is_file()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["default"]
