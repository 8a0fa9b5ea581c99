"""The entry point: runs on the embedded default and on a preset; bad input exits 2 in one line."""

import subprocess
import sys

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


def test_new_run_sets_the_previous_one_aside(tmp_path):
    """A fresh run in a folder holding a run moves that run to `<dir>.<k>`; nothing is lost."""
    from tiderl.job import set_aside_previous_run

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
