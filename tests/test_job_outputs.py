"""What a run leaves behind, in-process on fake CPU devices: every training curve in
metrics.jsonl and in the TensorBoard event files (read back with TensorBoard's own reader),
the W&B offline run folder, decoded sample trajectories at each evaluation, and the report's
plots and report.md."""

from __future__ import annotations

import asyncio
import json

import pytest

from tiderl.config import load_config
from tiderl.runtime.job import run_job

pytestmark = pytest.mark.entry

TINY = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
        "model.head_dim=8", "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
        "controller.console=false", "env.group_size=4", "env.eval_groups=3",
        "controller.checkpoint_every=0"]
CURVES = ["pg_loss", "kl", "entropy", "grad_norm", "clip_frac", "lr", "response_len_mean",
          "response_len_max", "traj_len_mean", "traj_len_max", "turns_mean", "turns_max",
          "staleness_mean", "staleness_max"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("wandb")
    run_dir = tmp_path_factory.mktemp("outputs") / "run"
    cfg = load_config(None, [*TINY, f"run_dir={run_dir}", "controller.steps=3",
                             "controller.eval_every=2", "controller.eval_samples=2",
                             "trainer.kl_coef=0.05", "trainer.lr_schedule=cosine",
                             "trainer.warmup_steps=1", "trainer.decay_steps=4",
                             "controller.loggers=[jsonl,tensorboard,wandb]"])
    summary = asyncio.run(run_job(cfg))
    assert summary["steps"] == 3
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, [r for r in steps if r["kind"] == "step"], summary


def test_every_curve_is_in_metrics_jsonl_and_the_lr_follows_the_schedule(run):
    cfg, _, steps, _ = run
    from tiderl.train.ref_actor import make_schedule

    for r in steps:
        missing = [k for k in CURVES if not isinstance(r.get(k), (int, float))]
        assert not missing, missing
        assert r["entropy"] > 0 and 0 <= r["clip_frac"] <= 1 and r["grad_norm"] > 0
        assert 1 <= r["response_len_mean"] <= r["response_len_max"]
        assert r["response_len_mean"] < r["traj_len_mean"] <= r["traj_len_max"]
        assert 1 <= r["turns_mean"] <= r["turns_max"] <= cfg.env.max_turns
    sched = make_schedule(cfg.trainer)  # warmup from 0, then cosine: update k uses sched(k)
    assert [r["lr"] for r in steps] == pytest.approx([float(sched(k)) for k in range(3)])
    assert steps[0]["lr"] == 0.0 and steps[1]["lr"] == pytest.approx(cfg.trainer.lr)
    # The first update (lr 0) leaves the policy at the reference: KL appears after the second.
    assert steps[0]["kl"] == steps[1]["kl"] == 0.0 < steps[2]["kl"]


def test_tensorboard_event_files_hold_every_curve(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, steps, _ = run
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    missing = [k for k in CURVES if f"train/{k}" not in tags]
    assert not missing, (missing, sorted(tags))
    for k in ("pg_loss", "lr", "entropy"):
        got = [(e.step, e.value) for e in ea.Scalars(f"train/{k}")]
        assert got == [(r["step"], pytest.approx(r[k], rel=1e-6, abs=1e-9)) for r in steps]
    assert "eval/eval_success" in tags
    assert "eval/samples/text_summary" in ea.Tags()["tensors"]


def test_wandb_offline_run_folder_holds_the_curves(run):
    _, run_dir, _, _ = run
    (files,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = files.read_bytes()
    # The offline log is W&B's record format; its history records carry the keys as text.
    assert data.startswith(b":W&B")
    for k in CURVES:
        assert f"train/{k}".encode() in data, k
    assert b"eval/samples" in data


def test_each_evaluation_writes_decoded_samples(run):
    _, run_dir, _, _ = run
    files = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert files == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]  # start, every 2, final
    rows = [json.loads(x) for x in (run_dir / "samples" / "step_2.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 2
    for s in rows:
        assert s["task_id"].endswith("@s2") and s["end_reason"] in ("done", "turn_limit")
        assert s["observations"][0] == "guess 1-8" and len(s["actions"]) == s["turns"] >= 1
        assert all(isinstance(a, str) and a for a in s["actions"])
        assert isinstance(s["reward"], float) and "target" in s["info"]


def test_report_draws_every_curve_and_writes_report_md(run):
    from tiderl.report import main

    _, run_dir, _, summary = run
    assert summary["report"] == str(run_dir / "report.md")
    assert main([str(run_dir)]) == 0
    for name in ("reward", "waits", "goodput", "loss", "entropy", "lengths", "optim",
                 "timeline"):
        path = run_dir / "plots" / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    md = (run_dir / "report.md").read_text()
    assert "| steps | 3 |" in md and "| ended | completed 3 of 3 steps |" in md
    assert "| entropy (last step) |" in md and "![loss](plots/loss.png)" in md
    assert "![timeline](plots/timeline.png)" in md and "samples/step_3.jsonl" in md
