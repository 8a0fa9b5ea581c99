"""The control plane on virtual time against cost-model backends (no JAX), and the four modes."""

import asyncio
import json
import subprocess
import sys

import pytest

from tiderl.control.config import ControllerConfig


def test_controller_runs_on_virtual_time_without_jax():
    r = subprocess.run([sys.executable, "-m", "tiderl.sim.run"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["jax_loaded"] is False
    assert out["steps"] == 5 and out["trainer_steps"] == 5
    # Virtual seconds: each env step costs 2 s of loop time, so the run spans many of them.
    assert out["wall_s"] >= 10.0
    assert out["consumed_tokens"] > 0 and 0.0 < out["kv_hit_rate"] < 1.0


def run_mode(mode: str, tmp_path) -> dict:
    import looptime

    from tiderl.sim.run import simulate

    cfg = ControllerConfig(mode=mode, steps=3, groups_per_step=3, groups_per_microbatch=1,
                           eval_every=0, console=False, checkpoint_every=0,
                           min_ok_per_group=1, max_staleness=1)
    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(simulate(cfg, run_dir=str(tmp_path / mode)))
    finally:
        loop.close()
        asyncio.set_event_loop(None)


@pytest.mark.parametrize("mode", ["sync", "async", "stream", "tiderl"])
def test_four_modes_run_the_same_job(mode, tmp_path):
    out = run_mode(mode, tmp_path)
    steps = [r for r in out["records"] if r["kind"] == "step"]
    assert len(steps) == 3 and out["trainer_steps"] == 3
    assert all(r["groups"] >= 1 for r in steps)
    last = steps[-1]
    # Each step reports its engines' busy share and where its tasks were (means over it).
    assert 0.0 <= last["engine_busy"] <= 1.0
    assert last["tasks_executing"] >= 0.0 and last["tasks_waiting"] >= 0.0
    assert last["tasks_executing"] + last["tasks_ready"] + last["tasks_waiting"] > 0.0
    # Goodput is consumed tokens over wall time, by definition, in every mode.
    assert last["goodput"] == pytest.approx(last["consumed_tokens"] / last["wall_s"])
    if mode == "sync":
        # The global barrier: each step's rollout ends before its training starts, and the
        # next rollout starts only after the previous training (and sync) ended.
        prev_end = 0.0
        for r in steps:
            assert prev_end <= r["t_rollout_start"] <= r["t_rollout_end"] <= r["t_train_start"]
            prev_end = r["t_train_end"]
        assert sum(r["staleness_mean"] for r in steps) == 0


def test_run_stops_with_a_clear_error_when_every_rollout_rank_fails(tmp_path):
    import looptime

    from tiderl.serving.rollout import RolloutFailedError
    from tiderl.sim.fakes import SimEngine
    from tiderl.sim.run import simulate

    class Broken(SimEngine):
        def prefill_many(self, *a, **k):
            raise RuntimeError("injected device failure")

    cfg = ControllerConfig(steps=2, groups_per_step=2, eval_every=0, console=False,
                           checkpoint_every=0)
    loop = looptime.new_event_loop(start=0.0)
    try:
        with pytest.raises(RolloutFailedError, match="every rollout rank failed"):
            loop.run_until_complete(simulate(cfg, run_dir=str(tmp_path), engine_cls=Broken))
    finally:
        loop.close()
        asyncio.set_event_loop(None)


def test_time_limit_ends_a_run_whose_groups_never_become_trainable(tmp_path, caplog):
    """Every group has zero reward variance and is dropped, so no step can form: the run says
    why (a warning naming the fix) and still ends at its time limit (virtual seconds) instead of
    waiting forever."""
    import dataclasses

    import looptime

    from tiderl.sim.fakes import SimGuessEnv
    from tiderl.sim.run import simulate

    class Flat(SimGuessEnv):
        async def end(self, session):
            return dataclasses.replace(await super().end(session), reward=0.0)

    cfg = ControllerConfig(steps=5, groups_per_step=2, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=0, time_limit_s=60.0)
    loop = looptime.new_event_loop(start=0.0)
    try:
        out = loop.run_until_complete(simulate(cfg, run_dir=str(tmp_path), env=Flat(step_s=2.0),
                                               zero_var="drop"))
        ended = loop.time()
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    assert out["trainer_steps"] == 0 and not [r for r in out["records"] if r["kind"] == "step"]
    assert 60.0 <= ended < 61.0
    warned = [r.getMessage() for r in caplog.records if "could not be trained" in r.getMessage()]
    assert warned and "zero_variance" in warned[0] and "zero_var_groups=keep" in warned[0]
    counts = [int(m.split("the last ")[1].split()[0]) for m in warned]
    assert counts[0] >= 16 and counts == sorted(counts) and len(counts) < 8  # doubling, not spam


def test_a_run_ended_by_its_time_limit_checkpoints_its_last_step(tmp_path):
    import looptime

    from tiderl.sim.run import simulate

    saved = []

    async def save(step, state):
        saved.append(step)

    cfg = ControllerConfig(steps=1000, groups_per_step=2, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=5, time_limit_s=60.0)
    loop = looptime.new_event_loop(start=0.0)
    try:
        out = loop.run_until_complete(simulate(
            cfg, run_dir=str(tmp_path), checkpoint=save))
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    n = out["trainer_steps"]
    assert 5 < n < 1000 and n % 5  # a run that ended between two periodic checkpoints
    assert saved == [*range(5, n, 5), n]


def test_a_long_run_keeps_its_bookkeeping_bounded(tmp_path):
    """Per-group and per-task tables hold only what is live; the metrics sink keeps a window."""
    import looptime

    from tiderl.sim.run import simulate

    cfg = ControllerConfig(steps=40, groups_per_step=2, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=0, min_ok_per_group=1)
    loop = looptime.new_event_loop(start=0.0)
    try:
        out = loop.run_until_complete(simulate(cfg, run_dir=str(tmp_path)))
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    c = out["controller"]
    assert c.started_groups > 80
    assert len(c.index_of) <= len(c.in_flight) + len(c.buffer.ready) <= 3 * cfg.groups_per_step
    assert len(c.manager.episodes) <= 4 * len(c.in_flight)  # 4 tasks per group
    assert not c.manager.sched.tasks or len(c.manager.sched.tasks) <= 4 * len(c.in_flight)
    assert out["summary"]["steps"] == 40 and len(c.metrics.records) <= 1000


def test_kernel_caches_are_bounded():
    from tiderl.serving.steps import make_step
    from tiderl.train import backend

    for k in range(1, 41):  # 40 sampling configs: jit objects only, nothing compiles
        make_step(None, kind="decode", impl="reference", interpret=True, top_k=k, top_p=1.0,
                  keep_logits=False)
    assert make_step.cache_info().currsize <= 32
    try:
        for k in range(20):
            backend._kernels(("test", k), lambda k=k: (k,))
        assert len(backend._KERNELS) <= backend.MAX_KERNEL_SETS
        assert backend._kernels(("test", 19), lambda: None) == (19,)  # the newest are kept
    finally:
        for k in range(20):
            backend._KERNELS.pop(("test", k), None)
