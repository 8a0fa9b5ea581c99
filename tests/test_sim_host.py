"""The host cost of an env call: measured in situ on this machine (`tiderl.sim.hostcost`) and
charged where the real job spends it, on its event loop and the shared host (no JAX)."""

import math
import shutil

import pytest


def _fast_job():
    from tiderl.config import load_config
    from tiderl.sim.calibrate import VALIDATION_OVERRIDES

    # No injected latency: the measurement then takes a fraction of a second.
    return load_config(None, [*VALIDATION_OVERRIDES, "env.latency.dist=none"])


def test_env_call_cpu_is_measured_positive_and_finite_here():
    from tiderl.sim.hostcost import env_call_cpu_s

    m = env_call_cpu_s(_fast_job(), groups=2, repeats=2)
    assert len(m["samples"]) == 2 and m["calls"] > 0
    # HTTP through the in-process server costs the loop more than calling the adapter: a
    # positive, finite number of seconds per call, well under a second.
    assert all(math.isfinite(x) and 0 < x < 0.1 for x in m["samples"])
    assert m["seconds"] in m["samples"] or m["seconds"] == sum(m["samples"]) / 2  # a median
    with pytest.raises(ValueError, match="repeats=0"):
        env_call_cpu_s(_fast_job(), groups=2, repeats=0)


def test_both_sides_play_the_same_episodes():
    """HTTP and in-process play the same groups to the same ends: the difference in loop CPU
    is the transport's, not different work."""
    import asyncio

    from tiderl.sim.hostcost import play

    cfg = _fast_job()
    out = {http: asyncio.run(play(cfg, http=http, groups=2)) for http in (True, False)}
    assert out[True][1] > 0 and out[False][1] == 0  # HTTP calls made, none in-process
    ends = {http: sorted((t.task_id, tuple(t.tokens), t.reward, t.turns) for t in o[2])
            for http, o in out.items()}
    assert len(ends[True]) == 2 * cfg.env.group_size
    assert ends[True] == ends[False]


def test_host_only_rewrites_the_env_call_and_keeps_the_fits(tmp_path):
    from tiderl.sim.costs import PROFILES, load_profile
    from tiderl.sim.hostcost import host_only

    path = tmp_path / "cpu-fitted.yaml"
    shutil.copy(PROFILES / "cpu-fitted.yaml", path)
    before = load_profile(path)
    env = host_only(path, _fast_job(), groups=2, repeats=1)
    after = load_profile(path)
    assert after.op("env_call").c0 == env["seconds"] > 0
    assert after.notes["env_call"]["seconds"] == env["seconds"]
    # and the same calls with the env served by a process of its own, both halves
    assert after.op("env_client").c0 == env["served"]["client_s"] > 0
    assert after.op("env_server").c0 == env["served"]["server_s"] > 0
    assert after.notes["env_served"]["server_s"] == env["served"]["server_s"]
    # a second re-measure keeps the one-call-alone figure the first moved into the note
    alone = after.notes["env_call"]["alone_ms"]
    again = host_only(path, _fast_job(), groups=2, repeats=1)
    assert load_profile(path).notes["env_call"]["alone_ms"] == alone == again["alone_ms"] > 0
    assert "in situ" in after.notes["env_call"]["measured_by"]
    for name in ("prefill", "decode", "actor_backward", "apply"):
        assert after.op(name) == before.op(name)
    assert after.host == before.host


def test_held_loop_time_is_not_counted_as_measured_cpu():
    """`VirtualLoop.hold` advances the clock after the iteration; the CPU meter measures only
    the callbacks' real time, so modelled and measured host work are not counted twice."""
    import asyncio

    from tiderl.sim.clock import CpuMeter, run_virtual

    async def go():
        loop = asyncio.get_running_loop()
        loop.hold(2.5)
        await asyncio.sleep(0)
        return loop.time()

    meter = CpuMeter()
    assert run_virtual(go(), meter=meter, charge_cpu=True) == pytest.approx(2.5, abs=0.05)
    assert meter.cpu_s < 0.5


def test_profiles_env_call_says_where_it_comes_from():
    """cpu-fitted's env call is the in-situ measurement; the GPU profiles charge none (their
    environments run on separate CPU machines, not on the trainer's or engine's host)."""
    from tiderl.sim.costs import SimCostModel, load_profile, model_shape

    cpu = load_profile("cpu-fitted")
    assert cpu.op("env_call").c0 == cpu.notes["env_call"]["seconds"] > 0
    for name in ("h100", "h200"):
        p = load_profile(name)
        assert SimCostModel(p, model_shape("qwen2.5-7b")).env_call() == 0.0
        assert "env_call" in p.notes.get("host_costs", "")


def test_cpu_meter_on_thread_time_ignores_time_the_thread_did_not_run():
    """validate's meter counts the loop thread's CPU: a callback descheduled (here: asleep)
    is not control-plane work, while the default wall-clock meter counts it."""
    import asyncio
    import time

    from tiderl.sim.clock import CpuMeter, run_virtual

    async def go():
        # the thread off the CPU, as when other processes take the cores
        time.sleep(0.05)  # noqa: ASYNC251
        await asyncio.sleep(0)  # the iteration's time is charged before the next one
        return asyncio.get_running_loop().time()

    wall, cpu = CpuMeter(), CpuMeter(clock=time.thread_time)
    assert run_virtual(go(), meter=wall, charge_cpu=True) >= 0.05
    assert wall.cpu_s >= 0.05
    assert run_virtual(go(), meter=cpu, charge_cpu=True) < 0.03
    assert cpu.cpu_s < 0.03


def test_a_served_env_records_the_actions_and_its_cpu_while_serving():
    """The validation job's env server in a process of its own: a real subprocess on a free
    loopback port, the actions its adapter received and its CPU time come back when it stops;
    a bad override is refused with the server's own message."""
    import asyncio
    import dataclasses

    from tiderl.envs.client import EnvClient
    from tiderl.sim.served import ServedEnv

    cfg = _fast_job().env
    with ServedEnv(["latency.dist=none"]) as srv:
        assert srv.url.startswith("http://127.0.0.1:")

        async def play():
            async with EnvClient(srv.url, dataclasses.replace(cfg, url=srv.url)) as env:
                st = await env.start({"task_id": "t7", "suite": "default", "target": 3})
                first = await env.step(st.session, "5")
                second = await env.step(st.session, "3")
                return st, first, second

        st, first, second = asyncio.run(play())
    assert "guess" in st.observation and not first.done and second.done
    assert srv.trace == {("t7", 0): "5", ("t7", 1): "3"}
    assert math.isfinite(srv.cpu_s) and 0 < srv.cpu_s < 5
    with pytest.raises(RuntimeError, match="unknown config key 'latency.nope'"):
        ServedEnv(["latency.nope=1"]).__enter__()


def test_env_served_cpu_is_measured_for_both_halves():
    from tiderl.sim.hostcost import env_served_cpu_s

    m = env_served_cpu_s(_fast_job(), groups=2, repeats=1)
    assert len(m["client_samples"]) == len(m["server_samples"]) == 1
    assert 0 < m["client_s"] < 0.1 and 0 < m["server_s"] < 0.1
    with pytest.raises(ValueError, match="repeats=0"):
        env_served_cpu_s(_fast_job(), groups=2, repeats=0)
