"""A real job with elastic scaling on fake CPU devices: the planner's role change runs through
the real engines, trainer and scheduler, is logged with its reason and cost, and drawn."""

from __future__ import annotations

import json

import pytest

from tiderl.config import load_config
from tiderl.configlib import ConfigError

pytestmark = pytest.mark.entry

TINY = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64",
        "model.head_dim=8", "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
        "controller.console=false", "env.group_size=4", "controller.checkpoint_every=0"]


def test_a_job_with_ers_changes_roles_logs_why_and_draws_the_timeline(tmp_path):
    from tiderl.launch import main

    run = tmp_path / "run"
    # A Ref cell with no KL term to compute: the planner gives it to rollout at once.
    assert main([*TINY, f"run_dir={run}", "controller.steps=3", "controller.ers=on",
                 "trainer.ref_devices=1", "trainer.kl_coef=0.0", "controller.eval_every=2",
                 "env.eval_groups=2"]) == 0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in recs if r["kind"] == "role_change"]
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == 3 and changes
    c = changes[0]
    assert c["step"] == 0 and c["rule"] == "cold_start" and "rollout" in c["reason"]
    assert c["moves"] == [{"cell": 2, "src": "ref", "dst": "rollout"}]
    assert c["before"]["ref"] == [2] and c["cells"]["rollout"] == [0, 2]
    assert c["ref_mode"] == "colocated" and c["kernels"] in ("built", "cached")
    for key in ("drain_s", "move_s", "join_s", "change_s", "compiles_change",
                "compiles_next_step"):
        assert isinstance(c[key], (int, float)) and c[key] >= 0, key
    for r in steps:  # two rollout ranks serve from step 1 on, the Ref shares the Actor's
        assert (r["rollout_cells"], r["trainer_cells"], r["ref_cells"]) == (2, 1, 0)
        assert r["rollout_ranks"] == 2 and r["mode"] == "colocated"
        assert r["ra2p_advice"] == "colocated" and "no Ref forward" in r["ra2p_reason"]
        assert "ras_next" in r and "hol_limit_s" in r and "tprm_ema_s" in r
    trained = [g for r in steps for g in r["group_ids"]]
    assert len(trained) == len(set(trained))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["role_changes"] == len(changes) and summary["rollout_cells"] == 2
    assert (run / "plots" / "roles.png").stat().st_size > 1000


@pytest.mark.parametrize("extra,key", [
    (["rollout.ranks=2", "trainer.fsdp=2", "trainer.actor_devices=2", "trainer.ref_devices=1"],
     "trainer.ref_devices"),
    (["controller.mode=sync"], "controller.ers"),
    (["trainer.mode=decoupled", "trainer.ref_devices=1"], "controller.ers"),
])
def test_ers_on_with_roles_that_cannot_move_is_a_config_error(extra, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*TINY, "controller.ers=on", *extra])
    load_config(None, [*TINY, "controller.ers=auto", *extra])  # auto just stays off


def test_compile_cache_respects_the_environment_and_is_off_with_several_processes(tmp_path):
    from tiderl.runtime.devices import ClusterConfig, compile_cache_dir

    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    run = str(tmp_path / "run")
    auto, off = ClusterConfig(compile_cache="auto"), ClusterConfig(compile_cache="off")
    assert compile_cache_dir(auto, run, environ=env) == str(tmp_path / "xdg/tiderl/jax")
    assert compile_cache_dir(ClusterConfig(compile_cache="run"), run,
                             environ=env) == f"{run}/compile_cache"
    # A harness's JAX_COMPILATION_CACHE_DIR wins over every setting but 'off'.
    mine = {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "suite")}
    for setting in ("auto", "run", str(tmp_path / "elsewhere")):
        assert compile_cache_dir(ClusterConfig(compile_cache=setting), run,
                                 environ=mine) == str(tmp_path / "suite")
    assert compile_cache_dir(off, run, environ=mine) is None
    # Several processes (asked for or found): off, whatever the setting or the environment.
    assert compile_cache_dir(auto, run, processes=2, environ=mine) is None
    assert compile_cache_dir(auto, run, processes=1, environ=env) is not None
