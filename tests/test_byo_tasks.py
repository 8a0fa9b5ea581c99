"""Bring your own tasks through the job: a jsonl task file, a reward function and an adapter
given as `package.module:Class` (the calculator example), trained by `python -m tiderl.launch`;
a run killed after step 2 resumes the dataset at the same position (mid-epoch, shuffled): the
groups each step trains equal an uninterrupted run's. A reward function that raises fails
only its task, with the message; the step trains on the rest."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiderl.config import load_config

pytestmark = [pytest.mark.entry, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent

REWARD = '''
from examples.calculator.reward import score


def score_or_raise(task, transcript):
    if task["id"] == "q3" and task["member"] == 0:
        raise ValueError("no verdict for q3/m0")
    return score(task, transcript)
'''

# configs/calculator.yaml, as docs/how-to/tasks-and-rewards.md runs it: 12 rows, 5 groups a step, so the checkpoint
# of step 2 sits at position 10 (mid-epoch) and step 3 crosses into epoch 1, which grain
# shuffles anew. Its sync mode trains exactly the groups of its own rollout, so the groups of
# each step are a function of the stream alone. Here the reward function is wrapped to raise
# for one task, and env latency slows the rollout so the kill lands between steps 2 and 3.
PRESET = ["--config", "configs/calculator.yaml"]
EXTRA = ["env.reward=byo_reward:score_or_raise", "env.latency.dist=lognormal",
         "env.latency.median_s=0.1"]
IN_PROCESS = ["cluster.fake_cpu_devices=8"]  # pytest's JAX already has 8 CPU devices


def steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "step"]


def test_task_file_reward_and_adapter_train_and_resume_at_the_same_position(
        tmp_path, monkeypatch, caplog):
    (tmp_path / "byo_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)  # the documented commands run from the repository root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    killed = tmp_path / "killed"
    # Run A: killed (SIGKILL) once the checkpoint of step 2 is complete.
    proc = subprocess.Popen([sys.executable, "-m", "tiderl.launch", *PRESET, *EXTRA,
                             f"run_dir={killed}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 480
    while not (killed / "checkpoints" / "2" / "meta").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode()
    assert not (killed / "checkpoints" / "3").exists(), "killed too late to test the resume"
    assert "raised ValueError: no verdict for q3/m0" in " ".join(out.split())  # its message

    # Run C, uninterrupted (in-process: the compiled kernels are shared with the resume).
    from tiderl.launch import main
    from tiderl.runtime.job import run_job

    whole = tmp_path / "whole"
    with caplog.at_level(logging.WARNING):
        summary = asyncio.run(run_job(load_config(PRESET[1], [*EXTRA, *IN_PROCESS,
                                                              f"run_dir={whole}"])))
    assert summary["ended"] == "completed 3 of 3 steps"
    # Then A resumed.
    assert main(["--resume", str(killed), *IN_PROCESS]) == 0

    a, c = steps(killed), steps(whole)
    assert [r["step"] for r in a] == [1, 2, 3] == [r["step"] for r in c]
    # The same groups each step.
    assert [sorted(r["group_ids"]) for r in a] == [sorted(r["group_ids"]) for r in c]
    ids = [g for r in c for g in r["group_ids"]]
    epoch0 = [g for g in ids if g.startswith("train/e0/")]
    assert sorted(epoch0) == sorted(f"train/e0/q{i}" for i in range(12))  # one whole epoch
    assert len(ids) == 15 and len([g for g in ids if g.startswith("train/e1/")]) == 3
    # ... shuffled: the first two steps are not the file's first ten rows.
    assert {g for r in c[:2] for g in r["group_ids"]} != {f"train/e0/q{i}" for i in range(10)}
    meta = json.loads((killed / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["data_state"]["next_index"] == 10 and meta["data_state"]["pending"] == []
    # q3's member 0 failed in its reward function; its group trained on the other member, and
    # every step trained all 5 groups.
    failed = [r["failed_tasks"].get("reward_error", 0) for r in c]
    assert sum(failed) >= 1 and all(r["groups"] == 5 for r in a + c)
    assert any("no verdict for q3/m0" in m for m in caplog.messages)


def test_single_turn_task_file_with_a_reward_function(tmp_path, monkeypatch):
    """The documented single-turn command: the same task file, no adapter (env.suite=), so each
    row's `prompt` is one completion scored by the reward function; no env server runs."""
    from tiderl.launch import main

    monkeypatch.chdir(ROOT)
    run = tmp_path / "rlvr"
    assert main([*PRESET, "env.suite=", f"run_dir={run}", *IN_PROCESS]) == 0
    recs = steps(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["groups"] == 5 for r in recs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollout"]["end_reasons"].get("done", 0) >= 30
    assert set(summary["rollout"]["end_reasons"]) <= {"done"}


def test_env_epochs_end_the_run_when_the_stream_runs_out(tmp_path, monkeypatch):
    """env.epochs=1 over 12 rows at 5 groups a step: steps of 5, 5 and the last 2 rows, then
    the run ends saying why (not an error)."""
    from tiderl.runtime.job import run_job

    monkeypatch.chdir(ROOT)
    cfg = load_config(PRESET[1], ["env.suite=", "env.epochs=1", "controller.steps=5",
                                  f"run_dir={tmp_path / 'epoch'}", *IN_PROCESS])
    summary = asyncio.run(run_job(cfg))
    recs = steps(tmp_path / "epoch")
    assert [r["groups"] for r in recs] == [5, 5, 2]
    assert summary["ended"] == "the task stream ended (env.epochs) after 3 of 5 steps"
    assert sorted(g for r in recs for g in r["group_ids"]) == sorted(
        f"train/e0/q{i}" for i in range(12))
