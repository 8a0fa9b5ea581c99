"""The job in-process on fake CPU devices: device work stays off the event loop's thread, and a
resumed run keeps its config and logs every step once."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest

from tiderl.config import load_config
from tiderl.job import run_job

pytestmark = pytest.mark.entry

TINY = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
        "model.head_dim=8", "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
        "controller.eval_every=0", "controller.console=false", "env.group_size=4",
        "controller.checkpoint_every=1"]


def test_checkpoints_and_weight_export_run_off_the_event_loop(tmp_path, monkeypatch):
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.checkpoint import Checkpointer

    seen: list[tuple[str, bool]] = []

    def spy(cls, name):
        orig = getattr(cls, name)

        def wrapper(self, *a, **k):
            # asyncio.run drives the loop on this (the main) thread.
            seen.append((name, threading.current_thread() is threading.main_thread()))
            return orig(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapper)

    for cls, name in ((Checkpointer, "save"), (TrainerBackend, "export_weights"),
                      (TrainerBackend, "swap")):
        spy(cls, name)
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path / 'run'}", "controller.steps=2"])
    summary = asyncio.run(run_job(cfg))
    assert {"save", "export_weights", "swap"} <= {n for n, _ in seen}
    assert not [n for n, on_loop in seen if on_loop], seen
    assert summary["steps"] == 2 and summary["ended"] == "completed 2 of 2 steps"


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_resume_keeps_the_config_and_logs_every_step_once(tmp_path):
    from tiderl.launch import main

    run = tmp_path / "run"
    assert main([*TINY, f"run_dir={run}", "controller.steps=3"]) == 0
    config = (run / "config.yaml").read_text()
    # As if killed after step 3 was logged but before its checkpoint was written.
    shutil.rmtree(run / "checkpoints" / "3")
    assert main(["--resume", str(run), "controller.steps=4"]) == 0
    steps = [r for r in records(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in records(run / "metrics.discarded.jsonl")] == [3]
    assert (run / "config.yaml").read_text() == config  # the run's own config, not the resume's
    (resume,) = records(run / "resumes.jsonl")
    assert resume["from_step"] == 2 and resume["overrides"] == ["controller.steps=4"]
