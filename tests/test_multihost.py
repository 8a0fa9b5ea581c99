"""A job on two processes joined over loopback (4 fake CPU devices each, gloo collectives), as
it would run on two hosts: a rollout rank on each process (tensor-parallel over 2 devices), a
trainer whose data axis spans both (data=2 × fsdp=2), weights synced shard to shard, orbax
checkpoints written by both. Checked against the same job in one process on 8 devices.

Module fixtures run the one-process reference and the two-process run side by side, and (for
the slow test, in a thread beside them) a two-process run whose process 1 is killed mid-run,
then resumed on two processes. Every process runs in its own session and is killed on the way out, whatever
happens.

A third world runs beside them with elastic scaling on (`controller.ers=on`) and a scripted
role sequence (`controller.elastic.script`): a follower's rollout cell joins the trainer and
returns, then process 0's rollout cell joins it, so the trainer's data axis goes 2 → 3 → 2 → 3
cells across the process boundary and step 4's rollout runs only on process 1's rejoined ranks.
Its parameters are checked against the same one-process run, which never changes roles.

Tolerance: parameters after N steps within 1e-5 relative (fp32; max |Δ| over max |x| per
array). Measured: bit-identical for the fixed roles; the elastic run differs by float
reassociation only (another data width sums the gradient in another order): 2.1e-6 with
`trainer.adam_eps=1e-5`, which keeps Adam from amplifying it. With eps 1e-8 Adam turns the
reassociation noise of gradient entries that cancel to ~1e-9 into lr-sized steps (2.1e-4
measured; 8.6e-6 with 1e-6), on the same data: the groups, rewards and token counts of every
step were identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tiderl.runtime.localworld import LocalWorld

pytestmark = pytest.mark.entry

STEPS = 4
HEARTBEAT_S = 8
# async with max_staleness=0 is on-policy: each step trains the next groups of the stream on
# the weights that generated them, so the data order does not depend on timing and the
# two-process run can be compared with the one-process run number for number.
JOB = [
    "cluster.platform=cpu", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
    "model.head_dim=8", "controller.mode=async", "controller.max_staleness=0",
    f"controller.steps={STEPS}", "controller.groups_per_step=2",
    "controller.groups_per_microbatch=1", "controller.eval_every=0", "controller.console=false",
    "controller.checkpoint_every=1", "env.group_size=4", "trainer.zero_var_groups=keep",
    "rollout.ranks=2", "rollout.devices_per_rank=2", "trainer.actor_devices=4", "trainer.fsdp=2",
    "rollout.decode_buckets=[8]", "rollout.max_slots=8", "rollout.prefill_buckets=[64]",
    "rollout.prefill_batch=8", "rollout.num_pages=96", "trainer.rows_per_rank=1",
    f"distributed.heartbeat_timeout_s={HEARTBEAT_S}", "trainer.adam_eps=1e-5",
]
# Elastic scaling across the two processes: cells of 2 devices (trainer.fsdp=2), per process one
# rollout cell (two one-device ranks) and one trainer cell; cell ids 0 = process 0's rollout,
# 1 = process 1's rollout, 2 = process 0's trainer, 3 = process 1's trainer.
SCRIPT = {1: ("rollout", "trainer", "trainer", "trainer"),   # process 1's rollout cell joins
          2: ("rollout", "rollout", "trainer", "trainer"),   # ... and returns
          3: ("trainer", "rollout", "trainer", "trainer")}   # process 0's rollout cell joins
ERS = [x for x in JOB if not x.startswith(("rollout.ranks=", "rollout.devices_per_rank=",
                                           "controller.checkpoint_every="))] + [
    "rollout.ranks=4", "rollout.devices_per_rank=1", f"controller.checkpoint_every={STEPS}",
    "controller.ers=on",
    "controller.elastic.script=[" + ",".join(f'"{k}:{",".join(v)}"' for k, v in SCRIPT.items())
    + "]"]


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()
            and json.loads(x)["kind"] == "step"]


def meta(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def params(run: Path, step: int) -> dict[str, np.ndarray]:
    import jax

    from tiderl.export import load_run_params

    tree = load_run_params(run, step).params
    return {jax.tree_util.keystr(k): np.asarray(x)
            for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(a[k])), 1e-12)) for k in a)


def _saved(run: Path) -> list[int]:
    ck = run / "checkpoints"
    return sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit()) if ck.is_dir() else []


ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def background(base, request):
    """The kill + resume job, started in a thread before the reference runs when a selected
    test needs it: it mostly waits on its 1 s environment steps, so it runs beside them."""
    if not any("killed" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    box: dict = {}

    def work():
        try:
            box["out"] = _killed_job(base)
        except BaseException as e:  # re-raised by the `killed` fixture
            box["error"] = e

    thread = threading.Thread(target=work, name="killed-job", daemon=True)
    thread.start()
    yield thread, box
    thread.join(timeout=1800)


@pytest.fixture(scope="module")
def runs(base, background):
    """The one-process reference and the two-process run, side by side."""
    out: dict = {"one": base / "one", "two": base / "two"}
    with (base / "one.log").open("w") as log:
        one = subprocess.Popen([sys.executable, "-m", "tiderl.launch", f"run_dir={out['one']}",
                                "cluster.fake_cpu_devices=8", *JOB], stdout=log,
                               stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    # Process 1's rank gets its weights from process 0 (cross-process device_put); the killed
    # run below keeps the default (each process from its own trainer replica).
    two = LocalWorld(2, [f"run_dir={out['two']}", "cluster.fake_cpu_devices=4",
                         "distributed.weight_source=process0", *JOB], log_dir=base / "two-logs")
    out["ers"] = base / "ers"
    ers = LocalWorld(2, [f"run_dir={out['ers']}", "cluster.fake_cpu_devices=4", *ERS],
                     log_dir=base / "ers-logs")
    try:
        with two, ers:
            out["two_codes"] = two.wait(900)
            out["two_log1"] = two.log(1)
            out["ers_codes"] = ers.wait(900)
            out["ers_logs"] = ers.log(0)[-3000:] + ers.log(1)[-3000:]
        out["one_code"] = one.wait(900)
        out["one_log"] = (base / "one.log").read_text()
    finally:
        if one.poll() is None:
            os.killpg(one.pid, signal.SIGKILL)
            one.wait()
    return out


@pytest.fixture(scope="module")
def killed(background):
    """The kill + resume job's outcome (see `_killed_job`)."""
    thread, box = background
    thread.join(timeout=1800)
    assert not thread.is_alive(), "the kill + resume job did not end within 30 min"
    if "error" in box:
        raise box["error"]
    return box["out"]


def _killed_job(base: Path) -> dict:
    """A two-process run whose process 1 is killed mid-run, then resumed on two processes."""
    run = base / "killed"
    out: dict = {"run": run}
    # Slow episodes (1 s per env step) leave time to kill it between its checkpoints.
    w = LocalWorld(2, [f"run_dir={run}", "cluster.fake_cpu_devices=4",
                       "env.latency.dist=lognormal", "env.latency.median_s=1.0",
                       "env.latency.sigma=0.1", *JOB], log_dir=base / "killed-logs")
    with w:
        deadline = time.monotonic() + 900
        while not _saved(run):
            assert all(c is None for c in w.poll()), w.log(0)[-3000:]
            assert time.monotonic() < deadline, "the killed run saved no checkpoint"
            time.sleep(0.1)
        out["saved_before_kill"] = _saved(run)
        w.kill_process(1)
        t_kill = time.monotonic()
        while w.poll()[0] is None and time.monotonic() - t_kill < 120:
            time.sleep(0.05)
        out["stop_s"] = time.monotonic() - t_kill
        out["codes"] = w.poll()
        out["log0"] = w.log(0)
        summary = run / "summary.json"
        out["ended"] = json.loads(summary.read_text())["ended"] if summary.exists() else ""
    with LocalWorld(2, ["--resume", str(run), "env.latency.dist=none"],
                    log_dir=base / "resumed-logs") as r:
        out["resumed_codes"] = r.wait(900)
        out["resumed_log0"] = r.log(0)
    return out


def test_two_processes_train_exactly_what_one_process_trains(runs):
    jobs = runs
    assert jobs["one_code"] == 0, jobs["one_log"][-3000:]
    assert jobs["two_codes"] == [0, 0], jobs["two_log1"][-3000:]
    one, two = records(jobs["one"]), records(jobs["two"])
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["version"] for r in two] == [r["version"] for r in one]
    # The same groups each step.
    assert [sorted(r["group_ids"]) for r in two] == [sorted(r["group_ids"]) for r in one]
    diff = max_rel_diff(params(jobs["one"], STEPS), params(jobs["two"], STEPS))
    print(f"max relative parameter difference after {STEPS} steps: {diff:.3g}")
    assert diff <= 1e-5
    assert max_rel_diff(params(jobs["two"], STEPS - 1), params(jobs["two"], STEPS)) > 1e-4  # trained
    # Both processes served rollout turns, and rank 1 took its weights from process 0
    # (cross-process device_put) while rank 0 took them in-process.
    summary = json.loads((jobs["two"] / "summary.json").read_text())
    assert summary["processes"] == 2 and min(summary["rollout"]["turns_per_rank"]) > 0
    assert all(r["sync_cross_gbps"] > 0 and r["sync_local_gbps"] > 0 for r in two)
    # Both processes wrote their shards of every checkpoint (orbax multi-host save).
    assert {p.name for p in (jobs["two"] / "checkpoints" / str(STEPS) / "state").glob(
        "ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}


@pytest.mark.slow
def test_a_dead_process_stops_the_other_with_one_line_and_resume_continues_exactly(runs, killed):
    codes, log0 = killed["codes"], killed["log0"]
    assert codes[0] == 4 and codes[1] == -signal.SIGKILL, (codes, log0[-3000:])
    lines = [x for x in log0.splitlines() if x.startswith("tiderl: stopped:")]
    assert len(lines) == 1 and "process 1 of 2 died" in lines[0], log0[-3000:]
    assert "--resume" in lines[0]
    # Detected by missed heartbeats: within the configured timeout (plus the watchdog's poll
    # and a loaded machine's slack), never a hang.
    print(f"process 0 stopped {killed['stop_s']:.1f} s after process 1 was killed")
    assert killed["stop_s"] < HEARTBEAT_S + 6
    run = killed["run"]
    assert "stopped: process 1 of 2 died" in killed["ended"]  # the run folder says why
    assert killed["resumed_codes"] == [0, 0], killed["resumed_log0"][-3000:]
    resumed_from = json.loads((run / "resumes.jsonl").read_text())["from_step"]
    assert resumed_from >= killed["saved_before_kill"][-1] and resumed_from < STEPS
    # The resumed run ends where the uninterrupted one does: step, version, data position,
    # the groups of every step, the parameters.
    got, want = meta(run, STEPS), meta(runs["one"], STEPS)
    assert (got["step"], got["version"], got["data_state"]) == \
        (want["step"], want["version"], want["data_state"])
    assert [sorted(r["group_ids"]) for r in records(run)] == \
        [sorted(r["group_ids"]) for r in records(runs["one"])]
    # Parameters: a step packs its groups in stream order, not the finishing order that timing
    # decides after a resume, so the summation order is the same too.
    diff = max_rel_diff(params(runs["one"], STEPS), params(run, STEPS))
    print(f"max relative parameter difference, resumed vs uninterrupted: {diff:.3g}")
    assert diff <= 1e-5


def test_cells_move_across_processes_and_the_update_stays_exact(runs):
    assert runs["one_code"] == 0, runs["one_log"][-3000:]
    assert runs["ers_codes"] == [0, 0], runs["ers_logs"]
    run = runs["ers"]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if r["kind"] == "step"]
    changes = [r for r in recs if r["kind"] == "role_change"]
    one = records(runs["one"])
    # Every step trained the groups the fixed-role run trained (none lost, none twice), at the
    # same versions.
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [sorted(r["group_ids"]) for r in steps] == [sorted(r["group_ids"]) for r in one]
    assert [r["version"] for r in steps] == [r["version"] for r in one]
    summary = json.loads((run / "summary.json").read_text())
    assert not summary["dropped"] and not summary["failed_tasks"], summary
    ro = summary["rollout"]
    assert ro["tasks_live"] == 0 and ro["tasks_submitted"] == ro["tasks_ended"]
    # Every task ended done, except those of groups started after the last step (cancelled
    # when the run stopped).
    assert ro["end_reasons"]["done"] >= STEPS * 2 * 4  # steps × groups × group size
    assert set(ro["end_reasons"]) <= {"done", "cancelled"}, ro["end_reasons"]
    # The scripted changes, one record each with its costs, as on one process.
    assert [tuple(r["cells"][k] for k in ("rollout", "trainer")) for r in changes] == [
        (list(c for c, x in enumerate(v) if x == "rollout"),
         list(c for c, x in enumerate(v) if x == "trainer")) for v in SCRIPT.values()]
    assert [r["trainer_data"] for r in changes] == [3, 2, 3]
    for r in changes:
        assert r["rule"] == "scripted" and r["move_s"] >= 0 and r["drain_s"] >= 0
        assert r["change_s"] > 0 and "join_s" in r and "compiles_next_step" in r
    # Joining: one cell copied from its process's replica; returning to the first mesh: its
    # kernels were cached, and the follower's two ranks came back (4 ranks after change 2).
    assert [r["cells_copied"] for r in changes] == [1, 0, 1]
    assert changes[1]["kernels"] == "cached" and changes[1]["compiles_next_step"] == 0
    assert [r["trainer_cells"] for r in steps] == [3, 2, 3, 3]
    assert [r["rollout_ranks"] for r in steps] == [2, 4, 2, 2]
    # Step 4's groups were generated on process 1's rejoined ranks alone (cell 1), and it
    # trained on three cells, two of them on process 1.
    diff = max_rel_diff(params(runs["one"], STEPS), params(run, STEPS))
    print(f"elastic across processes: max relative parameter difference after {STEPS} steps "
          f"vs fixed roles {diff:.3g}; costs " + "; ".join(
              f"step {r['step']}: move {r['move_s']:.3f}s join {r['join_s']:.3f}s drain "
              f"{r['drain_s']:.3f}s kernels {r['kernels']}" for r in changes))
    assert diff <= 1e-5
