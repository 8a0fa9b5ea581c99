"""The pieces of a multi-host job that need no second process: where the world comes from
(flags, torchrun-style and SLURM variables), the per-host device plan and its cells, the wire
format of messages and rollout records, the Prometheus endpoint's bind address and token, and
the env server's default token off loopback."""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge

from tiderl.config import load_config
from tiderl.configlib import ConfigError
from tiderl.control.promserve import MetricsServer
from tiderl.envs.config import EnvConfig, with_default_token
from tiderl.runtime import wire
from tiderl.runtime.cells import Cell, RoleMap, host_plan, role_map
from tiderl.runtime.world import DistributedConfig, WorldSpec, resolve
from tiderl.serving.pages import Prefix, StopReason
from tiderl.serving.rank import Handoff, RankStats, TurnResult


def test_the_world_comes_from_flags_or_the_launcher():
    assert resolve(DistributedConfig(), {}) is None  # one process
    cfg = DistributedConfig(coordinator="10.0.0.1:8476", num_processes=2, process_id=1)
    assert resolve(cfg, {}) == WorldSpec("10.0.0.1:8476", 2, 1, "config")
    torchrun = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3"}
    spec = resolve(DistributedConfig(coordinator="auto"), torchrun)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("node0:29500", 4, 3)
    # Under SLURM (no torchrun variables) JAX's own detection fills in the rest at start-up.
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert resolve(DistributedConfig(coordinator="auto"), slurm).coordinator == ""
    # One of several SLURM tasks with no coordinator would run its own job: refused.
    with pytest.raises(ConfigError, match="SLURM_NTASKS=2.*--coordinator auto"):
        resolve(DistributedConfig(), slurm)
    with pytest.raises(ConfigError, match="distributed.num_processes"):
        resolve(DistributedConfig(coordinator="10.0.0.1:8476"), {})


@pytest.mark.parametrize("override,key", [
    ("distributed.coordinator=nohost", "distributed.coordinator"),
    ("distributed.heartbeat_timeout_s=0", "distributed.heartbeat_timeout_s"),
    ("distributed.weight_source=nearest", "distributed.weight_source"),
])
def test_bad_world_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override, "distributed.num_processes=2"])
    with pytest.raises(ConfigError, match="distributed.process_id"):
        load_config(None, ["distributed.num_processes=2", "distributed.process_id=2"])


def test_every_host_gets_the_same_layout_and_cells_stay_inside_a_process():
    plan = host_plan(n_processes=2, local_devices=4, ranks=2, devices_per_rank=2,
                     actor_devices=4, ref_devices=0, fsdp=2, model_parallel=1)
    assert plan.rollout == ((0, 1), (4, 5)) and plan.actor == (2, 3, 6, 7) and not plan.ref
    roles = role_map(plan, local_devices=4, fsdp=2, model_parallel=1)
    assert roles.rollout() == [Cell(0, (0, 1), "rollout", 0), Cell(1, (0, 1), "rollout", 1)]
    assert [c for c in roles.cells if c.role == "actor"] == [Cell(0, (2, 3), "actor", 0),
                                                             Cell(1, (2, 3), "actor", 1)]
    assert RoleMap.from_wire(wire.decode(wire.encode(roles.to_wire()))) == roles
    with pytest.raises(ConfigError, match="'rollout.ranks'=3 does not split over 2"):
        host_plan(n_processes=2, local_devices=4, ranks=3, devices_per_rank=1,
                  actor_devices=2, ref_devices=0, fsdp=1, model_parallel=1)
    with pytest.raises(ConfigError, match="trainer cell must sit inside one process"):
        host_plan(n_processes=2, local_devices=4, ranks=2, devices_per_rank=1,
                  actor_devices=4, ref_devices=0, fsdp=4, model_parallel=1)
    with pytest.raises(ConfigError, match="trainer.ref_devices"):
        host_plan(n_processes=2, local_devices=4, ranks=2, devices_per_rank=1,
                  actor_devices=2, ref_devices=2, fsdp=1, model_parallel=1)
    with pytest.raises(ConfigError, match="rollout.ranks"):  # a host's share does not fit
        host_plan(n_processes=2, local_devices=4, ranks=4, devices_per_rank=2,
                  actor_devices=2, ref_devices=0, fsdp=1, model_parallel=1)


def test_messages_and_rollout_records_cross_processes_exactly():
    msg = {"op": "group", "mbs": [{"tokens_bt": np.arange(12, dtype=np.int32).reshape(3, 4),
                                   "lp": np.float32([0.5, -1.25]), "uids": [3, 4]}],
           "n": np.int64(7), "nested": {"empty": np.zeros((0, 2), np.float32)}}
    back = wire.decode(wire.encode(msg))
    np.testing.assert_array_equal(back["mbs"][0]["tokens_bt"], msg["mbs"][0]["tokens_bt"])
    assert back["mbs"][0]["tokens_bt"].dtype == np.int32 and back["n"] == 7
    assert back["nested"]["empty"].shape == (0, 2) and back["mbs"][0]["uids"] == [3, 4]
    with pytest.raises(TypeError, match="no pickle"):
        wire.encode({"x": np.array([object()])})
    p = Prefix(task_id=9, tokens=[1, 2, 3, 4], logprobs=[-0.5], versions=[2], slot=None,
               kv_length=0, kv_version=2, action_start=3, stop_reason=StopReason.STOP_TOKEN)
    r = TurnResult([4], [-0.5], [2], StopReason.STOP_TOKEN, 3, 1, 2, rank=1)
    h = wire.handoff_from_wire(wire.decode(wire.encode(
        {"h": wire.handoff_to_wire(Handoff(p, [7, 8], r))}))["h"])
    # Prefix compares by identity (a live handle); compare its fields.
    assert dataclasses.asdict(h.prefix) == dataclasses.asdict(p)
    assert h.unfed == [7, 8] and h.result == r
    assert h.prefix.stop_reason is StopReason.STOP_TOKEN and h.prefix.action_tokens == [4]
    s = RankStats(turns=3, cached_tokens=5, busy_s=0.25)
    assert wire.stats_from_wire(wire.decode(wire.encode({"s": wire.stats_to_wire(s)}))["s"]) == s


def _get(url: str, token: str = "") -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            assert b"tiderl_x" in r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_prometheus_binds_where_told_and_needs_a_token_off_loopback():
    reg = CollectorRegistry()
    Gauge("tiderl_x", "x", registry=reg).set(1)
    local = MetricsServer(reg, "127.0.0.1", 0)
    try:
        assert local.token == "" and _get(f"http://127.0.0.1:{local.port}/metrics") == 200
    finally:
        local.close()
    exposed = MetricsServer(reg, "0.0.0.0", 0)  # no token given: one is generated
    try:
        url = f"http://127.0.0.1:{exposed.port}/metrics"
        assert len(exposed.token) >= 20
        assert _get(url) == 401 and _get(url, "wrong") == 401
        assert _get(url, exposed.token) == 200
    finally:
        exposed.close()


def test_an_exposed_env_server_gets_a_token():
    assert with_default_token(EnvConfig()) == (EnvConfig(), False)  # loopback: as configured
    cfg, made = with_default_token(EnvConfig(host="0.0.0.0"))
    assert made and len(cfg.token) >= 20
    assert with_default_token(EnvConfig(host="0.0.0.0", token="mine"))[0].token == "mine"
    # A remote server (env.url) is the user's: its token is theirs to set.
    assert with_default_token(EnvConfig(host="0.0.0.0", url="http://h:1"))[0].token == ""
