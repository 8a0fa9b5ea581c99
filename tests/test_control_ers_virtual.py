"""Role changes through the real controller, CTB and rollout ranks on virtual time (no JAX):
cells leave rollout (their ranks drain, tasks migrate cache-free) and join it again (fresh
ranks join the weight sync), with a tight KV pool; no task is lost, duplicated or altered."""

import asyncio
import tempfile

import looptime
import pytest

from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.config import ControllerConfig
from tiderl.control.controller import Controller, Hooks
from tiderl.control.ers import ERSConfig, ERSPlanner
from tiderl.control.metrics import MetricsSink
from tiderl.control.plans import CellMap, RoleChangeResult, ScalingPlan, moves_between
from tiderl.envs.tasks import TaskSource
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.sim.fakes import FlatTrainer, SimEngine, SimGuessEnv
from tiderl.sim.run import SeedStream
from tiderl.train.dispatch import microbatches

PER_CELL = 2  # rollout ranks per cell


class Scripted:
    """A planner that follows a fixed list of cell maps, one per boundary."""

    def __init__(self, script):
        self.script = list(script)

    def plan(self, signals, cells):
        if signals.cold_start or not self.script:
            return ScalingPlan(cells)
        after = self.script.pop(0)
        return ScalingPlan(after, moves_between(cells, after), reason="scripted", rule="test")


class SteppedEngine(SimEngine):
    """A SimEngine whose every call costs `call_s` of virtual time (the default SimEngine
    costs nothing, so every turn ends at once and a boundary may find no task to move)."""

    call_s = 0.0

    def take_cost_s(self) -> float:
        super().take_cost_s()
        return self.call_s


async def run(planner, cells, *, steps=6, capacity=96, tmp=None, fail_first=False,
              batch=(3, 0), env_step_s=1.5, engine_call_s=0.0):
    tmpl = template_for(ByteTokenizer(), "byte")
    made = []

    async def new_rank(rank_id, weights, version):
        eng = SteppedEngine(seed=7, stop_tokens=tuple(tmpl.stop_ids))
        eng.call_s = engine_call_s
        eng.update_weights(weights, version=version)
        r = RolloutRank(rank_id, eng)
        await r.start()
        made.append(r)
        return r

    slots = [None] * (len(cells.roles) * PER_CELL)
    for c in cells.cells("rollout"):
        for j in range(PER_CELL):
            slots[c * PER_CELL + j] = await new_rank(c * PER_CELL + j, 0, 0)
    # A tight pool: a few tasks per rank, so CTB pauses and migrates.
    sched = make_scheduler("ctb", CTBConfig(action_reserve=1), [capacity] * len(slots),
                           max_context=512, max_tasks_per_rank=8)
    for i, r in enumerate(slots):
        if r is None:
            sched.remove_rank(i)
    env = SimGuessEnv(step_s=env_step_s)
    trainer = FlatTrainer(per_mb_s=0.5)
    changes = []

    async def apply_roles(change, weights):
        changes.append(change)
        if fail_first and len(changes) == 1:
            raise RuntimeError("injected: the device move failed")
        ranks = [await new_rank(rid, weights, change.version)
                 for c in change.joining_rollout() for rid in change.rank_ids(c)]
        return RoleChangeResult(ranks, {"move_s": 0.25, "join_s": 0.0})

    async def sync_weights(weights, version):
        await asyncio.gather(*(r.update_weights(weights, version) for r in manager.ranks
                               if r is not None))

    manager = RolloutManager(slots, sched, env, tmpl, max_turns=4)
    trajs = {}
    buffer = ReadinessBuffer(groups_per_microbatch=1, max_staleness=1, min_ok_per_group=1,
                             zero_var="keep")
    add = buffer.add_group

    def record(ts, *, now):
        for t in ts:
            assert t.task_id not in trajs, f"task {t.task_id} ended twice"
            trajs[t.task_id] = t
        return add(ts, now=now)

    buffer.add_group = record
    cfg = ControllerConfig(steps=steps, groups_per_step=batch[0], min_groups_per_step=batch[1],
                           groups_per_microbatch=1, eval_every=0, console=False,
                           checkpoint_every=0, min_ok_per_group=1)
    metrics = MetricsSink(tmp, console=False)
    controller = Controller(
        cfg, manager=manager, trainer=trainer,
        hooks=Hooks(sync_weights=sync_weights, apply_roles=apply_roles,
                    make_microbatches=lambda seqs, final: microbatches(
                        seqs, n_ranks=1, row_len=128, rows_per_rank=8, final=True)[0]),
        train_stream=SeedStream(TaskSource("default", "train", groups=1000, group_size=4)),
        eval_groups=[], metrics=metrics, buffer=buffer, planner=planner, cells=cells,
        ranks_per_cell=PER_CELL)
    summary = await controller.run()
    for r in made:
        await r.close()
    return {"summary": summary, "records": list(metrics.records), "trajs": trajs,
            "changes": changes, "manager": manager, "made": made}


def go(coro):
    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
        asyncio.set_event_loop(None)


START = CellMap(("rollout", "rollout", "trainer"))


def test_cells_leave_and_rejoin_rollout_without_losing_or_altering_a_task():
    script = [CellMap(("rollout", "trainer", "trainer")),   # rollout → trainer (drain)
              CellMap(("rollout", "trainer", "trainer")),
              CellMap(("rollout", "rollout", "trainer")),   # trainer → rollout (join)
              CellMap(("trainer", "rollout", "trainer")),   # another cell drains
              CellMap(("rollout", "rollout", "trainer"))]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        # Engine calls cost virtual time, so tasks are mid-episode when a cell drains.
        moved = go(run(Scripted(script), START, tmp=a, engine_call_s=0.05))
        still = go(run(Scripted([]), START, tmp=b, engine_call_s=0.05))
    steps = [r for r in moved["records"] if r["kind"] == "step"]
    changes = [r for r in moved["records"] if r["kind"] == "role_change"]
    assert len(steps) == 6 and len(changes) == 4 and len(moved["changes"]) == 4
    assert [r["rollout_cells"] for r in steps][:5] == [1, 1, 2, 1, 2]
    # Draining moved live tasks (some held KV there: handoffs), and cost was measured.
    assert sum(c["tasks_migrated"] for c in changes) > 0
    assert sum(c["handoffs"] for c in changes) > 0
    assert all(c["drain_s"] >= 0 and c["move_s"] == 0.25 for c in changes)
    assert {c["reason"] for c in changes} == {"scripted"}
    trained = [g for r in steps for g in r["group_ids"]]
    assert len(trained) == len(set(trained))  # no group trained twice
    m = moved["manager"].stats()
    assert m["tasks_submitted"] == m["tasks_ended"] + m["tasks_live"]
    assert set(m["end_reasons"]) <= {"done", "turn_limit", "cancelled"}
    assert m["decisions"]["migrate"] > 0
    # A moved trajectory is token for token what it is without moves (sampling is keyed by
    # task and position, the env by the task): every task both runs finished agrees.
    both = set(moved["trajs"]) & set(still["trajs"])
    assert len(both) >= 12
    for tid in both:
        x, y = moved["trajs"][tid], still["trajs"][tid]
        assert (x.tokens, x.loss_mask, x.reward) == (y.tokens, y.loss_mask, y.reward), tid
    # Drained ranks were stopped; the slots of cell 1 hold fresh ranks again at the end.
    assert len(moved["made"]) == 4 + 2 * 2


@pytest.mark.parametrize("capacity", [64, 4096])
def test_ers_planner_runs_a_job_on_virtual_time(capacity):
    """The real planner in the loop: a job with a tight or a roomy pool finishes, every plan
    keeps its bounds, and each change is logged with its reason."""
    with tempfile.TemporaryDirectory() as tmp:
        out = go(run(ERSPlanner(ERSConfig(patience=1, cooldown=1, cold_start_cells=1)),
                     CellMap(("rollout", "rollout", "trainer", "trainer")), steps=8,
                     capacity=capacity, tmp=tmp))
    steps = [r for r in out["records"] if r["kind"] == "step"]
    assert len(steps) == 8 and out["summary"]["ended"].startswith("completed")
    changes = [r for r in out["records"] if r["kind"] == "role_change"]
    assert changes and changes[0]["rule"] == "cold_start"  # the buffer starts empty
    # The lent cell returns at the first readiness, or stays on a generation deficit.
    assert changes[0]["cells"]["trainer"] == [2]
    assert steps[0]["plan_rule"] in ("cold_return", "keep", "generation")
    for r in steps:
        assert r["rollout_cells"] >= 1 and r["trainer_cells"] >= 1
        assert r["rollout_cells"] + r["trainer_cells"] + r["ref_cells"] == 4
    for c in changes:
        assert c["reason"] and c["moves"] and "drain_s" in c


def test_a_failed_role_change_is_reverted_and_the_run_goes_on():
    script = [CellMap(("rollout", "trainer", "trainer"))]
    with tempfile.TemporaryDirectory() as tmp:
        out = go(run(Scripted(script), START, tmp=tmp, fail_first=True, steps=4))
    steps = [r for r in out["records"] if r["kind"] == "step"]
    failed = [r for r in out["records"] if r["kind"] == "role_change_failed"]
    assert len(steps) == 4 and len(failed) == 1 and failed[0]["reason"] == "scripted"
    # The revert brought the drained cell back: its two ranks serve again, fresh.
    assert [c.reason for c in out["changes"]] == ["scripted", "revert"]
    assert all(r["rollout_cells"] == 2 and r["rollout_ranks"] == 4 for r in steps)
    m = out["manager"].stats()
    assert m["tasks_submitted"] == m["tasks_ended"] + m["tasks_live"]


def test_elastic_batch_trains_on_b_min_rather_than_wait_and_retains_data():
    """B_min = 2 of B_ideal = 6. With one slow rollout cell, rollout cannot sustain the
    trainer's consumption: steps end with B_min..B_ideal groups instead of waiting for six,
    and the fetch target drops to B_min (adaptive data retention). With three fast rollout
    cells the trainer fetches full batches. With B_min = B_ideal every batch is full."""
    with tempfile.TemporaryDirectory() as tmp:
        slow = go(run(Scripted([]), CellMap(("rollout", "trainer")), tmp=tmp, steps=8,
                      batch=(6, 2), env_step_s=10.0))
    steps = [r for r in slow["records"] if r["kind"] == "step"]
    assert len(steps) == 8 and all(2 <= r["groups"] <= 6 for r in steps)
    # The retention rule compares the generation rate with the trainer's per-group compute;
    # this slow cell sits near that line, and a boundary right after a burst of finished
    # groups (the rate is measured over two boundaries) reads as sustaining: measured, 5 of
    # the 7 boundaries after the first fetch B_min here (7 of 7 before the rollout ran
    # deferred scheduling rounds, which lets the cell generate a little faster).
    fetched = [r["fetch_next"] for r in steps[1:]]
    assert set(fetched) <= {2, 6} and fetched[0] == 2 and fetched.count(2) >= 4, fetched
    assert all(r["ready_next"] < 6 for r in steps)  # it never had six to take
    with tempfile.TemporaryDirectory() as tmp:
        fast = go(run(Scripted([]), CellMap(("rollout", "rollout", "rollout", "trainer")),
                      tmp=tmp, steps=5, batch=(6, 2), env_step_s=0.2))
    steps = [r for r in fast["records"] if r["kind"] == "step"]
    assert all(r["fetch_next"] == 6 for r in steps) and [r["groups"] for r in steps][1:] == \
        [6] * 4
    with tempfile.TemporaryDirectory() as tmp:
        full = go(run(Scripted([]), CellMap(("rollout", "trainer")), tmp=tmp, steps=3,
                      batch=(6, 0), env_step_s=3.0))
    assert {r["groups"] for r in full["records"] if r["kind"] == "step"} == {6}
