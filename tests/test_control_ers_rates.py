"""ERS learns what a move buys (tiderl/control/ers_rates.py): concave rates from measured
points, the staleness bound, the cost gate and each move's predicted and realised effect.
Synthetic traces, JAX-free."""

import math

import pytest

from tiderl.control.ers import ERSConfig, ERSPlanner
from tiderl.control.ers_rates import RateModel
from tiderl.control.plans import CellMap, Signals

GEN = dict(generation_deficit=True, twt_frac=0.6, deficit_reason="trainer waits")
CON = dict(consumption_deficit=True, deficit_reason="head-of-line")


def test_rates_are_concave_through_the_measured_points():
    m = RateModel()
    assert math.isnan(m.at(m.gen, 3))
    m.observe(n_rollout=2, n_trainer=6, gen_rate=1.0, rwt_frac=0.0, train_rate=3.0)
    # One point: the line through the origin (an upper bound on one more cell's worth).
    assert m.at(m.gen, 4) == pytest.approx(2.0) and m.at(m.gen, 1) == pytest.approx(0.5)
    # A second, wider point that added little: beyond it, the last (flat) secant.
    m.observe(n_rollout=4, n_trainer=4, gen_rate=1.2, rwt_frac=0.0, train_rate=2.0)
    assert m.at(m.gen, 3) == pytest.approx(1.1)
    assert m.at(m.gen, 6) == pytest.approx(1.2 + 0.1 * 2)
    # Throttled rollout is read as what it could make: 0.5 arrived in half the time.
    m.observe(n_rollout=1, n_trainer=7, gen_rate=0.25, rwt_frac=0.5, train_rate=3.5)
    assert m.gen[1] == pytest.approx(0.5)
    # A width seen again moves by an EMA.
    m.observe(n_rollout=4, n_trainer=4, gen_rate=1.6, rwt_frac=0.0, train_rate=2.0)
    assert m.gen[4] == pytest.approx(1.4)


def test_generation_past_consumption_buys_nothing():
    """The staleness bound: generation beyond what the trainer takes only throttles."""
    m = RateModel()
    m.observe(n_rollout=4, n_trainer=4, gen_rate=2.0, rwt_frac=0.0, train_rate=1.0)
    p = m.predict(n_rollout=4, n_trainer=4, delta_rollout=1, step_s=30.0, horizon=5,
                  cost_s=0.0)
    assert p["predicted_rate_before"] == 1.0 and p["predicted_rate_after"] == 0.75
    assert not p["pays"]
    back = m.predict(n_rollout=4, n_trainer=4, delta_rollout=-1, step_s=30.0, horizon=5,
                     cost_s=0.0)
    # One more trainer cell: min(1.5, 1.25) = 1.25 groups/s, 5 steps of 30 s save 30 s.
    assert back["predicted_rate_after"] == pytest.approx(1.25)
    assert back["predicted_saved_s"] == pytest.approx(5 * 30.0 * (1 - 1.0 / 1.25))
    assert back["pays"]


def _run(planner, trace, cells):
    plans = []
    for step, sig in enumerate(trace, start=1):
        p = planner.plan(Signals(step=step, **sig), cells)
        plans.append(p)
        cells = p.cells
    return plans, cells


def test_a_move_is_made_only_when_the_wait_it_saves_exceeds_its_cost():
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    # A step of 2 s (τ·T = 1 s): the best move (+2 rollout: 1 → 2 groups/s) saves
    # 5 · 2 · 0.5 = 5 s over cooldown + patience = 5 steps.
    sig = dict(GEN, gen_rate=1.0, train_rate=3.0, hol_limit_s=1.0)
    plans, cells = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=2), move_cost_s=6.0), [sig, sig], start)
    assert not plans[1].moves and plans[1].rule == "hold" and cells == start
    assert "no move pays" in plans[1].reason
    assert plans[1].effect["predicted_saved_s"] == pytest.approx(5.0)
    # Cheaper than what it saves: it moves, sized by the prediction.
    plans, cells = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=2), move_cost_s=4.0), [sig, sig], start)
    assert plans[1].rule == "generation" and len(plans[1].moves) == 2
    assert cells.count("rollout") == 4 and plans[1].effect["pays"]
    # The caller's measured cost (Signals.move_cost_s) overrides the planner's default.
    dear = dict(sig, move_cost_s=100.0)
    plans, _ = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=2), move_cost_s=1.0), [dear, dear], start)
    assert plans[1].rule == "hold"


def test_a_move_that_bought_little_teaches_the_planner_not_to_repeat_it():
    """Generation bound by environment latency: one more rollout cell barely adds. The first
    move is predicted linearly; the one after it sees the flat secant and holds."""
    start = CellMap(("rollout",) * 2 + ("trainer",) * 6)
    planner = ERSPlanner(ERSConfig(learned_rates=True, patience=1, cooldown=0, max_move_cells=1))
    trace = [dict(GEN, gen_rate=1.0, train_rate=3.0),     # 2 rollout cells: 1.0 groups/s
             dict(GEN, gen_rate=1.05, train_rate=2.5),    # right after the move: not counted
             dict(GEN, gen_rate=1.05, train_rate=2.5)]    # 3 cells made 1.05: it is env-bound
    plans, cells = _run(planner, trace, start)
    assert plans[0].rule == "generation" and plans[0].cells.count("rollout") == 3
    assert plans[0].effect["predicted_rate_after"] == pytest.approx(1.5)
    # Free moves (no cost known) still go where the rates point: 1.05 → 1.1 groups/s.
    assert plans[2].effect["predicted_rate_after"] == pytest.approx(1.1)
    # The realised rate, two boundaries after the move, is logged beside the prediction.
    real = plans[2].effect["realised"]
    assert real["predicted_rate"] == pytest.approx(1.5)
    assert real["realised_rate"] == pytest.approx(1.05)
    assert real["error"] == pytest.approx(1.05 / 1.5 - 1)
    # With steps of 10 s over a horizon of 1 step and moves of 2 s: the first move saves
    # 10 · (1 − 1.0/1.5) = 3.3 s and is made; one more cell now predicts 1.05 → 1.1 groups/s,
    # 0.45 s saved: it holds.
    gated = ERSPlanner(ERSConfig(learned_rates=True, patience=1, cooldown=0, max_move_cells=1), move_cost_s=2.0)
    trace = [dict(t, hol_limit_s=5.0) for t in trace] + [dict(GEN, gen_rate=1.05,
                                                             train_rate=2.5, hol_limit_s=5.0)]
    plans, cells = _run(gated, trace, start)
    assert plans[0].moves and plans[-1].rule == "hold" and cells.count("rollout") == 3
    assert plans[-1].effect["predicted_rate_after"] == pytest.approx(1.1)


def test_a_consumption_move_is_gated_and_sized_too():
    start = CellMap(("rollout",) * 5 + ("trainer",) * 3)
    # Rollout makes 4 groups/s, the trainer trains 1.5: each trainer cell buys 0.5 groups/s
    # until the rollout that is left cannot keep up; best at +2 (min(2.4, 2.5) = 2.4).
    sig = dict(CON, gen_rate=4.0, train_rate=1.5, hol_limit_s=10.0)
    # (The run's first boundary does not count toward patience: its step compiled.)
    plans, cells = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=2, max_ref_cells=0)), [sig] * 3, start)
    assert plans[2].rule == "consumption" and [(m.src, m.dst) for m in plans[2].moves] == [
        ("rollout", "trainer")] * 2
    assert plans[2].effect["predicted_rate_after"] == pytest.approx(2.4)
    assert cells.count("trainer") == 5


def test_the_step_record_carries_the_plan_effect():
    """The controller's step record (the ERS logging path) holds `plan_effect`."""
    from tiderl.control.boundary import ReadinessAware
    from tiderl.control.plans import ScalingPlan

    class Stub(ReadinessAware):
        def __init__(self):
            self.roles = type("R", (), {"cells": CellMap(("rollout", "trainer")),
                                        "ref_mode": "colocated"})()
            self.manager = type("M", (), {"ranks": []})()
            self._advice, self._compiles_at, self._fetch = None, {}, 4
            self.hooks = type("H", (), {"compile_stats": None})()

    plan = ScalingPlan(CellMap(("rollout", "trainer")), rule="hold",
                       effect={"predicted_saved_s": 3.0})
    rec = Stub()._roles_record({"plan": plan})
    assert rec["plan_effect"] == {"predicted_saved_s": 3.0} and rec["plan_rule"] == "hold"


def test_rates_that_show_the_trainer_as_the_bottleneck_move_cells_back():
    """After rollout grew past the balance, the trainer never waits and rollout is not yet
    throttled: no buffer deficit, but the rates say consumption binds; cells go back to the
    trainer, sized by what they buy."""
    start = CellMap(("rollout",) * 6 + ("trainer",) * 2)
    sig = dict(gen_rate=3.0, train_rate=1.0, twt_frac=0.0)
    plans, cells = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=2, max_ref_cells=0)), [sig] * 3, start)
    assert plans[2].rule == "consumption" and "trainer is the bottleneck" in plans[2].reason
    # min(g(4) = 2.0, c(4) = 2.0): two cells, half of the rollout's three movable... capped.
    assert cells.count("trainer") == 4
    # Near the balance the rates find nothing.
    calm = dict(gen_rate=1.0, train_rate=0.9)
    plans, _ = _run(ERSPlanner(ERSConfig(learned_rates=True, patience=1, max_ref_cells=0)), [calm] * 4, start)
    assert not any(p.moves for p in plans)
