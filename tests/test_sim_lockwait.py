"""The engine's wait for the interpreter lock in the simulator (`SharedHost.lock_wait`), the
siblings' sampling cost (`ops.sample`), and the in-situ measurement behind them
(`tiderl.sim.lockwait`)."""

import asyncio
import threading
import time

import pytest

from tiderl.sim.clock import run_virtual
from tiderl.sim.host import LOCK_WINDOW_S, SharedHost


def _calls_beside_a_busy_loop(host, share, seconds=0.01, calls=30):
    """Device calls one after another while the loop is busy `share` of every 10 ms (held
    work, as env calls hold it); returns each call's time."""

    async def go():
        loop = asyncio.get_running_loop()
        done = False

        async def busy():
            while not done:
                loop.hold(0.01 * share)
                await asyncio.sleep(0)  # the held time passes first
                await asyncio.sleep(0.01 * (1 - share))

        bg = asyncio.ensure_future(busy())
        took = []
        for _ in range(calls):
            t0 = loop.time()
            await host.device_call(seconds)
            took.append(loop.time() - t0)
        done = True
        await bg
        return took

    return run_virtual(go())


@pytest.mark.parametrize("share", [0.25, 0.5, 0.8])
def test_a_device_call_waits_lock_wait_times_u_over_1_minus_u(share):
    host = SharedHost(capacity=2.0, lock_wait_s=0.002)
    took = _calls_beside_a_busy_loop(host, share)
    # u is measured over the device calls' marks of the last LOCK_WINDOW_S (0.1 s) of the
    # loop's clock, which sees whole 10 ms busy periods: the share within a period's width
    expected = 0.002 * share / (1 - share)
    assert host.lock_waited_s / len(took) == pytest.approx(expected, rel=0.35)
    plain = _calls_beside_a_busy_loop(SharedHost(capacity=2.0), share)
    assert sum(took) > sum(plain) + 0.5 * expected * len(took)  # the calls took longer
    assert LOCK_WINDOW_S == 0.1


def test_no_lock_wait_when_not_modelled_or_the_loop_is_idle():
    host = SharedHost(capacity=2.0)
    _calls_beside_a_busy_loop(host, 0.8, calls=5)
    assert host.lock_waited_s == 0.0

    async def idle():
        host = SharedHost(capacity=2.0, lock_wait_s=0.002)
        for _ in range(5):
            await host.device_call(0.01)
        return host.lock_waited_s

    assert run_virtual(idle()) == 0.0

    async def plain_loop():  # a loop with no busy-time record: nothing to wait behind
        host = SharedHost(capacity=1.0, lock_wait_s=0.002)
        await host.device_call(0.0)
        await host.device_call(0.0)
        return host.lock_waited_s

    assert asyncio.run(plain_loop()) == 0.0


def test_a_saturated_loop_caps_the_wait():
    host = SharedHost(capacity=2.0, lock_wait_s=0.002)
    _calls_beside_a_busy_loop(host, 0.999, calls=12)
    assert host.lock_waited_s <= 12 * 0.002 * 0.95 / 0.05 + 1e-9  # u capped at 0.95
    assert host.lock_waited_s > 6 * 0.002 * 0.95 / 0.05


def test_the_virtual_loop_counts_its_busy_time():
    from tiderl.sim.clock import CpuMeter

    async def go():
        loop = asyncio.get_running_loop()
        loop.hold(0.003)
        await asyncio.sleep(0)
        await asyncio.sleep(0.5)  # idle: not busy
        loop.hold(0.002)
        await asyncio.sleep(0)
        return loop.busy_s

    assert run_virtual(go()) == pytest.approx(0.005, abs=1e-9)
    meter = CpuMeter()
    busy = run_virtual(go(), charge_cpu=True, meter=meter)
    # charged callbacks count too (whole microsecond ticks of the measured time)
    assert 0.005 <= busy <= 0.005 + meter.cpu_s + 1e-9


def test_trainer_phases_and_weight_syncs_wait_for_the_lock_too():
    """SimTrainer's phases on a host with a lock wait take longer beside a busy loop."""
    from tiderl.sim.costs import SimCostModel, load_profile, model_shape
    from tiderl.sim.trainer import SimTrainer

    costs = SimCostModel(load_profile("cpu-fitted"), model_shape("tiny"))

    def phase_time(lock_wait_s):
        host = SharedHost(capacity=2.0, lock_wait_s=lock_wait_s)
        trainer = SimTrainer(costs, actor_gpus=1, ref_gpus=0, host=host)

        async def go():
            loop = asyncio.get_running_loop()
            done = False

            async def busy():
                while not done:
                    loop.hold(0.008)
                    await asyncio.sleep(0)
                    await asyncio.sleep(0.002)

            bg = asyncio.ensure_future(busy())
            t0 = loop.time()
            for _ in range(5):
                await trainer._sleep("actor_fwd", 0.01)
            done = True
            await bg
            return loop.time() - t0

        return run_virtual(go())

    plain = phase_time(0.0)  # 5 x 10 ms, plus the held loop's delays to each wake-up
    assert plain < 0.05 + 5 * 0.008 + 1e-9
    # the loop busy 80%: each phase waits about 0.002 * 0.8 / 0.2 = 8 ms more
    assert phase_time(0.002) > plain + 5 * 0.004


# -- the siblings' sampling cost ----------------------------------------------------------------
def test_sample_cost_by_profile():
    from tiderl.sim.costs import OpCost, SimCostModel, load_profile, model_shape

    tiny = model_shape("tiny")
    cpu = SimCostModel(load_profile("cpu-fitted"), tiny)
    op = cpu.profile.op("sample")
    assert cpu.sample(0) == 0.0
    assert cpu.sample(3) == pytest.approx(op.c0 + 3 * tiny.vocab * 4 / op.rate("hbm"))
    assert cpu.sample(7) > cpu.sample(3) > 0
    for gpu in ("h100", "h200"):  # sampled with the step's rows: no cost of its own
        assert SimCostModel(load_profile(gpu), model_shape("qwen2.5-7b")).sample(64) == 0.0
    bare = SimCostModel(load_profile("cpu-fitted"), tiny)
    bare._ops.pop("sample")  # a fitted profile from before the op: charges nothing
    assert bare.sample(5) == 0.0
    assert isinstance(op, OpCost)


def test_the_simulated_engine_charges_followers_sampling():
    """A group's first prefill: one row computes, its siblings sample from its logits; the
    call costs the prefill of one row plus the sampling of the rest."""
    from tiderl.serving.pages import PrefillRequest
    from tiderl.sim.costs import SimCostModel, load_profile, model_shape
    from tiderl.sim.virtual_engine import SimEngine

    costs = SimCostModel(load_profile("cpu-fitted"), model_shape("tiny"))
    eng = SimEngine(seed=0, max_action_tokens=4, max_context=128, stop_tokens=(0,),
                    costs=costs, num_pages=64, page_size=16, max_slots=16)
    prompt = list(range(5, 29))
    eng.prefill_many(None, [PrefillRequest(None, prompt, len(prompt), task_id=k, share=[])
                            for k in range(4)])
    assert eng.take_cost_s() == pytest.approx(costs.prefill([(0, len(prompt))])
                                              + costs.sample(3))
    assert eng.counters.shared_samples == 3


def test_fit_rows_recovers_a_line():
    from tiderl.sim.calibrate import fit_rows

    cost, mape = fit_rows([(n, 0.0005 + n * 0.0004) for n in (1, 3, 7, 15)], 1088.0)
    assert cost.c0 == pytest.approx(0.0005, rel=1e-6)
    assert cost(hbm=5 * 1088.0) == pytest.approx(0.0005 + 5 * 0.0004, rel=1e-6)
    assert mape == pytest.approx(0.0, abs=1e-9)


# -- the in-situ measurement ----------------------------------------------------------------------
def test_loop_cpu_sampler_tells_a_busy_thread_from_an_idle_one():
    from tiderl.sim.lockwait import LoopCpu

    def share(busy):
        with LoopCpu(threading.get_ident(), every_s=0.01) as cpu:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.3:
                if not busy:
                    time.sleep(0.01)
        return cpu.share(0.3)

    idle, busy = share(False), share(True)
    assert 0.0 <= idle < busy <= 1.05


def test_recorded_engine_calls_replay_alone_on_the_same_engine():
    """`lockwait` records the engine's prefill device calls with their inputs and replays
    them alone on the same engine (the real engine, compiled JAX)."""
    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import init_policy
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine
    from tiderl.serving.pages import PrefillRequest
    from tiderl.sim.lockwait import recorded_calls, replay

    model = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=8, mlp_dim=32)
    graphdef, params = init_policy(model, seed=0)
    eng = Engine(graphdef, params, model, RolloutConfig(
        page_size=4, num_pages=32, max_slots=4, max_context=32, max_action_tokens=2,
        decode_buckets=(4,), prefill_buckets=(8,)), seed=1)
    eng.init_decode_state()
    with recorded_calls() as calls:
        hs = eng.prefill_many(None, [PrefillRequest(None, [5, 6, 7, 8], 4, task_id=k)
                                     for k in range(3)])
    assert len(calls) == 1 and calls[0][0] is eng and calls[0][1] > 0
    for h in hs:
        eng.free(h)
    assert replay(eng, calls[0][2]) > 0
    assert Engine._run.__name__ == "_run"  # restored


def test_lock_wait_pools_each_runs_extra_times_1_minus_u_over_u():
    from tiderl.sim.lockwait import lock_wait_s

    runs = [{"u": 0.5, "extra_ms": 2.0}, {"u": 0.75, "extra_ms": 6.0},
            {"u": 0.99, "extra_ms": 19.0}]  # u capped at 0.95 as the model caps it
    assert lock_wait_s(runs) == pytest.approx((0.002 + 0.002 + 0.019 * 0.05 / 0.95) / 3)


def test_a_refit_keeps_the_measured_lock_wait(tmp_path):
    import yaml

    from tiderl.sim.calibrate import keep_lock_wait

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"host": {"capacity": 1.5, "lock_wait_s": 0.0026},
                                    "notes": {"lock_wait": {"seconds": 0.0026}}}))
    new = {"host": {"capacity": 1.7}, "notes": {}}
    keep_lock_wait(path, new)
    assert new["host"] == {"capacity": 1.7, "lock_wait_s": 0.0026}
    assert new["notes"]["lock_wait"] == {"seconds": 0.0026}
    fresh = {"host": {"capacity": 1.7}, "notes": {}}
    keep_lock_wait(tmp_path / "none.yaml", fresh)
    assert fresh["host"] == {"capacity": 1.7}
