"""The whole job through `python -m tiderl.launch`: SIGKILL + --resume, and an env server that
dies for a few seconds mid-run. Real processes, real checkpoints, a real env server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.entry, pytest.mark.slow]

SMALL = [
    "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
    "controller.eval_every=0", "controller.console=false", "env.group_size=4",
    "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8",
]


def launch(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "tiderl.launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            **kw)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting")


def test_sigkill_then_resume_continues_and_never_trains_a_group_twice(tmp_path):
    run = tmp_path / "run"
    p = launch(f"run_dir={run}", "controller.steps=12", "controller.checkpoint_every=2", *SMALL)
    try:
        ckpts = run / "checkpoints"
        wait_for(lambda: ckpts.is_dir() and any(d.name.isdigit() and int(d.name) >= 4
                                                for d in ckpts.iterdir()), 300, p)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    before = [r for r in records(run) if r["kind"] == "step"]
    saved = sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit())
    q = launch("--resume", str(run), "controller.steps=8")
    out, _ = q.communicate(timeout=600)
    assert q.returncode == 0, out[-3000:]
    resumed_from = json.loads((run / "resumes.jsonl").read_text())["from_step"]
    assert resumed_from in saved and resumed_from >= 4
    final = [r for r in records(run) if r["kind"] == "step"]
    # Steps logged after that checkpoint were set aside: each step appears once.
    assert [r["step"] for r in final] == list(range(1, 9)) and final[-1]["version"] == 8
    trained_before = {g for r in before if r["step"] <= resumed_from for g in r["group_ids"]}
    trained_after = {g for r in final if r["step"] > resumed_from for g in r["group_ids"]}
    assert trained_before and trained_after
    assert not trained_before & trained_after, "a group was trained twice across the resume"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "tiderl.envs", "serve", "--suite", "default",
                          "--port", str(port), "options=[format_bonus=0.1,hint=range]"],
                         stdout=subprocess.PIPE, text=True)
    assert "url=" in p.stdout.readline()
    return p


def test_env_server_outage_is_counted_and_the_run_continues(tmp_path):
    run = tmp_path / "run"
    port = free_port()
    server = serve(port)
    job = launch(f"run_dir={run}", "controller.steps=10", "controller.checkpoint_every=0",
                 f"env.url=http://127.0.0.1:{port}", "env.retries=1", "env.backoff_s=0.05",
                 "env.request_timeout_s=2", "env.call_deadline_s=3", *SMALL)
    try:
        wait_for(lambda: any(r.get("step", 0) >= 3 for r in records(run)), 300, job)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        time.sleep(4)
        server = serve(port)
        out, _ = job.communicate(timeout=600)
        assert job.returncode == 0, out[-3000:]
    finally:
        job.kill()
        server.kill()
    steps = [r for r in records(run) if r["kind"] == "step"]
    assert steps[-1]["step"] == 10
    failed = steps[-1]["failed_tasks"]
    assert sum(failed.values()) > 0 and set(failed) <= {"env_error", "timeout"}, failed
