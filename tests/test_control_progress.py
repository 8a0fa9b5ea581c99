"""What a run shows while it goes, on virtual time (no JAX): the live rollout line, starvation
warnings and hard limits (groups dropped in a row, seconds without a trainable group), decoded
sample trajectories and the sinks' scalar tags."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tiderl.control.config import ControllerConfig
from tiderl.control.controller import StarvedStop
from tiderl.control.progress import format_line, quantiles
from tiderl.sim.fakes import SimGuessEnv


class Flat(SimGuessEnv):
    """The default task with every reward 0: every group has zero variance."""

    async def end(self, session):
        return dataclasses.replace(await super().end(session), reward=0.0)


def simulate(cfg, monkeypatch, **kw):
    """`tiderl.sim.run.simulate` on a virtual-time loop, recording every progress snapshot."""
    import looptime

    import tiderl.sim.run as sim
    from tiderl.control.metrics import MetricsSink

    seen: list[dict] = []

    class Recording(MetricsSink):
        def progress(self, snap, **kw):
            seen.append(snap)
            super().progress(snap, **kw)

    monkeypatch.setattr(sim, "MetricsSink", Recording)
    loop = looptime.new_event_loop(start=0.0)
    try:
        out = loop.run_until_complete(sim.simulate(cfg, **kw))
        return out, seen, loop.time()
    finally:
        loop.close()
        asyncio.set_event_loop(None)


def test_progress_line_shows_the_rollout_while_a_step_fills(monkeypatch, tmp_path):
    cfg = ControllerConfig(steps=2, groups_per_step=3, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=0, min_ok_per_group=1)
    out, seen, _ = simulate(cfg, monkeypatch, run_dir=str(tmp_path), zero_var="drop",
                            env=SimGuessEnv(step_s=2.0))
    first = [s for s in seen if s["step"] == 1]
    assert first[0]["episodes_live"] == 0 and first[0]["phase"] == "filling"
    # Before the first step is trained the line already counts finished episodes and drops.
    filling = [s for s in first if s["phase"] == "filling" and s["episodes_done"]]
    assert filling, first
    s = filling[-1]
    assert s["episodes_live"] > 0 and s["groups_needed"] == 3 and s["episodes_failed"] == 0
    assert set(s["tasks"]) == {"executing", "env", "paused", "queued"}  # from the scheduler
    assert sum(s["tasks"].values()) == s["episodes_live"]
    line = format_line(s)
    for part in ("filling", "episodes:", "running", "done", "failed", "groups:", "/3 ready",
                 "in flight", "KV", "tasks:", "exec"):
        assert part in line, line
    assert {x["phase"] for x in seen} >= {"filling", "training"}
    # The sink keeps the newest snapshot and mirrors it to the live Prometheus gauges.
    m = out["controller"].metrics
    assert m.last_progress is seen[-1]
    assert m.gauges["episodes_done"]._value.get() == seen[-1]["episodes_done"]


def test_format_line_names_drops_latency_and_the_managers_task_keys():
    snap = {"phase": "filling", "episodes_live": 40, "episodes_live_eval": 8,
            "episodes_done": 312, "episodes_failed": 2, "groups_ready": 19,
            "groups_needed": 16, "groups_in_flight": 9,
            "dropped": {"zero_variance": 21, "stale": 0, "failed_tasks": 1},
            "env_latency_s": {"step": quantiles([0.01, 0.02, 0.03, 0.5])},
            "kv_pages_in_use": 37, "kv_pages_total": 100,
            "tasks": {"executing": 8, "waiting": 32}, "engine_busy": 0.73}
    line = format_line(snap)
    assert "40 running (8 eval), 312 done, 2 failed" in line
    assert "groups: 16/16 ready (+3 ahead), 9 in flight" in line
    assert "dropped: 1 failed_tasks, 21 zero_variance" in line and "stale" not in line
    assert "env step p50 0.02s p95 0.50s" in line and "KV 37%" in line
    assert "tasks: 8 exec, 32 waiting" in line and "engines busy 73%" in line
    from tiderl.control.progress import engine_busy, task_states

    stats = {"tasks_executing": 3, "tasks_waiting": 5, "engine_busy": [0.5, 1.0]}
    assert task_states(None, stats) == {"executing": 3, "waiting": 5}
    assert engine_busy(stats) == 0.75 and engine_busy({}) is None
    assert quantiles([]) != quantiles([])  # nan: no calls yet


def test_groups_dropped_in_a_row_warn_then_stop_the_run_with_a_checkpoint(monkeypatch,
                                                                            tmp_path, caplog):
    saved = []

    async def save(step, state):
        saved.append(step)

    cfg = ControllerConfig(steps=5, groups_per_step=2, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=0, warn_dropped_in_a_row=4,
                           max_dropped_in_a_row=12, time_limit_s=600.0)
    with pytest.raises(StarvedStop) as e:
        simulate(cfg, monkeypatch, run_dir=str(tmp_path), env=Flat(step_s=2.0),
                 zero_var="drop", checkpoint=save)
    msg = str(e.value)
    assert "\n" not in msg and "12 groups in a row could not be trained" in msg
    assert "controller.max_dropped_in_a_row=12" in msg and "12 zero_variance" in msg
    assert "mean reward of the groups dropped in a row: 0.00" in msg
    assert saved == [0]  # stopped with a checkpoint, before any step
    assert e.value.summary["ended"].startswith("stopped at step 0: 12 groups in a row")
    warned = [r.getMessage() for r in caplog.records if "could not be trained" in r.getMessage()
              and r.levelname == "WARNING"]
    counts = [int(m.split("the last ")[1].split()[0]) for m in warned]
    assert counts == [4, 8], counts  # then doubling, until the hard limit
    assert "now 12" in warned[0] and "zero_var_groups=keep" in warned[0]


def test_seconds_without_a_trainable_group_warn_then_stop(monkeypatch, tmp_path, caplog,
                                                          rank_calls):
    """An env so slow that no group ends: the count never moves, the clock does."""
    closed = rank_calls("close")
    cfg = ControllerConfig(steps=5, groups_per_step=2, groups_per_microbatch=1, eval_every=0,
                           console=False, checkpoint_every=0, warn_starved_s=30.0,
                           max_starved_s=100.0)
    with pytest.raises(StarvedStop, match=r"no group became trainable in 100s \(controller"
                                          r"\.max_starved_s=100; dropped so far: none"):
        simulate(cfg, monkeypatch, run_dir=str(tmp_path), env=SimGuessEnv(step_s=1000.0))
    assert sorted(closed) == [0, 1]  # the stopped run leaves no rank running
    warned = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert [int(m.split("has waited ")[1].split("s")[0]) for m in warned] == [30, 60]
    assert "groups in flight" in warned[0] and "env latency" in warned[0]


def test_decoded_samples_split_observations_and_actions():
    from tiderl.control.samples import decode_trajectory, one_line, runs
    from tiderl.envs.protocol import EndReason
    from tiderl.envs.templates import Transcript, template_for
    from tiderl.models.tokenizer import ByteTokenizer
    from tiderl.serving.trajectory import Trajectory

    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    tr = Transcript.start(tmpl, "guess 1-8")
    tr.add_action(tok.encode("4") + sorted(tmpl.stop_ids)[:1])
    tr.add_observation("higher 5-8")
    tr.add_action(tok.encode("6"))
    traj = Trajectory(task_id="t0", group_id="g0", is_eval=True, tokens=list(tr.tokens),
                      loss_mask=list(tr.loss_mask), logprobs=[], versions=[], reward=1.0,
                      end_reason=EndReason.done, turns=2, info={"target": 6})
    s = decode_trajectory(traj, tok.decode)
    assert s["observations"] == ["guess 1-8", "higher 5-8"] and s["actions"] == ["4", "6"]
    assert s["reward"] == 1.0 and s["end_reason"] == "done" and s["info"] == {"target": 6}
    assert s["response_tokens"] == 3 and "<|im_start|>" in s["text"]
    assert one_line(s).startswith("t0 reward 1.00 (done, 2 turns): guess 1-8 » '4'")
    assert runs([0, 0, 1, 1, 0, 1]) == [(0, 2, 0), (2, 4, 1), (4, 5, 0), (5, 6, 1)]


def test_sink_scalars_flatten_records_by_kind():
    from tiderl.control.sinks import scalars

    rec = {"kind": "step", "step": 3, "pg_loss": -0.1, "skipped": False, "mode": "colocated",
           "dropped": {"zero_variance": 2}, "group_ids": ["a"], "kl": float("nan")}
    assert dict(scalars(rec)) == {"train/pg_loss": -0.1, "train/skipped": 0.0,
                                  "train/dropped/zero_variance": 2.0}
    assert dict(scalars({"kind": "eval", "step": 3, "eval_success": 0.5})) == {
        "eval/eval_success": 0.5}


def test_starvation_advice_asks_for_longer_actions_only_where_a_command_is_spelled():
    """A suite whose action is a command gets 'longer actions' when max_action_tokens is
    short; the gui cell form and TextWorld's chat form (a number is the action) do not."""
    from tiderl.config import RunConfig
    from tiderl.control.progress import starvation_advice

    def advice(suite, options, tokens=2):
        cfg = RunConfig()
        cfg = dataclasses.replace(
            cfg, env=dataclasses.replace(cfg.env, suite=suite, options=tuple(options)),
            rollout=dataclasses.replace(cfg.rollout, max_action_tokens=tokens))
        return starvation_advice(cfg)

    assert "longer actions" in advice("gui", ["width=320"])
    assert "longer actions" not in advice("gui", ["grid=2x2", "actions=cell"])
    assert "longer actions" in advice("textworld", [])
    assert "longer actions" not in advice("textworld", ["admissible=true", "format=chat"])
    assert "longer actions" not in advice("gui", ["width=320"], tokens=32)


def test_groups_dropped_because_every_sibling_solved_them_are_not_called_failures(caplog):
    """A run that has learned its tasks drops groups too (all siblings score 1.0): the warning
    says the policy solves them, and drops the run's advice for a policy that fails them."""
    from types import SimpleNamespace

    from tiderl.control.starvation import Starvation

    cfg = ControllerConfig(warn_dropped_in_a_row=3, max_dropped_in_a_row=0)
    group = [SimpleNamespace(reward=r, ok=True) for r in (1.0,) * 4]
    failed = [SimpleNamespace(reward=r, ok=True) for r in (0.1,) * 4]

    def warning(groups):
        caplog.clear()
        s = Starvation(cfg, advice="a pretrained policy: one trained from scratch rarely scores")
        for g in groups:
            s.group_ended(g, False, 1.0)
        s.check(now=2.0, step=7, in_a_row=len(groups), dropped={"zero_variance": len(groups)},
                in_flight=0, episodes=0, before_warning=lambda: None)
        (msg,) = [r.getMessage() for r in caplog.records if "could not be trained" in
                  r.getMessage()]
        return msg

    solved = warning([group] * 3)
    assert "3 of the 3 groups dropped in a row were solved by every sibling" in solved
    assert "rarely scores" not in solved and "dropped in a row: 1.00" in solved
    mixed = warning([group, failed, failed])
    assert "1 of the 3 groups" in mixed and "rarely scores" in mixed
    assert "solved by every sibling" not in warning([failed] * 3)
    s = Starvation(cfg)
    s.group_ended(group, False, 1.0)
    s.group_ended(group, True, 1.5)  # a trainable group ends the row
    assert (s.row_solved, s.row_dropped) == (0, 0)
