"""CTB scheduling properties over random workloads (hypothesis), and targeted cases."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tiderl.configlib import ConfigError
from tiderl.serving.ctb import (
    Admit,
    CTBConfig,
    CTBScheduler,
    Pause,
    Resume,
    Task,
    VanillaScheduler,
)

CFG = CTBConfig(action_reserve=8, env_concurrency=40, budget_fraction=1.0)


class CheckedCTB(CTBScheduler):
    """Records, at the moment of each resume, whether the affinity rank had headroom."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.affinity_violations: list[str] = []

    def resume_rank(self, t, ranks):
        home = self.affinity(t)
        home_fits = home is not None and home in ranks and (
            self.usage(home, Task(**{**t.__dict__})) <= self.budget(home))
        rank = super().resume_rank(t, ranks)
        if home_fits and rank != home:
            self.affinity_violations.append(t.task_id)
        return rank


workloads = st.fixed_dictionaries({
    "ranks": st.integers(1, 3),
    "capacity": st.integers(300, 900),
    "groups": st.lists(
        st.fixed_dictionaries({
            "size": st.integers(1, 4),
            "prompt": st.integers(10, 60),
            "turns": st.integers(1, 5),
            "growth": st.integers(5, 40),
            "eval": st.booleans(),
        }),
        min_size=1, max_size=8,
    ),
    "seed": st.integers(0, 10_000),
    "horizon": st.sampled_from([None, 1, 5]),
    "unsized": st.booleans(),
    "shared": st.booleans(),
    "page": st.sampled_from([1, 8]),
    "busy": st.sampled_from([0.0, 0.5, 1.0]),
    "park_min_wait": st.sampled_from([0.0, 0.5]),
    "overcommit": st.sampled_from([1.0, 3.0]),
    "budget_fraction": st.sampled_from([1.0, 0.8]),
})


def check_round(s: CTBScheduler, decisions, before: dict[str, str], executing: set[str]):
    s._check_indexes()
    ids = list(s.tasks)
    # No task lost or duplicated: each id in exactly one place, queue entries unique.
    queued = [tid for tids in s.queue.values() for tid in tids]
    assert len(queued) == len(set(queued))
    for tid in ids:
        t = s.tasks[tid]
        assert (tid in queued) == (t.state == "new"), tid
        if t.state == "active":
            assert t.rank is not None and t.rank in s.live_ranks()
    # Each decision matches the task's state before the round.
    for d in decisions:
        if isinstance(d, Admit):
            assert before[d.task_id] == "new"
        elif isinstance(d, Resume):
            assert before[d.task_id] in ("paused", "active")  # active: paused earlier this round
        elif isinstance(d, Pause):
            assert before[d.task_id] == "active" or any(
                isinstance(e, Resume) and e.task_id == d.task_id for e in decisions)
            # A task inside its prefill/decode finishes that turn on its rank: never paused.
            assert d.task_id not in executing, d
    # Budgets hold (workloads keep every single task below a rank's budget), except on a rank
    # where only executing tasks are left to pause: a later round pauses them.
    for r in s.live_ranks():
        on = s.active_on(r)
        assert s.usage(r) <= s.budget(r) or len(on) == 1 or all(t.executing for t in on), (
            r, s.usage(r), s.budget(r))
    # Paused tasks are resumed before new ones are admitted: no paused task would have fit on a
    # rank in the room that this round's non-eval admissions took (a new eval task outranks a
    # paused non-eval one and may preempt it). A task parked by the release valve is the
    # exception while its environment still has it waiting: it needs no room until it answers.
    admitted = {d.task_id for d in decisions
                if isinstance(d, Admit) and not s.tasks[d.task_id].is_eval}
    for r in {d.rank for d in decisions if d.task_id in admitted}:
        kept = [t for t in s.active_on(r) if t.task_id not in admitted]
        for p in (t for t in s.tasks.values() if t.state == "paused" and not t.parked):
            assert s._usage_of(kept + [p]) > s.budget(r), (p.task_id, r)
    # Only tasks waiting on their environment are parked, never evals, and a parked task is
    # unparked as soon as its environment answers.
    for d in decisions:
        if isinstance(d, Pause) and d.parked:
            t = s.tasks[d.task_id]
            assert not t.is_eval and d.task_id not in executing
    for t in s.tasks.values():
        # (Before its first observation a task may not have called its environment yet.)
        assert not t.parked or (t.state == "paused" and not t.ready and not t.executing
                                and t.turns > 0)
    # Eval tasks are paused only when even evicting every non-eval task that is not executing
    # would not make room.
    for p in (t for t in s.tasks.values() if t.state == "paused" and t.is_eval):
        for r in s.live_ranks():
            kept = [t for t in s.active_on(r) if t.is_eval or t.executing]
            assert s._usage_of(kept + [p]) > s.budget(r)


def _group(size, prompt=10, growth=5, is_eval=False):
    return {"size": size, "prompt": prompt, "turns": 1, "growth": growth, "eval": is_eval}


# Found by the search: evals admitted to a full rank preempt a non-eval task there, and the
# round then admitted a new non-eval task on the other rank, where the preempted one fit.
PREEMPTED_OVERTAKEN = {
    "ranks": 2, "capacity": 300, "seed": 73, "horizon": None, "unsized": True,
    "shared": False, "page": 1, "busy": 0.0, "park_min_wait": 0.0, "overcommit": 1.0,
    "budget_fraction": 1.0,
    "groups": [_group(3, is_eval=True), _group(3, is_eval=True), _group(2), _group(1),
               _group(1, prompt=20, growth=40), _group(1), _group(1), _group(1)]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
@example(PREEMPTED_OVERTAKEN)
def test_ctb_invariants_under_random_workloads(w):
    rng = random.Random(w["seed"])
    max_ctx = max(g["prompt"] + g["turns"] * g["growth"] for g in w["groups"])
    bf = w["budget_fraction"]
    # One task always fits a rank's budget.
    cap = max(w["capacity"], math.ceil((max_ctx + CFG.action_reserve) / bf))
    cfg = dataclasses.replace(CFG, shared_prompts=w["shared"], wait_samples=2,
                              park_min_wait=w["park_min_wait"], overcommit_max=w["overcommit"],
                              budget_fraction=bf)
    s = CheckedCTB(cfg, [cap] * w["ranks"], max_context=max_ctx + 1, page_size=w["page"])
    s.horizon_turns = w["horizon"]  # growth planning on (a turn limit) or off
    now = [0.0]
    s.set_clock(lambda: now[0])
    # Engines with time to spare let CTB park tasks waiting on their environment.
    s.engine_busy = [w["busy"]] * w["ranks"]
    turns_left: dict[str, int] = {}
    growth: dict[str, int] = {}
    prompt: dict[str, int] = {}
    for gi, g in enumerate(w["groups"]):
        # Unsized: the runner's case, prompt length unknown until the first turn reports it.
        tasks = [Task(task_id=f"g{gi}t{j}", group_id=f"g{gi}",
                      prompt_tokens=0 if w["unsized"] else g["prompt"],
                      is_eval=g["eval"], task_type=f"type{gi % 2}") for j in range(g["size"])]
        s.submit(tasks)
        for t in tasks:
            turns_left[t.task_id] = g["turns"]
            growth[t.task_id] = g["growth"]
            prompt[t.task_id] = g["prompt"]
    killed = False
    for _ in range(600):
        before = {tid: t.state for tid, t in s.tasks.items()}
        executing = {tid for tid, t in s.tasks.items() if t.executing}
        decisions = s.schedule()
        check_round(s, decisions, before, executing)
        active = [t for t in s.tasks.values() if t.state == "active"]
        # A parked task's environment call is in flight: it answers whatever the scheduler
        # does, so it stays an event source while paused.
        waiting = [t for t in s.tasks.values() if t.state == "paused" and t.parked]
        if not active and not waiting:
            assert all(t.state == "done" for t in s.tasks.values()), "stalled with work left"
            break
        t = rng.choice(active + waiting)
        now[0] += rng.expovariate(4.0)
        event = rng.random()
        if t.state == "paused" or (not t.executing and not t.ready and event < 0.3):
            # Its environment answers with the next observation: it wants the engine.
            if turns_left[t.task_id] == 0:
                s.finish(t.task_id)
            else:
                turns_left[t.task_id] -= 1
                size = t.tokens if t.measured else prompt[t.task_id]
                s.update_usage(t.task_id, size + growth[t.task_id], ready=True)
        elif event < 0.15:
            s.set_executing(t.task_id, not t.executing)
        elif turns_left[t.task_id] == 0:
            s.finish(t.task_id)
        else:
            # A turn starts executing (its context grows, possibly past the budget) and, as
            # often as not, is still executing at the next round.
            turns_left[t.task_id] -= 1
            size = t.tokens if t.measured else prompt[t.task_id]
            s.update_usage(t.task_id, size + growth[t.task_id], executing=True)
            if rng.random() < 0.5:
                s.set_executing(t.task_id, False)
        if 0.93 < event <= 0.95:
            # The engines' busy share moves: with overcommit, budgets stretch and shrink.
            s.engine_busy = [rng.choice([w["busy"], 0.25, 1.0]) for _ in range(w["ranks"])]
        if not killed and w["ranks"] > 1 and event > 0.97:
            s.remove_rank(w["ranks"] - 1)
            killed = True
        s._check_indexes()
    else:
        raise AssertionError("workload did not finish in 600 events")
    assert s.affinity_violations == []
    assert sum(s.group_done.values()) == len(s.tasks)


def test_over_budget_pauses_lowest_priority_and_resumes_on_affinity():
    s = CTBScheduler(CTBConfig(action_reserve=0, budget_fraction=1.0), [100, 100],
                     max_context=100)
    s.submit([Task(task_id=n, group_id=n.upper(), prompt_tokens=30) for n in "abcd"])
    s.schedule()
    on0 = sorted(t.task_id for t in s.active_on(0))
    assert len(on0) == 2
    big, small = on0
    s.update_usage(big, 60)
    s.update_usage(small, 45)
    s.update_usage(next(t.task_id for t in s.active_on(1)), 90)  # rank 1 has no headroom
    got = s.schedule()
    # The shorter context is the lower tier: it is paused; it fits nowhere, so it stays paused.
    assert Pause(small, 0) in got and s.tasks[small].state == "paused"
    s.finish(next(t.task_id for t in s.active_on(1)))
    s.finish(big)
    got = s.schedule()
    # Both ranks have room now; the task resumes where its KV may still be resident.
    assert Resume(small, 0, False) in got


def test_eval_preempts_and_group_completion_outranks_activity():
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id=f"g{i}", group_id="G", prompt_tokens=10) for i in range(2)])
    s.submit([Task(task_id="x", group_id="X", prompt_tokens=10)])
    s.schedule()
    s.finish("g0")
    s.set_executing("x", True)
    # g1's group is half done: it outranks x, which is executing but from an empty group.
    assert s.priority(s.tasks["g1"]) > s.priority(s.tasks["x"])
    s.submit([Task(task_id="e", group_id="E", prompt_tokens=95, is_eval=True)])
    # x is inside its turn, so it cannot be paused; pausing g1 alone leaves no room: e waits.
    assert s.schedule() == []
    s.set_executing("x", False)
    got = s.schedule()
    # It only fits once both non-eval tasks are paused: the lower tier (x) goes first.
    assert got == [Pause("x", 0), Pause("g1", 0), Admit("e", 0)]


def test_over_budget_never_pauses_an_executing_task():
    # Pausing a task mid-turn would resume it elsewhere while the turn still runs here.
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id=f"g{i}", group_id="G", prompt_tokens=20) for i in range(2)])
    s.submit([Task(task_id="x", group_id="X", prompt_tokens=20)])
    s.schedule()
    s.finish("g0")
    s.update_usage("g1", 30)
    s.update_usage("x", 80, executing=True)  # its growing context pushes the rank over
    # x is the lowest priority (its group is not started) but executing: g1 goes instead.
    assert s.priority(s.tasks["x"]) < s.priority(s.tasks["g1"])
    assert s.schedule() == [Pause("g1", 0)]
    assert s.tasks["x"].state == "active" and s.usage(0) == 80
    s._check_indexes()


def test_rank_of_executing_tasks_stays_over_budget_until_a_turn_ends():
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id=n, group_id=n.upper(), prompt_tokens=20) for n in "ab"])
    s.schedule()
    s.update_usage("a", 60, executing=True)
    s.update_usage("b", 60, executing=True)
    assert s.schedule() == [] and s.usage(0) == 120  # nothing it may pause
    s.set_executing("a", False)
    assert s.schedule() == [Pause("a", 0)]
    s._check_indexes()


def test_a_task_grown_past_the_budget_still_runs_alone():
    # Budget 85 of a 100-token pool: a task that grew to 90 is paused while another runs, and
    # must come back once its rank is empty, or it (and its group) would wait forever.
    cfg = CTBConfig(action_reserve=0, budget_fraction=0.85, plan_growth=False)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id=n, group_id=n.upper(), prompt_tokens=20) for n in "ab"])
    s.schedule()
    s.update_usage("b", 30, executing=True)
    s.update_usage("a", 90)
    assert s.schedule() == [Pause("a", 0)]  # b is executing: a makes way
    s.finish("b")
    assert s.schedule() == [Resume("a", 0, False)]  # alone on its rank, over budget
    s.submit([Task(task_id="c", group_id="C", prompt_tokens=95)])  # larger than the budget
    assert s.schedule() == []
    s.finish("a")
    assert s.schedule() == [Admit("c", 0)]
    s._check_indexes()


def test_eval_preemption_never_pauses_an_executing_task():
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id=f"g{i}", group_id="G", prompt_tokens=30) for i in range(2)])
    s.submit([Task(task_id="x", group_id="X", prompt_tokens=30)])
    s.schedule()
    s.finish("g0")
    s.set_executing("x", True)
    s.submit([Task(task_id="e", group_id="E", prompt_tokens=60, is_eval=True)])
    # Pausing either task makes room; x is the lower tier but executing, so g1 is paused.
    assert s.schedule() == [Pause("g1", 0), Admit("e", 0)]
    s._check_indexes()


def test_paused_eval_preempts_only_tasks_between_turns():
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False)
    s = CTBScheduler(cfg, [100], max_context=100)
    s.submit([Task(task_id="e", group_id="E", prompt_tokens=10, is_eval=True)])
    s.submit([Task(task_id=f"g{i}", group_id="G", prompt_tokens=10) for i in range(2)])
    s.submit([Task(task_id="x", group_id="X", prompt_tokens=10)])
    s.schedule()
    s.finish("g0")
    s.update_usage("e", 40)
    s.update_usage("g1", 30, executing=True)
    s.update_usage("x", 40, executing=True)
    # Over budget and only the eval task is between turns: it is the one paused, and it
    # cannot preempt tasks that are executing.
    assert s.schedule() == [Pause("e", 0)]
    s.set_executing("g1", False)
    # g1's turn ended: the eval preempts it (not x, the lower tier, which is still executing).
    assert s.priority(s.tasks["x"]) < s.priority(s.tasks["g1"])
    assert s.schedule() == [Pause("g1", 0), Resume("e", 0, False)]
    assert s.tasks["x"].state == "active"
    s._check_indexes()


def test_finishing_queued_tasks_leaves_no_broken_queue():
    # A task cancelled before admission is finished while still queued; its group's other
    # tasks may still run. The next rounds must neither crash nor admit it.
    for kind in (CTBScheduler, VanillaScheduler):
        s = kind(CTBConfig(action_reserve=0), [1000], max_context=1000)
        s.submit([Task(task_id=f"b{i}", group_id="B", prompt_tokens=10) for i in range(2)])
        s.set_admission_limit(1)
        assert [d.task_id for d in s.schedule()] == ["b0"]
        s.finish("b1")  # B's last queued task: B is still running, with nothing queued
        s.set_admission_limit(None)
        s.submit([Task(task_id="c0", group_id="C", prompt_tokens=10)])
        assert [d.task_id for d in s.schedule()] == ["c0"], kind
        assert s.pending() == 0
        s._check_indexes()


def test_queued_tasks_are_integrated_over_time_beside_the_live_phases():
    # Tasks submitted and not admitted yet are in no live phase; their time-integral is what
    # tells a planner that tasks wait for admission (engine or KV room), not on the window.
    now = [0.0]
    for kind in (CTBScheduler, VanillaScheduler):
        now[0] = 0.0
        s = kind(CTBConfig(action_reserve=0), [1000], max_context=1000)
        s.set_clock(lambda: now[0])
        s.submit([Task(task_id=f"t{i}", group_id="A", prompt_tokens=10) for i in range(4)])
        s.set_admission_limit(2)
        now[0] = 1.0
        assert len(s.schedule()) == 2  # 4 queued over [0, 1]
        now[0] = 3.0
        s.set_admission_limit(None)
        assert len(s.schedule()) == 2  # 2 queued over [1, 3]
        s.phases.advance(5.0)
        assert s.phases.queued == 0 and s.n_queued() == 0
        assert s.phases.queued_seconds == pytest.approx(4 * 1.0 + 2 * 2.0), kind
        assert sum(s.phases.counts.values()) == 4  # all live now, in a phase
        s._check_indexes()


def test_vanilla_caps_concurrency_and_never_pauses():
    s = VanillaScheduler(CTBConfig(vanilla_concurrency=3), [10, 10], max_context=100)
    s.submit([Task(task_id=f"t{i}", group_id=f"g{i // 2}", prompt_tokens=50) for i in range(6)])
    got = s.schedule()
    assert len(got) == 3 and all(isinstance(d, Admit) for d in got)
    s.finish(got[0].task_id)
    got2 = s.schedule()
    assert len(got2) == 1 and isinstance(got2[0], Admit)


def test_staleness_throttle_and_quarantine():
    s = CTBScheduler(CTBConfig(action_reserve=0), [1000, 1000], max_context=100)
    s.submit([Task(task_id=f"t{i}", group_id=f"g{i}", prompt_tokens=10) for i in range(5)])
    s.set_admission_limit(2)
    assert len(s.schedule()) == 2
    s.set_admission_limit(None)
    got = s.schedule()
    assert len(got) == 3
    moved = s.remove_rank(0)
    got = s.schedule()
    assert {d.task_id for d in got} >= set(moved)
    assert all(d.rank == 1 for d in got)


def test_unsized_groups_send_one_probe_first_and_prompts_count_per_task():
    # The runner submits tasks with prompt_tokens=0 (the size is known only after /start).
    # Before the fix every task looked 0 tokens big and a whole step was admitted at once.
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False,
                    shared_prompts=False)
    s = CTBScheduler(cfg, [1000], max_context=1000)
    s.submit([Task(task_id=f"a{i}", group_id="A", prompt_tokens=0, task_type="tw")
              for i in range(4)])
    assert [d.task_id for d in s.schedule()] == ["a0"]  # the probe goes alone
    s.update_usage("a0", 300, executing=True)
    got = s.schedule()
    # Siblings are sized by the probe, each holding its own prompt (no fork on this rank):
    # 300 + 300 + 300 fit, a fourth would not.
    assert [d.task_id for d in got] == ["a1", "a2"] and s.usage(0) == 900
    # Another group of the same type is sized by the largest probe of that type.
    s.submit([Task(task_id="b0", group_id="B", prompt_tokens=0, task_type="tw")])
    assert s.footprint(s.tasks["b0"]) == 300
    # A probe that ends before its first turn does not strand its siblings.
    s2 = CTBScheduler(cfg, [1000], max_context=1000)
    s2.submit([Task(task_id=f"c{i}", group_id="C", prompt_tokens=0) for i in range(2)])
    assert [d.task_id for d in s2.schedule()] == ["c0"]
    s2.finish("c0")
    assert [d.task_id for d in s2.schedule()] == ["c1"]


def test_shared_prompts_count_once_per_group():
    cfg = CTBConfig(action_reserve=0, shared_prompts=True)
    s = CTBScheduler(cfg, [1000], max_context=1000)
    s.submit([Task(task_id=f"a{i}", group_id="A", prompt_tokens=100) for i in range(3)])
    s.schedule()
    assert s.usage(0) == 100
    s.update_usage("a1", 150)
    # a1's own 50 tokens; a0 and a2 (no turn yet) are sized by their group's probe (150).
    assert s.usage(0) == 100 + 3 * 50
    s.update_usage("a0", 100)
    s.update_usage("a2", 100)
    assert s.usage(0) == 150


def test_growth_planning_admits_by_projected_size():
    # Tasks of 100 tokens that grow 50 per turn for 9 more turns: by current size 9 fit in
    # 1000 tokens; planned at half their remaining growth (325 each) only 3 do.
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, growth_horizon=0.5)
    s = CTBScheduler(cfg, [1000], max_context=2000)
    s.horizon_turns = 10
    s.submit([Task(task_id=f"t{i}", group_id=f"g{i}", prompt_tokens=100) for i in range(9)])
    first = [d.task_id for d in s.schedule()]
    assert first == ["t0"]  # growth unknown: the first task probes it
    s.update_usage("t0", 100)
    assert s.schedule() == []  # one turn tells no growth yet
    s.update_usage("t0", 150)
    got = [d.task_id for d in s.schedule()]
    assert got == ["t1", "t2"], got
    # Without planning, admission goes by current size and fills the budget at once.
    s2 = CTBScheduler(CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False),
                      [1000], max_context=2000)
    s2.horizon_turns = 10
    s2.submit([Task(task_id=f"t{i}", group_id=f"g{i}", prompt_tokens=100) for i in range(9)])
    assert len(s2.schedule()) == 9


def test_wait_model_expected_remaining_wait():
    from tiderl.serving.taskstats import WaitModel

    w = WaitModel(window=4)
    assert w.remaining(0.0) is None
    for x in (9.0, 1.0, 2.0, 3.0, 4.0):  # the window keeps the last four
        w.add(x)
    assert w.mean == 2.5 and len(w) == 4
    assert w.remaining(0.0) == 2.5
    assert w.remaining(2.5) == 1.0  # E[W - 2.5 | W > 2.5] over {3, 4}
    assert w.remaining(10.0) == 2.5  # longer than any seen: about as long again
    w.add(10.0)  # read above, so a kept mean would be stale now
    assert w.mean == 4.75 and w.remaining(0.0) == 4.75


def _w_paused_for_r(*, typed: bool):
    """One rank of 100 tokens: E executes, W waits on its env, R's env answers and W is
    paused for R's room (W waiting is worth less than R with its observation); R's turn
    runs and R waits on its env again. `typed`: each task is its own task type."""
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False, wait_samples=1,
                    park_min_wait=0.0)
    s = CTBScheduler(cfg, [100], max_context=1000)
    now = [0.0]
    s.set_clock(lambda: now[0])
    s.submit([Task(task_id=n, group_id=n.upper(), prompt_tokens=30,
                   task_type=n if typed else "") for n in ("e", "w", "r")])
    assert len(s.schedule()) == 3
    now[0] = 1.0
    s.update_usage("e", 40, executing=True)
    s.update_usage("w", 40, executing=True)
    s.set_executing("w", False)
    s.update_usage("r", 20, executing=True)
    s.set_executing("r", False)
    now[0] = 1.5
    s.update_usage("r", 50, ready=True)  # 40 + 40 + 50 > 100
    assert s.schedule() == [Pause("w", 0)]
    s.set_executing("r", True)
    s.set_executing("r", False)
    return s, now


def test_release_valve_gives_a_ready_task_the_room_of_a_waiting_one():
    # E executes, W waits on its env, R has its observation: R fits only if W lets go. W is
    # parked (it holds no room while it waits), R runs; a new task may use the room while W's
    # env still has it, but once W's env answers W goes before any new task.
    s, now = _w_paused_for_r(typed=False)
    now[0] = 2.0
    s.update_usage("w", 42, ready=True)  # W's env answered: 40 + 50 + 42 > 100
    assert s.tasks["w"].ready and s.tasks["w"].state == "paused"
    # The engine is saturated (busy share 1.0, the scheduler's start value): running W sooner
    # would add no throughput, and parking R risks its KV; W waits for room.
    assert s.engine_busy == [1.0] and s.schedule() == []
    # The engine has time to spare: W has its observation and R waits, so R is parked and W
    # resumed on the rank holding its KV.
    s.engine_busy = [0.5]
    assert s.schedule() == [Pause("r", 0, parked=True), Resume("w", 0, False)]
    assert s.usage(0) == 82 and s.tasks["r"].parked
    s.submit([Task(task_id="n", group_id="N", prompt_tokens=10, task_type="small")])
    assert s.schedule() == [Admit("n", 0)]  # R is still waiting on its env: no room needed
    s.set_executing("w", True)
    now[0] = 2.5
    s.update_usage("r", 48, ready=True)  # R's env answered
    assert not s.tasks["r"].parked
    s.submit([Task(task_id="m", group_id="M", prompt_tokens=5, task_type="small")])
    # R is ready and fits nowhere (E and W execute, N has not started): no new task is
    # admitted ahead of it, though M would fit.
    assert s.schedule() == []
    s.finish("e")
    assert s.schedule() == [Resume("r", 0, False)]
    s._check_indexes()


def test_release_valve_parks_only_a_task_whose_env_outlasts_the_turn_it_makes_room_for():
    # W (its observation in hand, paused for room) wants R's room while R waits on its env.
    # Parking R pays only if R's env keeps it away for W's whole turn: if it answers sooner,
    # R is back wanting room W now holds, and the room has changed hands for nothing.
    def scene():
        s, now = _w_paused_for_r(typed=True)
        now[0] = 2.0
        s.update_usage("w", 42, ready=True)
        s.engine_busy = [0.5]
        # What the scheduler has learned: R's env answers in `rem` seconds from now, on
        # average; how long W's turns take is set below.
        return s, s.type_stats["r"].waits.remaining(now[0] - s.tasks["r"].since)

    s, rem = scene()
    assert rem == pytest.approx(0.5)
    s.type_stats["w"].turn_s = 0.25  # R stays away longer than W's turn: parked
    assert s.schedule() == [Pause("r", 0, parked=True), Resume("w", 0, False)]
    s, _ = scene()
    s.type_stats["w"].turn_s = 1.0  # R's env would answer mid-turn: W waits for room
    assert s.schedule() == []
    assert not s.tasks["r"].parked and s.tasks["w"].state == "paused"
    s._check_indexes()


def test_within_budget_says_when_a_round_would_pause_nothing_on_a_rank():
    # The rollout lets a task whose env answered start its turn before the next round only
    # while its rank is within budget; past it, the round runs first and pauses down to it.
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False)
    s = CTBScheduler(cfg, [100], max_context=1000)
    s.submit([Task(task_id=n, group_id=n.upper(), prompt_tokens=30) for n in ("a", "b")])
    assert len(s.schedule()) == 2 and s.within_budget(0)
    s.update_usage("a", 40, executing=True)
    s.set_executing("a", False)
    s.update_usage("b", 70, ready=True)  # 40 + 70 > 100
    assert not s.within_budget(0)
    assert s.schedule() == [Pause("a", 0)] and s.within_budget(0)


def test_overcommit_stretches_the_budget_while_the_engine_idles():
    cfg = CTBConfig(action_reserve=0, budget_fraction=1.0, plan_growth=False,
                    overcommit_max=3.0)
    s = CTBScheduler(cfg, [100], max_context=100)
    # Off by default: an idle engine plans with the plain budget.
    off = CTBScheduler(dataclasses.replace(cfg, overcommit_max=1.0), [100], max_context=100)
    off.engine_busy = [0.1]
    assert off.budget(0) == 100
    assert s.budget(0) == 100  # busy all the time (the start's assumption): no stretch
    s.engine_busy = [0.5]
    assert s.budget(0) == 200  # 1 / busy
    s.engine_busy = [0.1]
    assert s.budget(0) == 300  # at most overcommit_max
    s.engine_busy = [0.5]
    s.submit([Task(task_id=f"t{i}", group_id=f"G{i}", prompt_tokens=30) for i in range(8)])
    got = s.schedule()
    assert [d.task_id for d in got if isinstance(d, Admit)] == [f"t{i}" for i in range(6)]
    # The engine gets busy: the budget shrinks back and the tasks waiting on their
    # environment are paused down to it (their KV stays until pages are needed); the one
    # inside its turn is not.
    s.set_executing("t0", True)
    s.engine_busy = [1.0]
    got = s.schedule()
    assert all(isinstance(d, Pause) for d in got) and len(got) == 3
    assert s.tasks["t0"].state == "active" and s.usage(0) <= 100
    with pytest.raises(ConfigError, match="overcommit_max"):
        CTBConfig(overcommit_max=0.5)


def test_the_scheduler_is_what_its_policies_take():
    """The release valve and eval preemption see the scheduler only through their protocols:
    it provides every member they name (and they are objects it owns, not base classes)."""
    from tiderl.serving.preempt import EvalPreemption, PreemptionHost
    from tiderl.serving.valve import ReleaseValve, ValveHost

    s = CTBScheduler(CFG, [100], max_context=100)
    assert isinstance(s, ValveHost) and isinstance(s, PreemptionHost)
    assert isinstance(s.valve, ReleaseValve) and s.valve.host is s
    assert isinstance(s.preemption, EvalPreemption) and s.preemption.host is s
    assert not isinstance(s, ReleaseValve | EvalPreemption)
