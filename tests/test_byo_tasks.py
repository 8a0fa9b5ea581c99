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

# 12 rows, 5 groups a step: the checkpoint of step 2 sits at position 10 (mid-epoch) and step 3
# crosses into epoch 1, which grain shuffles anew. sync mode trains exactly the groups of its
# own rollout, so the groups of each step are a function of the stream alone.
RUN = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
       "model.head_dim=8", "controller.mode=sync", "controller.groups_per_step=5",
       "controller.eval_every=0", "controller.console=false", "controller.checkpoint_every=1",
       "controller.min_ok_per_group=1", "controller.steps=3", "env.group_size=2",
       "env.suite=examples.calculator.adapter:Calculator",
       "env.tasks=examples/calculator/tasks.jsonl", "env.reward=byo_reward:score_or_raise",
       "env.max_turns=2", "env.latency.dist=lognormal", "env.latency.median_s=0.1",
       "rollout.max_action_tokens=8", "rollout.max_context=256", "trainer.row_len=256",
       "trainer.zero_var_groups=keep"]


def steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "step"]


def test_task_file_reward_and_adapter_train_and_resume_at_the_same_position(
        tmp_path, monkeypatch, caplog):
    (tmp_path / "byo_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)  # the README's commands run from the repository root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    killed = tmp_path / "killed"
    # Run A: killed (SIGKILL) once the checkpoint of step 2 is complete.
    proc = subprocess.Popen([sys.executable, "-m", "tiderl.launch", *RUN, f"run_dir={killed}"],
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
    from tiderl.job import run_job
    from tiderl.launch import main

    whole = tmp_path / "whole"
    with caplog.at_level(logging.WARNING):
        summary = asyncio.run(run_job(load_config(None, [*RUN, f"run_dir={whole}"])))
    assert summary["ended"] == "completed 3 of 3 steps"
    # Then A resumed.
    assert main(["--resume", str(killed)]) == 0

    a, c = steps(killed), steps(whole)
    assert [r["step"] for r in a] == [1, 2, 3] == [r["step"] for r in c]
    assert [r["group_ids"] for r in a] == [r["group_ids"] for r in c]
    ids = [g for r in c for g in r["group_ids"]]
    assert sorted(ids[:12]) == sorted(f"train/e0/q{i}" for i in range(12))  # one epoch, shuffled
    assert ids[:12] != [f"train/e0/q{i}" for i in range(12)]
    assert ids[12:] and all(g.startswith("train/e1/") for g in ids[12:])
    meta = json.loads(next((killed / "checkpoints" / "2" / "meta").rglob("*.json")
                           ).read_text())
    assert meta["data_state"]["next_index"] == 10 and meta["data_state"]["pending"] == []
    # q3's member 0 failed in its reward function; its group trained on the other member, and
    # every step trained all 5 groups.
    failed = [r["failed_tasks"].get("reward_error", 0) for r in c]
    assert sum(failed) >= 1 and all(r["groups"] == 5 for r in a + c)
    assert any("no verdict for q3/m0" in m for m in caplog.messages)
