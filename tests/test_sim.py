"""The cluster-scale simulator: cost models, workloads, the simulated engine and trainer, and
the production control plane on virtual time (no JAX)."""

import itertools
import json
import math
import subprocess
import sys

import pytest

from tiderl.sim.costs import OpCost, SimCostModel, load_profile, model_shape, profile_from_dict
from tiderl.sim.workloads import Sampler, workload


@pytest.fixture(scope="module")
def h100_7b():
    return SimCostModel(load_profile("h100"), model_shape("qwen2.5-7b"))


# -- cost models -----------------------------------------------------------------------------
def test_model_shapes_match_the_published_parameter_counts():
    # Qwen2.5 model cards: 7.61B and 14.7B parameters.
    assert model_shape("qwen2.5-7b").params == pytest.approx(7.61e9, rel=0.01)
    assert model_shape("qwen2.5-14b").params == pytest.approx(14.7e9, rel=0.01)
    # GQA: 28 layers × 4 KV heads × 128 × (K and V) × 2 bytes.
    assert model_shape("qwen2.5-7b").kv_bytes_per_token == 28 * 4 * 128 * 2 * 2


def test_op_cost_is_c0_plus_the_slowest_component():
    op = OpCost(0.5, (("flops", 10.0), ("hbm", 2.0)))
    assert op(flops=100.0, hbm=4.0) == pytest.approx(0.5 + 10.0)
    assert op(flops=10.0, hbm=40.0) == pytest.approx(0.5 + 20.0)
    assert op() == 0.5


def test_h100_roofline_regimes(h100_7b):
    m, dev = h100_7b.model, h100_7b.profile.device
    # Batch-1 decode is bandwidth-bound: the weights once per token.
    t1 = h100_7b.decode(batch=1, context_sum=1000)
    assert t1 == pytest.approx(0.002 + (m.weight_bytes + 1000 * m.kv_bytes_per_token)
                               / (dev.hbm_bw * 0.75), rel=1e-6)
    # A long prefill is compute-bound at 60% of 989 TFLOPS.
    tp = h100_7b.prefill([(0, 8192)])
    flops = m.forward_flops(8192, 8192 * 8193 / 2)
    assert tp == pytest.approx(0.003 + flops / (dev.flops * 0.6), rel=1e-6)
    # Chunked: a 20k-token append is three rounds of at most 8,192.
    assert len(h100_7b.prefill_work([(0, 20000)])) == 3
    # Decoding 256 rows costs far less than 256 single rows (weights are read once).
    assert h100_7b.decode(batch=256, context_sum=256 * 2000) < 0.2 * 256 * t1
    # KV pool of one H100 for the 7B model: (0.9 × 80 GB − 4 GB − weights) / 56 KiB per token.
    assert h100_7b.kv_capacity_tokens() == pytest.approx(
        (72e9 - 4e9 - m.weight_bytes) / m.kv_bytes_per_token, rel=1e-6)
    # Training: a micro-batch's cost is its busiest rank's; backward is twice forward.
    f = h100_7b.actor_forward([[4096], [1024]])
    assert f == pytest.approx(h100_7b.actor_forward([[4096], [4096]]), rel=1e-3)
    b = h100_7b.actor_backward([[4096]])
    assert b == pytest.approx(2 * f - 0.01, rel=0.05)
    # A trainer group spanning nodes pays the cross-node bandwidth for its collectives.
    assert h100_7b.link_bytes(1e9, 16) == pytest.approx(1e9 * 450 / 45)
    assert h100_7b.weight_sync(cross_node=True) > h100_7b.weight_sync(cross_node=False)


def test_profiles_reject_bad_input():
    from tiderl.configlib import ConfigError

    with pytest.raises(ConfigError, match="kind"):
        profile_from_dict({"kind": "guess"})
    with pytest.raises(ConfigError, match="engine.pading"):
        profile_from_dict({"kind": "fitted", "engine": {"pading": True}})
    with pytest.raises(ConfigError, match="not found"):
        load_profile("a100-imaginary")
    with pytest.raises(ConfigError, match="no cost for operation"):
        profile_from_dict({"kind": "fitted", "ops": {}}).op("prefill")
    # YAML 1.1 reads 4.0e9 as a string; the loader takes it as the number it means.
    p = profile_from_dict({"kind": "fitted", "engine": {"activation_bytes": "4.0e9"},
                           "ops": {"decode": {"c0": "1e-3", "flops": "2.0e9"}}})
    assert p.engine.activation_bytes == 4e9 and p.op("decode")(flops=2e9) == pytest.approx(1.001)


# -- workloads -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["webshop", "alfworld"])  # GUI ones: tests/test_sim_vlm.py
def test_workloads_reproduce_table_4_and_drift(name):
    w = workload(name)
    s = Sampler({name: w}, seed=1)
    for step, k in ((0, 0), (w.drift_steps, 1)):
        plans = [s.plan(name, f"t{step}/{i}", step) for i in range(500)]
        rounds = sum(p.rounds for p in plans) / len(plans)
        ctx = sum(w.prompt_tokens + p.rounds * w.action_tokens + sum(p.obs_tokens)
                  for p in plans) / len(plans)
        assert rounds == pytest.approx(w.rounds[k], rel=0.08)
        assert ctx == pytest.approx(w.tokens[k], rel=0.1)
        assert max(p.rounds for p in plans) <= w.max_turns
        lat = [x for p in plans for x in p.latency_s]
        assert max(lat) <= w.latency_cap_s and max(lat) > 5 * w.latency_median_s  # heavy tail
    # A task's plan is a pure function of (seed, task id, step).
    assert s.plan(name, "x", 3) == s.plan(name, "x", 3)
    assert Sampler({name: w}, seed=2).plan(name, "x", 3) != s.plan(name, "x", 3)


# -- the simulated engine --------------------------------------------------------------------
def _engine(**kw):
    from tiderl.sim.virtual_engine import SimEngine

    s = Sampler({"webshop": workload("webshop")})
    s.plan("webshop", "task", 0)
    kw = {"num_pages": 64, "page_size": 16, "max_slots": 4, "actions": s,
          "max_action_tokens": 512, "max_context": 2048, "stop_tokens": (260,), **kw}
    return SimEngine(**kw)


def test_sim_engine_tracks_residency_and_charges_costs(h100_7b):
    from tiderl.serving.pages import PoolExhaustedError, PrefillRequest, StopReason
    from tiderl.serving.rollout import numeric_id

    e = _engine(costs=h100_7b, decode_steps_per_call=8)
    tid = numeric_id("task")
    (p,) = e.prefill_many(None, [PrefillRequest(None, [1] * 100, 100, task_id=tid)])
    assert (p.prefill_cached, p.prefill_computed) == (0, 100) and e.take_cost_s() > 0
    assert e.take_cost_s() == 0.0  # read once
    e.insert(p, {})
    steps = 0
    while not p.done:
        e.generate(None, {})
        steps += 1
    n = len(p.action_tokens)
    assert p.stop_reason == StopReason.STOP_TOKEN and p.action_tokens[-1] == 260
    assert steps == math.ceil((n - 1) / 8) and e.counters.decode_tokens == n - 1
    assert e.actions.length(tid, p.action_start) == n  # the planned length, exactly
    # Next turn: only the new observation (and the last sampled token) is computed.
    e.prefill_many(None, [PrefillRequest(p, [2] * 30, 30)])
    assert p.prefill_cached == 100 + n - 1 and p.prefill_computed == 31
    # A weight sync flushes stale KV: the next prefill recomputes everything.
    e.update_weights(None, version=1)
    e.prefill_many(None, [PrefillRequest(p, [3] * 10, 10)])
    assert p.prefill_cached == 0 and e.counters.recomputed_version > 0
    # All-or-nothing on pages: a request that does not fit changes nothing.
    free = e.pages_free
    with pytest.raises(PoolExhaustedError):
        e.prefill_many(None, [PrefillRequest(None, [1] * 2000, 2000, task_id=5)])
    assert e.pages_free == free and len(e.slots) == 1
    e.evict(p)
    assert e.pages_free == 64 and p.kv_length == 0 and p.drop_reason == "evicted"


@pytest.mark.parametrize("split", [None, 1])
def test_sim_engine_shares_a_groups_prompt_as_the_real_engine_does(split):
    """The counts of the real engine's sharing test (tests/test_serving_share.py), on the
    simulated engine: G siblings' identical prompt is computed once (in one call, or by the
    first sibling and then taken from its kept logits)."""
    from tiderl.serving.pages import PrefillRequest
    from tiderl.sim.virtual_engine import SimEngine

    G, prompt = 8, list(range(5, 18))
    runs = {}
    for share in (False, True):
        e = SimEngine(num_pages=64, page_size=4, max_slots=G, max_context=128)
        hs: list = []
        for part in ([range(G)] if split is None else [range(split), range(split, G)]):
            hs += e.prefill_many(None, [PrefillRequest(None, prompt, len(prompt), task_id=40 + i,
                                                       share=hs if share else None)
                                        for i in part])
        runs[share] = (e, hs)
    (off, hs_off), (on, hs_on) = runs[False], runs[True]
    p = len(prompt)
    assert off.counters.computed_new - on.counters.computed_new == (G - 1) * p
    assert on.counters.prompt_tokens_shared == (G - 1) * p
    assert on.counters.shared_samples == G - 1
    # Sharing changes what is computed, not what is sampled (keyed by task and position).
    assert [h.tokens for h in hs_on] == [h.tokens for h in hs_off]


def test_sim_engine_evicted_sibling_computes_only_its_own_tokens():
    from tiderl.serving.pages import PrefillRequest
    from tiderl.sim.virtual_engine import SimEngine

    e = SimEngine(num_pages=64, page_size=4, max_slots=4, max_context=128, max_action_tokens=3)
    prompt = list(range(5, 18))  # 13 tokens: 3 full pages of 4, one partial
    a, b = e.prefill_many(None, [PrefillRequest(None, prompt, len(prompt), task_id=1, share=[]),
                                 PrefillRequest(None, prompt, len(prompt), task_id=2, share=[])])
    for h in (a, b):
        e.insert(h, {})
    while not (a.done and b.done):
        e.generate(None, {})
    assert a.tokens != b.tokens  # their actions differ (keyed by task)
    e.evict(b)
    before = e.counters.computed_new + e.counters.recomputed_evicted
    shared = e.counters.prompt_tokens_shared
    (b,) = e.prefill_many(None, [PrefillRequest(b, [7, 8], 2, share=[a, b])])
    computed = e.counters.computed_new + e.counters.recomputed_evicted - before
    assert e.counters.prompt_tokens_shared - shared == len(prompt)
    assert computed == len(b.tokens) - 1 - len(prompt) and b.prefill_cached == len(prompt)
    # fork: siblings holding a's resident context, each sampling its own first token next.
    kids = e.fork(a, 2, [7, 8])
    assert [k.kv_length for k in kids] == [a.kv_length] * 2
    for k in kids:
        (k,) = e.prefill_many(None, [PrefillRequest(k, [], 0)])
        assert k.prefill_computed == 1 and k.prefill_cached == a.kv_length - 1


def test_sim_engine_refuses_a_shared_batch_that_does_not_fit_whole():
    """A row served by a sibling still holds its whole context: a batch of identical
    prompts that does not fit the pool raises before anything is shared or counted, and the
    same batch then runs as it would have on a pool with room."""
    import dataclasses

    from tiderl.serving.pages import PoolExhaustedError, PrefillRequest
    from tiderl.sim.virtual_engine import SimEngine

    prompt = list(range(5, 18))  # 13 tokens: 4 pages of 4 per sibling

    def batch(hs: list) -> list:
        return [PrefillRequest(None, prompt, len(prompt), task_id=1 + i, share=hs)
                for i in range(2)]

    full = SimEngine(num_pages=7, page_size=4, max_slots=4, max_context=128)
    counters = dataclasses.replace(full.counters)
    with pytest.raises(PoolExhaustedError, match="needs 8 pages, 7 free"):
        full.prefill_many(None, batch([]))
    assert full.counters == counters and full.pages_free == 7 and not full.slots
    with pytest.raises(ValueError, match="true_length=14 exceeds len.tokens.=13"):
        full.prefill_many(None, [PrefillRequest(None, prompt, 14, task_id=1)])
    roomy = SimEngine(num_pages=8, page_size=4, max_slots=4, max_context=128)
    a = roomy.prefill_many(None, batch([]))
    assert roomy.pages_free == 0 and roomy.counters.prompt_tokens_shared == len(prompt)
    assert [h.tokens for h in a] == [h.tokens for h in SimEngine(
        num_pages=64, page_size=4, max_slots=4, max_context=128).prefill_many(None, batch([]))]


# -- the simulated trainer against the production RA2P cost model ----------------------------
def _ready_step(trainer, mbs):
    from tiderl.sim.clock import run_virtual

    async def go():
        for mb in mbs:
            trainer.submit(mb)
        m = await trainer.finish_step_async()
        trainer.close()
        return m

    return run_virtual(go())


def test_sim_trainer_matches_the_ra2p_cost_model(h100_7b):
    """Micro-batches ready at the step start: the executor's step time is Appendix A's C_col
    (colocated aggregation) and C_dec (decoupled), plus the update."""
    from tiderl.sim.trainer import SimMicroBatch, SimTrainer
    from tiderl.train import ra2p

    c = h100_7b
    mb = SimMicroBatch(ranks=((4096,), (4096,)), n_action_tokens=100, n_seqs=2)
    t_ref, t_f, t_b = c.ref_forward(mb.ranks), c.actor_forward(mb.ranks), c.actor_backward(
        mb.ranks)
    apply = c.apply(2)
    col = _ready_step(SimTrainer(c, actor_gpus=2, offload=True), [mb] * 6)
    swap = c.swap("actor", 2) + c.swap("ref", 2)  # a phase change moves both models
    want, _ = ra2p.c_col([0.0] * 6, ra2p.PhaseCosts(t_ref, t_f, t_b, swap))
    # C_col counts a swap before the Ref phase too; at the step start the Ref is resident.
    assert col["step_time"] == pytest.approx(want - c.swap("ref", 2) + apply, abs=1e-4)
    assert (col["alternations"], col["swaps"], col["action_tokens"]) == (2, 3, 600)
    # Without aggregation (the streaming baseline) every micro-batch alternates.
    vso = _ready_step(SimTrainer(c, actor_gpus=2, offload=True, aggregate=False), [mb] * 6)
    assert vso["alternations"] == 12 and vso["step_time"] > col["step_time"]
    # Decoupled, Ref as fast as the Actor's forward: C_dec with M = 1.
    mb1 = SimMicroBatch(ranks=((4096,),), n_action_tokens=1, n_seqs=1)
    dec = _ready_step(SimTrainer(c, actor_gpus=1, ref_gpus=1), [mb1] * 6)
    costs = ra2p.PhaseCosts(c.ref_forward(mb1.ranks), c.actor_forward(mb1.ranks),
                            c.actor_backward(mb1.ranks), 0.0, 1)
    assert dec["step_time"] == pytest.approx(ra2p.c_dec([0.0] * 6, costs) + c.apply(1),
                                             abs=1e-4)
    assert dec["swaps"] == 0 and dec["mode"] == "decoupled"


# -- the production control plane on virtual time --------------------------------------------
SMALL = dict(gpus=4, steps=2, groups_per_step=3, group_size=4, groups_per_microbatch=1,
             eval_every=1, eval_groups=1, workloads=("webshop",), rollout_ratio=0.5)


@pytest.fixture(scope="module")
def small_runs():
    from tiderl.sim.cluster import MODES, SimConfig, simulate_job

    return {m: simulate_job(SimConfig(mode=m, **SMALL)) for m in MODES}


def test_the_simulator_runs_the_production_control_plane(small_runs):
    from tiderl.control.buffer import ReadinessBuffer
    from tiderl.control.controller import Controller
    from tiderl.control.ers import KeepSplit
    from tiderl.serving.ctb import CTBScheduler, VanillaScheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager

    for mode, run in small_runs.items():
        c = run.controller
        assert type(c) is Controller and type(c.manager) is RolloutManager
        assert type(c.buffer) is ReadinessBuffer and type(c.planner) is KeepSplit
        live = [r for r in c.manager.ranks if r is not None]  # ERS: cells outside rollout
        assert live and all(type(r) is RolloutRank for r in live)
        assert type(c.manager.sched) is (CTBScheduler if mode == "tiderl" else VanillaScheduler)
        steps = run.steps
        assert len(steps) == 2 and run.trainer.version == 2
        last = steps[-1]
        assert last["goodput"] == pytest.approx(last["consumed_tokens"] / last["wall_s"])
        assert 0 < last["kv_hit_rate"] < 1 and last["wall_s"] > 10  # virtual seconds
        assert any(r["kind"] == "eval" for r in run.records)
    sync = small_runs["sync"].steps
    assert all(a["t_train_end"] <= b["t_rollout_start"] for a, b in zip(sync, sync[1:], strict=False))


def test_ers_runs_through_the_one_hook():
    """A simulated job runs the production ERS planner: cells move through the controller's
    role-change path, the SimTrainer's width follows the cell map and no step is lost."""
    from tiderl.control.ers import ERSPlanner
    from tiderl.sim.cluster import SimConfig, simulate_job

    cfg = SimConfig(mode="tiderl", planner="ers", **{**SMALL, "steps": 3, "eval_every": 0})

    run = simulate_job(cfg)
    c = run.controller
    assert type(c.planner) is ERSPlanner and len(run.steps) == 3
    changes = [r for r in run.records if r.get("kind") == "role_change"]
    # Two rollout ranks cannot feed two trainer GPUs here: a generation deficit moves a cell.
    assert changes and changes[0]["rule"] == "generation" and changes[0]["reason"]
    cells = c.roles.cells
    assert run.trainer.actor_gpus == cells.count("trainer")
    live = [i for i, r in enumerate(c.manager.ranks) if r is not None]
    assert live == list(cells.cells("rollout"))


def test_the_simulator_imports_no_jax(tmp_path):
    code = ("import sys; from tiderl.sim.cluster import SimConfig, simulate_job\n"
            "r = simulate_job(SimConfig(mode='tiderl', gpus=2, steps=1, groups_per_step=2, "
            "group_size=2, eval_every=0, workloads=('alfworld',)))\n"
            "import tiderl.sim.experiments, tiderl.sim.validate, tiderl.sim.calibrate\n"
            "print(r.summary['steps'], 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]


def test_ctb_keeps_kv_resident_under_a_tight_pool():
    """One rank whose pool holds a fraction of the tasks: the request-level baseline evicts
    waiting tasks and recomputes them; CTB pauses tasks instead and keeps a higher hit rate."""
    from tiderl.sim.cluster import SimConfig, simulate_job

    base = SimConfig(mode="sync", gpus=1, steps=1, groups_per_step=8, group_size=4,
                     eval_every=0, workloads=("webshop",), kv_tokens=24_000)
    ctb = simulate_job(base.__class__(**{**base.__dict__, "scheduler": "ctb"}))
    van = simulate_job(base.__class__(**{**base.__dict__, "scheduler": "vanilla",
                                         "vanilla_concurrency": 32}))
    hit = {k: r.steps[-1]["kv_hit_rate"] for k, r in (("ctb", ctb), ("van", van))}
    rec = {k: sum(x.stats.recomputed_evicted for x in r.ranks) for k, r in (("ctb", ctb),
                                                                           ("van", van))}
    assert rec["van"] > 0 and hit["ctb"] > hit["van"]
    assert rec["ctb"] < rec["van"]
    assert ctb.controller.manager.decisions["pause"] > 0


def test_calibration_fit_recovers_known_costs():
    from tiderl.sim.calibrate import fit_op, predict

    true = (2e-3, 1e9, 5e8)
    samples = []
    for f in (1e6, 5e6, 2e7, 1e8):
        for h in (1e5, 1e6, 2e7, 1e8):
            works = [{"flops": f, "hbm": h}]
            samples.append((works, predict(true, works)))
    cost, mape = fit_op(samples)
    assert mape < 0.01
    assert cost.c0 == pytest.approx(2e-3, rel=0.05)
    assert cost.rate("flops") == pytest.approx(1e9, rel=0.05)


def test_validation_compares_modes_and_ranks_them():
    from tiderl.sim.validate import compare

    def run(goodput, step):
        return {"records": [{"kind": "step", "goodput": goodput, "step_time_s": step,
                             "rwt_s": 0.0, "twt_s": 1.0, "kv_hit_rate": 0.5,
                             "prefill_computed": 10}]}

    real = {"sync": [run(10, 2.0)], "tiderl": [run(20, 1.0)]}
    sim = {"sync": [run(11, 2.2)], "tiderl": [run(19, 1.0)]}
    res = compare(real, sim)
    assert res["same_ranking"] and res["max_goodput_rel_error"] == pytest.approx(0.1)
    assert res["modes"]["sync"]["step_time_mape"] == pytest.approx(0.1)
    # Runs recorded before the step records carried the engines' rounds compare as nan.
    assert math.isnan(res["modes"]["sync"]["real"]["engine_steps"])
    assert res["same_ranking_resolved"] and res["unresolved_pairs"] == []
    sim["sync"] = [run(30, 1.0)]
    assert not compare(real, sim)["same_ranking"]
    assert not compare(real, sim)["same_ranking_resolved"]
    # Two seeds each: tiderl 20 and 15, stream 18 and 14 overlap, so their order is not
    # resolved by the real runs; sync (10, 11) is below both.
    real = {"sync": [run(10, 2.0), run(11, 2.0)], "stream": [run(18, 1), run(14, 1)],
            "tiderl": [run(20, 1), run(15, 1)]}
    sim = {"sync": [run(10, 2.0)] * 2, "stream": [run(19, 1)] * 2, "tiderl": [run(17, 1)] * 2}
    res = compare(real, sim)
    assert res["ranking_real"] == ["tiderl", "stream", "sync"] and not res["same_ranking"]
    assert res["unresolved_pairs"] == ["tiderl~stream"] and res["same_ranking_resolved"]
    assert res["overlapping_pairs"] == ["tiderl~stream"]
    # Five seeds, paired: the ranges overlap (stream 14-22, tiderl 12-20), but seed by seed
    # stream is above tiderl by 1.5-3 (a paired t-test orders them), so the simulator must
    # order them too.
    st, ti = [22, 14, 18, 16, 20], [20, 12, 15, 14, 18.5]
    real = {"stream": [run(g, 1) for g in st], "tiderl": [run(g, 1) for g in ti]}
    sim = {"stream": [run(17, 1)] * 5, "tiderl": [run(16, 1)] * 5}
    res = compare(real, sim)
    assert res["overlapping_pairs"] == ["stream~tiderl"] and res["unresolved_pairs"] == []
    assert res["same_ranking_resolved"]
    sim["tiderl"] = [run(18, 1)] * 5
    assert not compare(real, sim)["same_ranking_resolved"]
    from tiderl.sim.validate import paired_above
    assert paired_above([2, 3], [1, 2]) and not paired_above([1, 2], [2, 3])
    assert not paired_above([5], [1])  # one seed orders nothing by pairing
    # The same values with the seeds' order shuffled in one mode no longer pair up.
    real["tiderl"] = [run(g, 1) for g in (12, 20, 18.5, 15, 14)]
    assert compare(real, sim)["unresolved_pairs"] == ["stream~tiderl"]


def test_the_cpu_job_simulates_from_its_run_config(tmp_path):
    """The validation twin: the same RunConfig, the default task's adapter and the server's
    injected latencies, priced by a fitted profile."""
    from tiderl.sim.validate import run_config, run_metrics, simulate

    cfg = run_config("tiderl", 2, 0, str(tmp_path))
    out = simulate(cfg, "cpu-fitted")
    m = run_metrics(out)
    assert len([r for r in out["records"] if r["kind"] == "step"]) == 2
    assert m["goodput"] > 0 and 0 < m["kv_hit_rate"] < 1
    # The simulated ranks count their device rounds as the real ones do.
    assert m["engine_steps"] > 0 and m["engine_round_ms"] > 0


def test_fig14_command_prints_its_json(tmp_path, capsys):
    from tiderl.sim.experiments import main

    assert main(["fig14", "--out", str(tmp_path)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"cm_over_vs", "dm_over_vs"} <= set(res) and (tmp_path / "fig14.png").is_file()
    assert res["cm_over_vso"] < 1  # aggregation saves swaps over per-micro-batch alternation
    # Both models fit: VS swaps nothing, so CM cannot cut its overhead (the Ref's compute);
    # where they do not fit (14B, 8,192 tokens per GPU), CM saves 14 of VS's 16 swaps.
    assert res["cm_over_vs"] == pytest.approx(1.0, abs=1e-4)
    assert res["colocation_excess_gb_14b_8192_per_gpu"] > 0
    assert res["cm_over_vs_14b_8192_per_gpu"] < 0.9 and res["alternation_cost_needed_s"] > 0


def test_run_all_starts_a_dependent_run_before_the_rest():
    """`run_all(follow=...)`: a run that needs others' results starts as soon as they are in,
    ahead of configs not yet started; results come back in the order the configs were given."""
    import dataclasses

    from tiderl.sim.cluster import SimConfig
    from tiderl.sim.experiments import best_of
    from tiderl.sim.jobs import run_all

    base = SimConfig(mode="async", gpus=2, steps=1, groups_per_step=1, group_size=2,
                     groups_per_microbatch=1, eval_every=0, workloads=("webshop",))
    cfgs = {f"async ratio {q}": dataclasses.replace(base, rollout_ratio=q) for q in (0.25, 0.5)}
    cfgs["stream ratio 0.5"] = dataclasses.replace(base, mode="stream", rollout_ratio=0.5)
    seen: list[list[str]] = []

    def then(done):
        seen.append(list(done))
        if {"async ratio 0.25", "async ratio 0.5"} <= set(done):
            q = best_of(done, "async")[0]
            return {f"tiderl ratio {q}": dataclasses.replace(base, mode="tiderl",
                                                            rollout_ratio=q)}
        return {}

    runs = run_all(cfgs, 1, follow=then)
    assert list(runs)[:3] == list(cfgs) and list(runs)[3].startswith("tiderl ratio ")
    # the dependent run went before the stream run
    assert seen[2] == ["async ratio 0.25", "async ratio 0.5", list(runs)[3]]
    assert all(r.summary["goodput"] > 0 for r in runs.values())


def test_the_pressure_validation_job_has_kv_pressure_and_ready_microbatches(tmp_path):
    from tiderl.sim.validate import run_config

    d = run_config("stream", 2, 0, str(tmp_path / "d"))
    p = run_config("stream", 2, 0, str(tmp_path / "p"), "pressure")
    assert p.rollout.num_pages * p.rollout.page_size < d.rollout.num_pages * d.rollout.page_size
    # two steps of tasks in flight need more KV than the pool holds
    tasks = 2 * p.controller.groups_per_step * p.env.group_size
    assert tasks * p.rollout.max_context > 2 * p.rollout.num_pages * p.rollout.page_size
    assert p.controller.groups_per_step // p.controller.groups_per_microbatch >= 8
    assert p.env.latency.scale_s < d.env.latency.scale_s  # the engine sets the pace
    with pytest.raises(ValueError, match="validation job 'nope'"):
        run_config("stream", 2, 0, str(tmp_path / "x"), "nope")


def test_shared_host_shares_its_capacity():
    """Processor sharing on one CPU machine: work beside other work runs slower."""
    import asyncio

    from tiderl.sim.clock import run_virtual
    from tiderl.sim.host import SharedHost

    async def go():
        h = SharedHost(capacity=1.0)
        loop = asyncio.get_running_loop()
        assert h.fixed(0.5) == pytest.approx(0.5)  # alone: full rate
        t0 = loop.time()
        await h.elastic(1.0)  # half rate while the fixed work runs, then full
        elastic = loop.time() - t0
        beside = h.fixed(1.0)  # nothing else in flight now
        both = asyncio.ensure_future(h.elastic(1.0))
        await asyncio.sleep(0)
        late = h.fixed(1.0)  # starts beside the elastic and the first fixed work
        await both
        return elastic, beside, late, loop.time() - t0

    elastic, beside, late, _ = run_virtual(go())
    assert elastic == pytest.approx(0.5 + 0.75, abs=1e-4)
    assert beside == pytest.approx(1.0) and late == pytest.approx(3.0)
    assert SharedHost(capacity=2.0).capacity == 2.0
    with pytest.raises(ValueError, match="capacity"):
        SharedHost(capacity=0)


def _eight_starts(engine_first, timer_s, **env_kwargs):
    """Eight env `start` calls made at once on the virtual loop against a `SimSuiteEnv` with
    `env_kwargs` on a one-core shared host (with an engine step in flight throughout when
    `engine_first`): (when each ended, when a timer due at `timer_s` fired)."""
    import asyncio

    from tiderl.config import load_config
    from tiderl.sim.clock import run_virtual
    from tiderl.sim.envs import SimSuiteEnv
    from tiderl.sim.host import SharedHost

    cfg = load_config(None, ["env.latency.dist=none"]).env

    async def go():
        host = SharedHost(capacity=1.0)
        env = SimSuiteEnv(cfg, host=host, **env_kwargs)
        loop = asyncio.get_running_loop()
        t0, ends = loop.time(), []
        if engine_first:
            host.fixed(1.0)  # an engine step in flight throughout

        async def call(k):
            await env.start({"task_id": f"t{k}", "target": 3})
            ends.append(loop.time() - t0)

        async def timer():
            await asyncio.sleep(timer_s)
            return loop.time() - t0

        t = asyncio.ensure_future(timer())
        await asyncio.gather(*(call(k) for k in range(8)))
        return ends, await t

    return run_virtual(go())


def test_suite_env_calls_hold_the_event_loop():
    """The real job serves a built-in suite on its own event loop, so an env call's host work
    holds that loop: eight calls made at once end together, after the eight calls' work, a
    timer due meanwhile fires only then, and an engine step in flight beside them (on the
    shared host) makes the held work take longer."""
    ends, fired = _eight_starts(False, 0.001, overhead_s=0.01)
    assert ends == pytest.approx([0.08] * 8, abs=1e-6)
    assert fired == pytest.approx(0.08, abs=1e-6)  # due at 0.001, the loop was held
    ends, _ = _eight_starts(True, 0.001, overhead_s=0.01)  # beside the engine step: half a core
    assert ends == pytest.approx([0.16] * 8, abs=1e-6)


def test_a_cluster_job_closes_its_ranks_when_building_it_fails(monkeypatch, rank_calls):
    """Ranks start before the controller is built: an error in between (here the controller's
    own) still closes every rank that started."""
    from tiderl.sim import cluster

    started, closed = rank_calls("start"), rank_calls("close")

    def refuse(*args, **kwargs):
        raise RuntimeError("controller refused")

    monkeypatch.setattr(cluster, "Controller", refuse)
    with pytest.raises(RuntimeError, match="controller refused"):
        cluster.simulate_job(cluster.SimConfig(steps=1, gpus=4))
    assert started and sorted(closed) == sorted(started)


def test_a_served_env_call_holds_its_server_not_the_event_loop():
    """With the env served by a process of its own, a call's client half holds the job's loop
    and its server half the server's one thread: eight calls made at once end one server
    half apart, a timer due meanwhile fires on time; beside an engine step in flight the
    client halves (on the job's host) slow down, the server's (a core of its own) do not."""
    ends, fired = _eight_starts(False, 0.02, overhead_s=0.001, server_s=0.01)
    # the eight client halves first (held together on the loop), then one server half each
    assert ends == pytest.approx([0.008 + 0.01 * (k + 1) for k in range(8)], abs=1e-6)
    assert fired == pytest.approx(0.02, abs=1e-6)  # the loop was free: the timer on time
    # beside the engine step: the client halves at half the host's one core
    ends, _ = _eight_starts(True, 0.02, overhead_s=0.001, server_s=0.01)
    assert ends == pytest.approx([0.016 + 0.01 * (k + 1) for k in range(8)], abs=1e-6)


def test_a_served_envs_queue_keeps_its_pace_while_the_loop_is_held():
    """The server serves its queue at its own pace: with the job's loop held 4 ms in every
    iteration by other work, eight calls made at once still end one server half apart (each
    caller takes its answer at most one held iteration late), not a held iteration or more
    apart; and the server's work in flight slows the job's host work started meanwhile."""
    import asyncio

    from tiderl.config import load_config
    from tiderl.sim.clock import run_virtual
    from tiderl.sim.envs import SimSuiteEnv
    from tiderl.sim.host import SharedHost

    cfg = load_config(None, ["env.latency.dist=none"]).env

    async def go():
        loop = asyncio.get_running_loop()
        env = SimSuiteEnv(cfg, overhead_s=0.001, server_s=0.01)
        ends = []

        async def busy():
            for _ in range(60):
                loop.hold(0.004)
                await asyncio.sleep(0)

        async def call(k):
            await env.start({"task_id": f"t{k}", "target": 3})
            ends.append(loop.time())

        b = asyncio.ensure_future(busy())
        await asyncio.gather(*(call(k) for k in range(8)))
        await b
        host = SharedHost(capacity=1.0)
        served = SimSuiteEnv(cfg, server_s=0.01, host=host)
        c = asyncio.ensure_future(served.start({"task_id": "t9", "target": 3}))
        await asyncio.sleep(0.001)  # inside the server's half
        stretched = host.fixed(0.002)
        await c
        return ends, stretched

    ends, stretched = run_virtual(go())
    ends.sort()
    # one server half apart, each caller at most one held iteration late (with the server's
    # queue taking turns on the held loop: a held iteration or more between halves, 84 ms+)
    assert ends[-1] - ends[0] <= 7 * 0.01 + 0.004 + 1e-6
    assert all(b - a <= 0.01 + 0.004 + 1e-6 for a, b in itertools.pairwise(ends))
    assert stretched == pytest.approx(0.004)  # two pieces of work on one core


def test_the_served_job_is_the_pressure_job_with_its_env_in_another_process(tmp_path):
    from tiderl.configlib import ConfigError
    from tiderl.sim.validate import JOBS, run_config, server_overrides

    p = run_config("stream", 2, 0, str(tmp_path), "pressure")
    s = run_config("stream", 2, 0, str(tmp_path), "served")
    assert s == p and JOBS["served"].served and not JOBS["pressure"].served
    assert server_overrides(3, "pressure") is None  # served in-process
    over = server_overrides(3, "served")
    assert over[-1] == "latency.seed=3" and "latency.scale_s=0.002" in over
    assert all(not o.startswith("env.") for o in over)  # the server's own EnvConfig keys
    client, server = SimCostModel(load_profile("cpu-fitted"), model_shape("tiny")).env_served()
    assert 0 < client < 0.1 and 0 < server < 0.1
    with pytest.raises(ConfigError, match="env_client or env_server.*calibrate --host-only"):
        SimCostModel(load_profile("h100"), model_shape("tiny")).env_served()


# -- speed without a different schedule -----------------------------------------------------
def _looptime_virtual(coro, *, charge_cpu=False, meter=None, host=None):
    """`run_virtual` on looptime's own loop (what `VirtualLoop` replaced)."""
    import looptime

    from tiderl.sim.clock import run_virtual

    return run_virtual(coro, meter=meter, loop=looptime.new_event_loop(start=0.0, noop_cycles=1))


def test_virtual_loop_keeps_looptimes_schedule(monkeypatch):
    """The simulator's own loop gives the schedule looptime gives, to the microsecond, in fewer
    loop iterations; a coroutine waiting on nothing is a clear deadlock error, not a hang."""
    import asyncio

    from tiderl.sim import cluster
    from tiderl.sim.clock import run_virtual

    cfg = cluster.SimConfig(mode="tiderl", **SMALL)

    def records(run):
        return [{k: v for k, v in r.items() if k not in ("real_s", "process_s")}
                for r in run.records]

    ours = cluster.simulate_job(cfg)
    monkeypatch.setattr(cluster, "run_virtual", _looptime_virtual)
    theirs = cluster.simulate_job(cfg)
    assert records(ours) == records(theirs) and len(records(ours)) > 2
    assert 0 < ours.cpu.iterations

    async def stuck():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError, match="deadlocked"):
        run_virtual(stuck())


def test_decode_cost_closure_is_the_cost_model():
    """The simulated engine's hoisted decode cost gives `SimCostModel.decode`'s floats exactly."""
    import random

    rng = random.Random(0)
    for prof in ("h100", "cpu-fitted"):
        for model in ("qwen2.5-7b", "tiny"):
            c = SimCostModel(load_profile(prof), model_shape(model))
            for gpus in (1, 4):
                fast = c.decode_fn(gpus)
                for _ in range(300):
                    b = rng.randint(0, 1100)
                    cs = b * rng.randint(1, 16384)
                    assert fast(b, cs) == c.decode(batch=b, context_sum=cs, gpus=gpus)


def test_latency_bound_is_half_the_sync_batch_latency_under_staleness_one():
    """fig8's bound: sync's rollout phase is the batch's tail latency L; under max_staleness s
    no asynchronous step is shorter than L/(1 + s), so goodput is at most a step's tokens over
    that (the first step, which also starts the engines, is left out)."""
    from tiderl.sim.jobs import Result, latency_bound

    steps = [{"t_rollout_start": 0.0, "t_rollout_end": 90.0, "action_tokens": 1,
              "engine_busy": 1.0}]
    steps += [{"t_rollout_start": 100.0 * k, "t_rollout_end": 100.0 * k + lat,
               "action_tokens": tok, "engine_busy": 0.3}
              for k, (lat, tok) in enumerate([(40.0, 1000), (60.0, 3000)], start=1)]
    lb = latency_bound(Result({}, steps, {}, 0.0, 0.0), max_staleness=1)
    assert lb["batch_latency_s"] == 50.0 and lb["step_floor_s"] == 25.0
    assert lb["goodput_ceiling"] == pytest.approx(2000 / 25.0) and lb["engine_busy"] == 0.3
    assert latency_bound(Result({}, steps, {}, 0.0, 0.0), max_staleness=2)["step_floor_s"] == \
        pytest.approx(50.0 / 3)
