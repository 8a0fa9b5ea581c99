"""The job in-process on fake CPU devices: device work stays off the event loop's thread, and a
resumed run keeps its config and logs every step once."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import threading

import pytest

from tiderl.config import load_config
from tiderl.runtime.job import run_job

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


def test_env_keys_reach_the_episode_runner_and_config_stop_tokens_add_to_the_template(
        tmp_path, monkeypatch):
    """env.max_turns is the episode runner's turn limit, every env.eval_groups group is
    evaluated, and rollout.stop_tokens reach the engines next to the template's stop id."""
    import tiderl.runtime.job as job

    seen: dict = {}

    class Stop(Exception):
        pass

    real_engine = job.Engine

    def engine(graphdef, params, model_cfg, rcfg, **kw):
        seen["stop_tokens"] = rcfg.stop_tokens
        return real_engine(graphdef, params, model_cfg, rcfg, **kw)

    def manager(*args, max_turns, **kw):
        seen["max_turns"] = max_turns

    def controller(cfg, *, eval_groups, **kw):
        seen["eval_groups"] = len(eval_groups)
        raise Stop  # enough: nothing of the run itself is needed

    monkeypatch.setattr(job, "Engine", engine)
    monkeypatch.setattr(job, "RolloutManager", manager)
    monkeypatch.setattr(job, "Controller", controller)
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path / 'run'}", "env.max_turns=3",
                             "env.eval_groups=70", "rollout.stop_tokens=[10]"])
    with pytest.raises(Stop):
        asyncio.run(run_job(cfg))
    # 260 is the byte template's <|im_end|>.
    assert seen == {"stop_tokens": (10, 260), "max_turns": 3, "eval_groups": 70}


def test_extra_stop_token_from_config_ends_actions():
    """Engine level: with the rollout config the job builds, a stop id given only in
    rollout.stop_tokens ends an action (StopReason.STOP_TOKEN), like the template's own."""
    import numpy as np

    from tiderl.envs.templates import template_for
    from tiderl.models.policy import init_policy
    from tiderl.models.tokenizer import ByteTokenizer
    from tiderl.runtime.parts import rollout_config_for
    from tiderl.serving.engine import Engine
    from tiderl.serving.pages import StopReason

    tmpl = template_for(ByteTokenizer())
    small = ["model.n_layers=1", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8",
             "rollout.temperature=0.0", "rollout.max_action_tokens=8", "rollout.max_slots=8",
             "rollout.decode_buckets=[8]", "rollout.prefill_buckets=[16]"]
    prompt = tmpl.prompt("guess 1-8")

    def act(extra):
        cfg = load_config(None, [*small, f"rollout.stop_tokens={extra}"])
        rcfg = rollout_config_for(cfg, tmpl)
        graphdef, params = init_policy(cfg.model, seed=0)
        eng = Engine(graphdef, params, cfg.model, rcfg, seed=0)
        state = eng.init_decode_state()
        h = eng.prefill(None, None, np.asarray(prompt), len(prompt), task_id=1)
        state = eng.insert(h, state)
        while h.decoding:
            state, _ = eng.generate(None, state)
        return rcfg, list(h.action_tokens), h.stop_reason

    rcfg, free, _ = act([])
    assert set(rcfg.stop_tokens) == tmpl.stop_ids
    candidates = [t for t in free if t not in tmpl.stop_ids]
    assert candidates, free
    extra = candidates[0]
    rcfg, stopped, reason = act([extra])
    assert set(rcfg.stop_tokens) == tmpl.stop_ids | {extra}  # the template's stay
    # Greedy, same weights: the same tokens up to the first `extra`, which now ends the action.
    first = free.index(extra)
    assert stopped == free[: first + 1] and reason == StopReason.STOP_TOKEN


# orbax leaves the reads of the other arrays behind when one fails (coroutines never awaited).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_from_an_unreadable_checkpoint_is_one_line(tmp_path, capsys):
    """--resume on a real checkpoint whose array files were damaged: exit 2 with one
    'tiderl.launch: error:' line naming the step folder and the fix, no traceback."""
    from tiderl.launch import main

    run = tmp_path / "run"
    assert main([*TINY, f"run_dir={run}", "controller.steps=1"]) == 0
    step_dir = run / "checkpoints" / "1"
    for f in next((step_dir / "state").glob("ocdbt.process_*")).rglob("*"):
        if f.is_file():
            f.write_bytes(b"not a checkpoint" * 8)
    capsys.readouterr()
    assert main(["--resume", str(run), "controller.steps=2"]) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("tiderl.launch: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"checkpoint {step_dir.absolute()} cannot be read" in errors[0]
    assert f"delete {step_dir.absolute()}" in errors[0]
    gc.collect()  # orbax's abandoned reads are collected here, under this test's filter
