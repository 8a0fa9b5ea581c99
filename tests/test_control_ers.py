"""The ERS planner on synthetic readiness traces, and the buffer's readiness signals. No JAX."""

import math

import pytest

from tiderl.configlib import ConfigError
from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.ers import ERSConfig, ERSPlanner
from tiderl.control.fixed_plans import KeepSplit
from tiderl.control.plans import CellMap, ScalingPlan, Signals
from tiderl.envs.protocol import EndReason
from tiderl.serving.trajectory import Trajectory
from tiderl.train.ra2p import PhaseCosts, break_even_ras, choose_mode, predicted_ready_times

# Cells 0-1 rollout, 2-3 trainer, 4 Ref (a decoupled start).
START = CellMap(("rollout", "rollout", "trainer", "trainer", "ref"))
CON = dict(consumption_deficit=True, deficit_reason="head-of-line 3.0s > τ·T_step 1.0s")
GEN = dict(generation_deficit=True, deficit_reason="2 of B_ideal=8 groups ready")


def run(planner, trace, cells=START):
    """Feeds one Signals per boundary, after the run's first boundary (its step compiles: it
    never counts toward a trend); returns the plans and the final cells."""
    planner.plan(Signals(step=0), cells)
    plans = []
    for step, kw in enumerate(trace, start=1):
        p = planner.plan(Signals(step=step, **kw), cells)
        plans.append(p)
        cells = p.cells
    return plans, cells


def moves(plans):
    return [(p.moves[0].src, p.moves[0].dst) for p in plans if p.moves]


def test_consumption_deficit_moves_a_rollout_cell_to_the_trainer_after_patience():
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [CON, CON])
    assert not plans[0].moves  # one boundary is not a trend
    assert moves(plans) == [("rollout", "trainer")] and cells.count("trainer") == 3
    assert plans[1].rule == "consumption" and "head-of-line" in plans[1].reason
    assert plans[1].reason.endswith("rollout → trainer")


def test_generation_deficit_frees_the_ref_first_then_a_trainer_cell():
    # After a move the next boundary settles (its step began on the old layout): the second
    # move needs patience boundaries after that one.
    plans, cells = run(ERSPlanner(ERSConfig(patience=2, cooldown=0)), [GEN] * 4)
    assert moves(plans) == [("ref", "rollout")]
    plans, cells = run(ERSPlanner(ERSConfig(patience=2, cooldown=0)), [GEN] * 5)
    assert moves(plans) == [("ref", "rollout"), ("trainer", "rollout")]
    assert plans[1].ref_mode == "colocated" and "colocated RA2P" in plans[1].reason
    assert cells.describe() == {"rollout": [0, 1, 3, 4], "trainer": [2], "ref": []}
    # The trainer keeps its minimum: more deficit moves nothing.
    plans, cells = run(ERSPlanner(ERSConfig(patience=1)), [GEN] * 6, cells)
    assert cells.count("trainer") == 1 and not moves(plans)


def test_alternating_noise_never_moves_a_cell():
    trace = [CON, GEN] * 10 + [CON, {}, GEN, {}] * 5
    plans, cells = run(ERSPlanner(), trace)
    assert moves(plans) == [] and cells == START


def test_hysteresis_a_move_is_not_undone_within_the_cooldown():
    # Consumption, then a sustained generation deficit right after the move.
    cfg = ERSConfig(patience=2, cooldown=4, max_ref_cells=0)
    start = CellMap(("rollout", "rollout", "trainer"))
    plans, _ = run(ERSPlanner(cfg), [CON, CON] + [GEN] * 6, start)
    first, undo = [i for i, p in enumerate(plans) if p.moves]
    assert (plans[first].moves[0].src, plans[undo].moves[0].src) == ("rollout", "trainer")
    assert undo - first >= cfg.cooldown


def test_cold_start_allocates_rollout_preemptively_within_bounds():
    # The Ref is lent (RAS = 0 is below any break-even); here rollout then holds 3 of 5
    # cells, at least the default share (half), so no trainer cell goes.
    p = ERSPlanner().plan(Signals(cold_start=True), START)
    assert p.rule == "cold_start" and [(m.src, m.dst) for m in p.moves] == [("ref", "rollout")]
    assert p.ref_mode == "colocated"
    p = ERSPlanner(ERSConfig(cold_start_cells=1)).plan(Signals(cold_start=True), START)
    assert p.rule == "cold_start" and len(p.moves) == 2  # the Ref and one trainer cell
    assert p.cells.describe() == {"rollout": [0, 1, 3, 4], "trainer": [2], "ref": []}
    # An evaluation during the first step borrows one trainer cell more (rule 3).
    wide = CellMap(("rollout",) * 2 + ("trainer",) * 4)
    no_share = ERSConfig(cold_start_share=0.0)
    p = ERSPlanner(no_share).plan(Signals(cold_start=True, eval_next=True), wide)
    assert [(m.src, m.dst) for m in p.moves] == [("trainer", "rollout")]
    p = ERSPlanner(ERSConfig(eval_preempt=False, cold_start_share=0.0)).plan(
        Signals(cold_start=True, eval_next=True), wide)
    assert not p.moves
    bounded = ERSPlanner(ERSConfig(max_rollout_cells=3, cold_start_cells=1)).plan(
        Signals(cold_start=True), START)
    assert bounded.cells.count("rollout") == 3
    off = ERSPlanner(ERSConfig(cold_start=False)).plan(Signals(cold_start=True), START)
    assert not off.moves
    # -1 lends every movable cell: the trainer sits at its minimum for the first step.
    every = ERSPlanner(ERSConfig(cold_start_cells=-1)).plan(Signals(cold_start=True),
                                                             CellMap(("rollout",) + ("trainer",) * 4))
    assert every.cells.count("trainer") == 1 and len(every.moves) == 3


def test_cold_start_lends_trainer_cells_until_rollout_holds_its_share():
    # 8 rollout cells of 32: the first step runs at an even split (16), one more for an
    # evaluation during it; share 0 lends none, and an explicit count wins when larger.
    start = CellMap(("rollout",) * 8 + ("trainer",) * 24)
    p = ERSPlanner().plan(Signals(cold_start=True), start)
    assert p.rule == "cold_start" and p.cells.count("rollout") == 16
    assert all(m.src == "trainer" for m in p.moves) and len(p.moves) == 8
    assert ERSPlanner().plan(Signals(cold_start=True, eval_next=True),
                             start).cells.count("rollout") == 17
    assert not ERSPlanner(ERSConfig(cold_start_share=0.0)).plan(
        Signals(cold_start=True), start).moves
    assert ERSPlanner(ERSConfig(cold_start_share=0.25)).plan(
        Signals(cold_start=True), start).moves == ()
    assert ERSPlanner(ERSConfig(cold_start_share=0.25, cold_start_cells=2)).plan(
        Signals(cold_start=True), start).cells.count("rollout") == 10
    # Already at or above the share (a rollout-heavy start): nothing is lent.
    heavy = CellMap(("rollout",) * 20 + ("trainer",) * 12)
    assert not ERSPlanner().plan(Signals(cold_start=True), heavy).moves
    # The lent cells come back at the first boundary when rollout was latency-bound, even
    # on a generation deficit: its engines idled, more cells did not make groups faster.
    planner = ERSPlanner()
    lent = planner.plan(Signals(cold_start=True), start)
    back = planner.plan(Signals(step=1, gen_rate=0.1, train_rate=0.5, rollout_busy=0.5,
                                **GEN), lent.cells)
    assert back.rule == "cold_return" and back.cells == start
    with pytest.raises(ConfigError, match="cold_start_share"):
        ERSConfig(cold_start_share=1.0)


def test_a_latency_bound_generation_deficit_moves_no_cell():
    # The trainer waits, but rollout engines idle half the time: groups wait on their
    # environments (or the staleness window), not on engines, so a trainer cell moved to
    # rollout would only slow the trainer. The plan holds, with the reason.
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    idle = dict(GEN, gen_rate=1.0, train_rate=3.0, twt_frac=0.6, rollout_busy=0.5)
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [idle] * 4, start)
    assert cells == start and not moves(plans)
    held = [p for p in plans if p.rule == "hold"]
    assert held and "busy 50%" in held[0].reason and "latency" in held[0].reason
    # Engines busy (capacity-bound), or their share unknown: the deficit moves cells.
    for busy in (0.9, math.nan):
        plans, cells = run(ERSPlanner(ERSConfig(patience=2)),
                           [dict(idle, rollout_busy=busy)] * 2, start)
        assert cells.count("rollout") > 2 and moves(plans)[0] == ("trainer", "rollout")


def test_cold_start_cells_return_at_the_first_readiness_unless_rollout_needs_them():
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    # Lend three; the first boundary shows a full next batch (no generation deficit): all
    # three return at once, to the cells they came from, and the trainer's width is back.
    planner = ERSPlanner(ERSConfig(cold_start_cells=3))
    lent = planner.plan(Signals(cold_start=True), start)
    assert lent.cells.count("rollout") == 5 and lent.rule == "cold_start"
    back = planner.plan(Signals(step=1, gen_rate=1.0, train_rate=1.0), lent.cells)
    assert back.rule == "cold_return" and back.cells == start and len(back.moves) == 3
    assert "3 of 3 lent cells return" in back.reason
    # A generation deficit: as many stay as the rates say rollout needs. Per rollout cell
    # 1.0/5 groups/s, per trainer cell 0.9/3: balance at 8·0.3/0.5 = 4.8 rollout cells, so 3
    # of the lent cells stay (2 own + 3 = 5) ... and none return.
    planner = ERSPlanner(ERSConfig(cold_start_cells=3))
    lent = planner.plan(Signals(cold_start=True), start)
    stay = planner.plan(Signals(step=1, gen_rate=1.0, train_rate=0.9, **GEN), lent.cells)
    assert not stay.moves and stay.cells.count("rollout") == 5
    # Slower generation per cell (balance at 8·0.3/(0.6+0.3) = 2.7): 2 of 3 return.
    planner = ERSPlanner(ERSConfig(cold_start_cells=3))
    lent = planner.plan(Signals(cold_start=True), start)
    some = planner.plan(Signals(step=1, gen_rate=3.0, train_rate=0.9, **GEN), lent.cells)
    assert some.rule == "cold_return" and some.cells.count("rollout") == 3
    assert "balance near 2.7 rollout cells" in some.reason


def test_a_large_deficit_moves_several_cells_sized_by_the_rates():
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    # The trainer waits: 0.5 groups/s per rollout cell, 0.5 per trainer cell → balance at 4
    # rollout cells: two move in one plan (after patience), not one per cooldown.
    gen = dict(GEN, gen_rate=1.0, train_rate=3.0, twt_frac=0.6)
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [gen, gen], start)
    assert [len(p.moves) for p in plans] == [0, 2] and cells.count("rollout") == 4
    assert plans[1].rule == "generation" and "rollout +2 cells" in plans[1].reason
    assert "balance near 4.0 rollout cells" in plans[1].reason
    # With learned_rates, sized by what each size is predicted to buy: 1.0 → 2.0 groups/s at
    # +2 (+3 would leave the trainer at 1.5).
    plans, cells = run(ERSPlanner(ERSConfig(patience=2, learned_rates=True)), [gen, gen], start)
    assert [len(p.moves) for p in plans] == [0, 2] and cells.count("rollout") == 4
    assert "predicted 1 → 2 groups/s" in plans[1].reason
    assert plans[1].effect["predicted_rate_after"] == pytest.approx(2.0)
    # A huge gap is capped at half of the giving role's cells (rounded up), or at the bound.
    far = dict(GEN, gen_rate=0.1, train_rate=6.0)
    plans, cells = run(ERSPlanner(ERSConfig(patience=1)), [far], start)
    assert len(plans[0].moves) == 3
    plans, cells = run(ERSPlanner(ERSConfig(patience=1, max_move_cells=1)), [far], start)
    assert len(plans[0].moves) == 1
    # Rollout throttled half the interval: it could generate twice what arrived. 0.25
    # groups/s per rollout cell measured → 1.0 once throttling is taken out, against 0.25
    # per trainer cell: balance at 1.6 of 8, so three of five rollout cells join the trainer.
    start = CellMap(("rollout",) * 5 + ("trainer",) * 3)
    con = dict(CON, gen_rate=2.5, train_rate=0.75, rwt_frac=0.5)
    plans, cells = run(ERSPlanner(ERSConfig(patience=2, max_ref_cells=0)), [con, con], start)
    assert [(m.src, m.dst) for m in plans[1].moves] == [("rollout", "trainer")] * 3
    assert cells.count("trainer") == 6
    # Without rates a deficit moves one cell, as before.
    plans, _ = run(ERSPlanner(ERSConfig(patience=2, max_ref_cells=0)), [CON, CON], start)
    assert len(plans[1].moves) == 1


def test_rates_predict_a_generation_deficit_a_burst_would_hide():
    """OSWorld-like start: the first groups finish together, so the boundary sees a full batch
    and a trainer that waited; the next sees an empty buffer and a trainer that did not
    wait. Neither is a generation deficit by the buffer's test, but groups arrive at a tenth
    of what the trainer trains: the rates call it, and the move is sized by them."""
    start = CellMap(("rollout",) * 8 + ("trainer",) * 24)
    first = dict(gen_rate=0.13, train_rate=1.7, twt_frac=0.95)  # after the run's start
    second = dict(gen_rate=0.09, train_rate=1.5, twt_frac=0.0)
    planner = ERSPlanner(ERSConfig(patience=2, cold_start_share=0.0))
    assert not planner.plan(Signals(step=0, cold_start=True), start).moves
    p1 = planner.plan(Signals(step=1, **first), start)
    p2 = planner.plan(Signals(step=2, **second), p1.cells)
    assert not p1.moves and p2.rule == "generation" and len(p2.moves) == 12  # half of 24
    # (The rate read is the two boundaries' mean, 0.11 groups/s: the roles did not change.)
    assert "the trainer would wait 93% of its steps" in p2.reason
    # A consumption deficit at the run's first boundary does not count (its step compiled):
    # with patience 2 nothing moves at the second boundary.
    planner = ERSPlanner(ERSConfig(patience=2, max_ref_cells=0, cold_start_share=0.0))
    planner.plan(Signals(step=0, cold_start=True), start)
    p1 = planner.plan(Signals(step=1, **CON), start)
    p2 = planner.plan(Signals(step=2, **CON), start)
    p3 = planner.plan(Signals(step=3, **CON), start)
    assert not p1.moves and not p2.moves and p3.rule == "consumption"
    # Rates near the balance predict nothing.
    calm = dict(gen_rate=1.0, train_rate=1.1)
    plans, _ = run(ERSPlanner(ERSConfig(patience=1)), [calm] * 5, start)
    assert not moves(plans)


def test_multi_cell_moves_keep_the_hysteresis():
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    gen = dict(GEN, gen_rate=1.0, train_rate=3.0)
    con = dict(CON, gen_rate=4.0, train_rate=1.0, rwt_frac=0.5)
    cfg = ERSConfig(patience=2, cooldown=4, max_ref_cells=0)
    # Noise around the balance moves nothing, however large the rates make each side look.
    plans, cells = run(ERSPlanner(cfg), [gen, con] * 8, start)
    assert not moves(plans) and cells == start
    # A move is not undone within the cooldown, even by a large opposite deficit.
    plans, _ = run(ERSPlanner(cfg), [gen, gen] + [con] * 8, start)
    first, undo = [i for i, p in enumerate(plans) if p.moves][:2]
    assert plans[first].moves[0].dst == "rollout" and plans[undo].moves[0].dst == "trainer"
    assert undo - first >= cfg.cooldown


def test_evaluation_gets_a_preemptive_rollout_cell_that_returns_after_it():
    cells = CellMap(("rollout", "trainer", "trainer"))
    planner = ERSPlanner()
    p1 = planner.plan(Signals(step=10, eval_next=True), cells)
    assert p1.rule == "eval" and p1.moves[0].dst == "rollout"
    p2 = planner.plan(Signals(step=11), p1.cells)
    assert p2.rule == "eval_return" and p2.cells == cells  # the same cell goes back
    # When generation is the deficit after the evaluation, the cell stays in rollout.
    planner = ERSPlanner()
    p1 = planner.plan(Signals(step=10, eval_next=True), cells)
    p2 = planner.plan(Signals(step=11, **GEN), p1.cells)
    assert p2.rule != "eval_return" and p2.cells.count("rollout") == 2


def test_ras_above_break_even_provisions_a_decoupled_ref():
    costs = PhaseCosts(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=1.0)
    be = break_even_ras(8, 10.0, costs)
    assert 0 < be <= 8
    # Below the break-even the cost model says colocated, from it on decoupled.
    assert choose_mode(predicted_ready_times(8, be - 1, 10.0), costs).mode == "colocated"
    assert choose_mode(predicted_ready_times(8, be, 10.0), costs).mode == "decoupled"
    colocated = CellMap(("rollout", "rollout", "trainer"))
    sig = dict(uses_ref=True, ras_next=be, break_even_ras=be, ra2p_mode="decoupled",
               above_break_even=True, deficit_reason=f"RAS {be} ≥ break-even {be}")
    planner = ERSPlanner(ERSConfig(patience=2))
    plans, cells = run(planner, [sig, sig], colocated)
    assert moves(plans) == [("rollout", "ref")] and plans[-1].ref_mode == "decoupled"
    # With the Ref serving, the same backlog is no deficit: nothing else moves.
    more = [planner.plan(Signals(**sig), cells) for _ in range(6)]
    assert not [p for p in more if p.moves]
    # A backlog at the break-even alone is no reason to widen the trainer: without a Ref
    # forward to run (no KL term) nothing moves; with data waiting too, the trainer widens.
    nokl = {**sig, "uses_ref": False}
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [nokl, nokl], colocated)
    assert moves(plans) == []
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [{**nokl, **CON}] * 2, colocated)
    assert moves(plans) == [("rollout", "trainer")]
    # An existing Ref cell with nothing to compute goes to rollout at once.
    p = ERSPlanner().plan(Signals(uses_ref=False), START)
    assert p.rule == "no_ref" and p.cells.count("ref") == 0 and p.ref_mode == "colocated"
    # The cost model agrees: with no Ref phase (t_ref = 0) there is nothing to decouple.
    assert choose_mode([0.0] * 8, PhaseCosts(0.0, 1.0, 2.0, 0.0)).mode == "colocated"
    assert break_even_ras(8, 1.0, PhaseCosts(0.0, 1.0, 2.0, 0.0)) == 9


def test_plans_are_deterministic_and_send_cells_home():
    trace = [CON] * 3 + [GEN] * 8 + [CON] * 8
    a, _ = run(ERSPlanner(ERSConfig(cooldown=1)), trace)
    b, _ = run(ERSPlanner(ERSConfig(cooldown=1)), trace)
    assert [(p.cells, p.reason) for p in a] == [(p.cells, p.reason) for p in b]
    # One trainer cell set per width: its meshes recur (and compile once each).
    trainer_sets = {p.cells.cells("trainer") for p in a}
    assert len(trainer_sets) == len({len(t) for t in trainer_sets}) >= 3


def test_keep_split_follows_ra2p_advice_on_fixed_cells():
    ks = KeepSplit(ra2p_live=True, patience=2)
    plans, cells = run(ks, [dict(ra2p_mode="colocated")] * 3)
    assert cells == START and [p.ref_mode for p in plans] == ["decoupled", "colocated",
                                                              "colocated"]
    assert plans[1].rule == "ra2p"
    fixed, _ = run(KeepSplit(), [dict(ra2p_mode="colocated")] * 3)
    assert {p.ref_mode for p in fixed} == {"decoupled"}


@pytest.mark.parametrize("bad", [dict(tau=0), dict(patience=0), dict(min_trainer_cells=0),
                                 dict(min_rollout_cells=2, max_rollout_cells=1),
                                 dict(cold_start_cells=-2), dict(max_move_cells=-1)])
def test_ers_config_errors_name_the_key(bad):
    from tiderl.configlib import ConfigError

    with pytest.raises(ConfigError, match="controller.elastic"):
        ERSConfig(**bad)


# -- readiness signals --------------------------------------------------------------------------
def _group(gid, reward_hi=1.0):
    def t(i, r):
        return Trajectory(task_id=f"{gid}/{i}", group_id=gid, is_eval=False, tokens=[1, 2, 3],
                          loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0],
                          reward=r, end_reason=EndReason.done, turns=1)

    return [t(0, 0.0), t(1, reward_hi)]


def test_buffer_signals_ras_tprm_hol_and_deficits():
    buf = ReadinessBuffer(groups_per_microbatch=2, max_staleness=1, min_ok_per_group=1)
    for k in range(5):  # five groups ready before the step: RAS = 2 micro-batches
        buf.add_group(_group(f"g{k}"), now=float(k))
    r = buf.begin_step(10.0)
    assert r.ras == 2
    taken = buf.take(5, train_version=0)
    for k, t in enumerate((12.0, 13.0, 16.0, 17.0)):  # two more micro-batches, 4 s apart
        buf.add_group(_group(f"h{k}"), now=t)
    taken += buf.take(4, train_version=0)
    r = buf.end_step(r, taken)
    # Micro-batch k is ready with its last group: g1, g3, then (g4, h0), (h1, h2), h3.
    assert r.ready_times == [-9.0, -7.0, 2.0, 6.0, 7.0]
    # Live TPRM: micro-batches became ready at 13 (3 s after the start) and 17 (4 s later).
    assert buf.tprm_ema == pytest.approx(0.7 * 3.0 + 0.3 * 4.0)
    buf.add_group(_group("late"), now=18.0)
    r = buf.boundary(r, 22.0, step_time=12.0, step_time_mean=6.0, twt=0.5, rwt=0.0,
                     batch_ideal=8, tau=0.5, wait_frac=0.15, break_even_ras=3, uses_ref=True)
    assert r.hol_s == 4.0 and r.hol_limit_s == 3.0 and r.consumption_deficit
    assert "head-of-line 4.00s > τ·T_step 3.00s" in r.deficit_reason
    assert r.volume_next == 1 and r.ras_next == 0 and not r.above_break_even
    assert not r.generation_deficit and r.record()["ready_times"] == r.ready_times
    # Next boundary: nothing ready and the trainer waited most of its step.
    buf.take(1, train_version=0)
    r2 = buf.boundary(buf.end_step(buf.begin_step(22.0), []), 30.0, step_time=8.0,
                      step_time_mean=6.0, twt=6.0, rwt=0.0, batch_ideal=8, tau=0.5,
                      wait_frac=0.15, break_even_ras=3, uses_ref=True)
    assert r2.generation_deficit and not r2.consumption_deficit
    assert "0 of B_ideal=8 groups ready" in r2.deficit_reason
    assert r2.gen_rate > 0 and math.isfinite(r2.gen_rate)


def test_the_planner_api_from_buffer_readiness_to_a_move():
    """The documented call a simulator makes: the buffer's boundary readiness →
    `Signals.from_readiness` → `ERSPlanner.plan` → the next step's cells."""
    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=1, min_ok_per_group=1)
    planner, cells = ERSPlanner(ERSConfig(patience=2)), CellMap(("rollout",) * 3 + ("trainer",))
    plan = planner.plan(Signals(step=0, cold_start=True), cells)
    assert plan.moves == () and plan.cells == cells  # the trainer's one cell cannot leave
    plans = []
    for step in range(1, 5):  # the trainer waits most of each step and nothing is ready
        t = 10.0 * step
        r = buf.boundary(buf.end_step(buf.begin_step(t), []), t + 8.0, step_time=8.0,
                         step_time_mean=8.0, twt=7.0, rwt=0.0, batch_ideal=4, tau=0.5,
                         wait_frac=0.25, break_even_ras=2, uses_ref=False)
        plan = planner.plan(Signals.from_readiness(r, step=step, uses_ref=False), cells)
        plans.append(plan)
        cells = plan.cells
    # A generation deficit, but the trainer's last cell is bounded: nothing moves.
    assert all(not p.moves for p in plans) and cells.count("trainer") == 1
    # Data piling up while the trainer is busy: a rollout cell joins the trainer.
    for k in range(6):
        buf.add_group(_group(f"c{k}"), now=50.0 + k)
    for step in range(5, 9):
        t = 10.0 * step
        r = buf.boundary(buf.end_step(buf.begin_step(t), []), t + 8.0, step_time=8.0,
                         step_time_mean=8.0, twt=0.0, rwt=0.0, batch_ideal=4, tau=0.5,
                         wait_frac=0.25, break_even_ras=99, uses_ref=False)
        assert r.consumption_deficit
        plan = planner.plan(Signals.from_readiness(r, step=step, uses_ref=False), cells)
        if plan.moves:
            break
        cells = plan.cells
    assert [(m.src, m.dst) for m in plan.moves] == [("rollout", "trainer")]
    assert plan.rule == "consumption" and "head-of-line" in plan.reason
    assert plan.cells.count("trainer") == 2 and plan.ref_mode == "colocated"


def test_rollout_throttling_is_a_share_of_the_time_since_the_last_boundary():
    """RWT accrues over the weight sync too: 4 s throttled over a 20 s interval (a 2 s step
    after an 18 s sync) is 20%, below wait_frac; over the step alone it would read 200%."""
    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=1, min_ok_per_group=1)
    kw = dict(step_time=2.0, step_time_mean=2.0, twt=0.0, rwt=4.0, batch_ideal=4, tau=10.0,
              wait_frac=0.25, break_even_ras=9, uses_ref=True)
    r = buf.boundary(buf.end_step(buf.begin_step(0.0), []), 2.0, rwt_span=20.0, **kw)
    assert r.rwt_frac == pytest.approx(0.2) and not r.consumption_deficit
    r = buf.boundary(buf.end_step(buf.begin_step(2.0), []), 4.0, rwt_span=8.0, **kw)
    assert r.consumption_deficit and "rollout throttled 4.00s = 50%" in r.deficit_reason


def test_scripted_planner_takes_the_named_roles_at_their_steps_only():
    from tiderl.configlib import ConfigError
    from tiderl.control.ers import make_planner
    from tiderl.control.fixed_plans import ScriptedPlanner

    cfg = ERSConfig(script=("1:rollout,trainer,trainer,trainer,ref",
                            "3:rollout,rollout,trainer,trainer,rollout"))
    planner = make_planner(True, cfg, ra2p_live=False)
    assert isinstance(planner, ScriptedPlanner)
    planner.check(START)
    assert planner.plan(Signals(step=0, cold_start=True), START).cells == START
    p1 = planner.plan(Signals(step=1, **CON), START)
    assert p1.rule == "scripted" and [(m.cell, m.src, m.dst) for m in p1.moves] == [
        (1, "rollout", "trainer")] and p1.ref_mode == "decoupled"
    assert planner.plan(Signals(step=2, **GEN), p1.cells).cells == p1.cells  # kept
    p3 = planner.plan(Signals(step=3), p1.cells)
    assert p3.cells.roles == ("rollout", "rollout", "trainer", "trainer", "rollout")
    assert p3.ref_mode == "colocated"
    with pytest.raises(ConfigError, match="names 4 cells"):
        ScriptedPlanner(["1:rollout,trainer,trainer,trainer"]).check(START)
    with pytest.raises(ConfigError, match="Ref cell"):
        planner.check(START, ref_ok=False)
    for bad in ("rollout,trainer", "x:rollout", "1:rollout,gpu", "1:rollout,rollout"):
        with pytest.raises(ConfigError, match="controller.elastic.script"):
            ERSConfig(script=(bad,))
    with pytest.raises(ConfigError, match="twice"):
        ERSConfig(script=("1:rollout,trainer", "1:trainer,rollout"))


def test_a_ready_backlog_is_a_consumption_deficit_only_while_the_trainer_keeps_busy():
    """The next batch (nearly) ready before its step with a trainer that hardly waited: rollout
    outpaces it and idles behind the staleness bound with stragglers in flight (which RWT,
    counted when nothing is in flight, does not show). The same backlog after a step whose
    trainer waited is no such finding."""
    buf = ReadinessBuffer(groups_per_microbatch=2, max_staleness=1, min_ok_per_group=1)
    for k in range(7):  # 7 of B_ideal = 8 groups ready, all just now (no head-of-line age)
        buf.add_group(_group(f"b{k}"), now=20.0)
    kw = dict(step_time=10.0, step_time_mean=10.0, rwt=0.0, batch_ideal=8, tau=10.0,
              wait_frac=0.25, break_even_ras=99, uses_ref=True)  # τ: no head-of-line finding
    r = buf.boundary(buf.end_step(buf.begin_step(10.0), []), 20.0, twt=1.0, **kw)
    assert r.consumption_deficit and not r.generation_deficit
    assert "7 of B_ideal=8 groups ready before the step" in r.deficit_reason
    r = buf.boundary(buf.end_step(buf.begin_step(20.0), []), 30.0, twt=4.0, **kw)
    assert not r.consumption_deficit  # the trainer waited 40% of its step
    buf.take(2, train_version=0)  # 5 of 8 ready: below (1 − wait_frac)·B_ideal
    r = buf.boundary(buf.end_step(buf.begin_step(30.0), []), 40.0, twt=0.0, **kw)
    assert not r.consumption_deficit and r.volume_next == 5


def test_a_dedicated_ref_only_where_one_cell_keeps_pace_with_the_actor():
    """Decoupled RA2P with one Ref cell: its forward over the batch takes t_ref·m on one cell
    against the Actor's (t_act_f + t_act_b) on m cells, so past m = ref_pace trainer cells the
    Ref would bound the step; then a consumption deficit widens the trainer instead."""
    cells = CellMap(("rollout",) * 4 + ("trainer",) * 4)
    sig = dict(uses_ref=True, ras_next=8, break_even_ras=2, ra2p_mode="decoupled",
               above_break_even=True, deficit_reason="RAS 8 ≥ break-even 2")
    plans, _ = run(ERSPlanner(ERSConfig(patience=2)), [{**sig, "ref_pace": 4.0}] * 2, cells)
    assert moves(plans) == [("rollout", "ref")]
    # A Ref forward a third of the Actor's work: one Ref cell keeps pace with 3 Actor cells.
    slow = {**sig, "ref_pace": 3.0}
    plans, _ = run(ERSPlanner(ERSConfig(patience=2)), [slow] * 4, cells)
    assert moves(plans) == []  # the backlog at the break-even alone asks for a Ref: none pays
    plans, after = run(ERSPlanner(ERSConfig(patience=2)), [{**slow, **CON}] * 2, cells)
    assert moves(plans) == [("rollout", "trainer")] and after.count("ref") == 0


def test_a_latency_bound_generation_deficit_compacts_rollout_into_the_trainer():
    # 8 rollout cells busy 50% of the step while the trainer waits: the same work fits 5
    # engines at 85% busy (8 · 0.5 / 0.85 = 4.7, rounded up), so 3 cells join the trainer,
    # and the plan says what busy share it expects.
    start = CellMap(("rollout",) * 8 + ("trainer",) * 8)
    idle = dict(GEN, gen_rate=1.0, train_rate=3.0, twt_frac=0.6, rollout_busy=0.5)
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)), [idle] * 2, start)
    assert cells.count("rollout") == 5 and moves(plans) == [("rollout", "trainer")]
    p = plans[-1]
    assert p.rule == "compact" and "busy 50%" in p.reason and "trainer +3 cells" in p.reason
    assert p.effect["predicted_rollout_busy"] == pytest.approx(0.8)
    # Half of the giving role's cells at most; compact_busy=0 holds instead.
    plans, cells = run(ERSPlanner(ERSConfig(patience=2)),
                       [dict(idle, rollout_busy=0.1)] * 2, start)
    assert cells.count("rollout") == 4
    plans, cells = run(ERSPlanner(ERSConfig(patience=2, compact_busy=0.0)), [idle] * 2, start)
    assert cells == start and plans[-1].rule == "hold"
    # Right after a generation move, compacting would undo it: the cooldown holds instead.
    planner = ERSPlanner(ERSConfig(patience=1, cooldown=3))
    busy = dict(idle, rollout_busy=0.9)
    plans, cells = run(planner, [busy, busy, idle], start)
    assert [p.rule for p in plans] == ["generation", "keep", "hold"]
    with pytest.raises(ConfigError, match="compact_busy"):
        ERSConfig(compact_busy=1.5)


def test_the_generation_rate_is_the_mean_of_two_boundaries_at_the_same_roles():
    # Alternate steps generate 0.06 and 0.12 groups/s at the same roles (a staleness window's
    # rhythm): the rules read 0.09 from the second boundary on, and one step's rate again
    # right after the roles change.
    cells = CellMap(("rollout",) * 4 + ("trainer",) * 4)
    planner = ERSPlanner()
    seen = []
    planner._plan = lambda s, c: (seen.append(s.gen_rate), ScalingPlan(c))[1]
    for g in (0.06, 0.12, 0.06):
        planner.plan(Signals(step=1, gen_rate=g), cells)
    moved = cells.with_role(7, "rollout")
    planner.plan(Signals(step=4, gen_rate=0.12), moved)
    planner.plan(Signals(step=5, gen_rate=math.nan), moved)
    assert seen[:4] == [0.06, pytest.approx(0.09), pytest.approx(0.09), 0.12]
    assert math.isnan(seen[4])
