"""Cells moving between rollout, trainer and Ref on 8 fake CPU devices: the trainer's state is
moved exactly (parameters and optimizer state after a scripted sequence of role changes equal a
run without them on the same data), returning to a mesh seen before compiles nothing, and a
cell joining rollout gets a working rollout rank."""

import asyncio

import jax
import numpy as np
import pytest

from tiderl.control.ers import ERSConfig
from tiderl.control.plans import CellMap, RoleChange, moves_between
from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.runtime.devices import CellLayout
from tiderl.runtime.elastic import CellRuntime, CompileWatch
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.train.backend import TrainerBackend
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.ref_actor import dp_size
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
ROLLOUT = RolloutConfig(num_pages=16, page_size=16, max_slots=8, max_context=64,
                        max_action_tokens=2, decode_buckets=(8,), prefill_buckets=(16, 64))
REL_TOL = 1e-6  # fp32: the update differs only by float reassociation across data widths


@pytest.fixture(scope="module")
def policy():
    return init_policy(TINY, seed=0)


class Batcher:
    """Packs each step's sequences for the current data width (as the job's MicroBatcher)."""

    n_ranks, order = 1, "decoupled"

    def __call__(self, trajs):
        # One row per rank: every micro-batch has the same shape at a given width.
        return microbatches(trajs, n_ranks=self.n_ranks, row_len=64, rows_per_rank=1,
                            order=self.order)[0]


def steps_data(n_steps, n_seqs=12):
    return [synthetic_trajectories(n_seqs, vocab=64, min_len=8, max_len=40, seed=s,
                                   versions=(0,)) for s in range(n_steps)]


def rel_diff(a, b):
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return out


def devices_of(tree):
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


@pytest.mark.parametrize("cell", [1, 2])
def test_scripted_role_changes_keep_the_update_exact_and_reuse_compiled_meshes(policy, cell):
    devs = jax.devices()
    # Cells of `cell` devices: one rollout cell, two trainer cells, one Ref cell.
    roles = ("rollout", "trainer", "trainer", "ref")
    layout = CellLayout(cell, tuple(tuple(range(i * cell, (i + 1) * cell)) for i in range(4)),
                        roles)
    cfg = TrainerConfig(actor_devices=2 * cell, fsdp=cell, ref_devices=cell, kl_coef=0.05,
                        lr=3e-3)
    graphdef, params = policy
    data = steps_data(5)
    made: list[RolloutRank] = []

    async def make_rank(rank_id, device, weights, version):
        eng = Engine(graphdef, jax.device_put(weights, device), TINY, ROLLOUT, version=version)
        r = RolloutRank(rank_id, eng)
        await r.start()
        made.append(r)
        return r

    def backend_and_runtime():
        batcher = Batcher()
        probe = CellRuntime(layout, devs, trainer=None, batcher=batcher, make_rank=make_rank,
                            fsdp=cell)
        start = CellMap(roles)
        be = TrainerBackend(cfg, TINY, actor_mesh=probe.actor_mesh(start),
                            ref_mesh=probe.ref_mesh(start, "decoupled"), policy=policy)
        probe.trainer = be
        batcher.n_ranks = dp_size(be.actor_mesh)
        return be, probe, batcher

    # Reference: five steps on the starting meshes.
    ref_be, _, ref_batcher = backend_and_runtime()
    for trajs in data:
        ref_be.train_step(ref_batcher(trajs))
    # Scripted: rollout → trainer, trainer → rollout, Ref → rollout, rollout → Ref.
    be, rt, batcher = backend_and_runtime()
    script = [(("trainer", "trainer", "trainer", "ref"), "decoupled"),
              (roles, "decoupled"),
              (("rollout", "trainer", "trainer", "rollout"), "colocated"),
              (roles, "decoupled")]
    cells = CellMap(roles)
    kernels, widths, compiles, traces = [], [], [], []

    async def change(after, mode, step):
        nonlocal cells
        after = CellMap(after)
        res = await rt.apply_roles(RoleChange(step=step, version=be.version, before=cells,
                                              after=after, moves=moves_between(cells, after),
                                              ref_mode=mode, reason="scripted",
                                              ranks_per_cell=cell),
                                   be.export_weights())
        cells = after
        return res

    async def scenario():
        m = be.train_step(batcher(data[0]))
        # Decoupled phases are timed by completion (dispatch returns at once, nothing
        # serialises the pipeline): the cost model gets the Ref's and the Actor's device time.
        assert m["mode"] == "decoupled" and m["busy_ref"] > 0 and m["busy_actor_bwd"] > 0
        costs = be.cost_model(m_actor=2).costs
        assert costs.t_ref > 0 and costs.t_act_f + costs.t_act_b > 0
        for k, (after, mode) in enumerate(script, start=1):
            res = await change(after, mode, k)
            kernels.append(res.cost["kernels"])
            widths.append(dp_size(be.actor_mesh))
            assert batcher.n_ranks == dp_size(be.actor_mesh)
            assert (be.mode == "decoupled") == (mode == "decoupled")
            if res.ranks:  # a cell joined rollout: one working rank per device
                assert len(res.ranks) == cell and all(r.live for r in res.ranks)
            t0, c0 = dict(be.k.traces), CompileWatch.stats()["compiles"]
            be.train_step(batcher(data[k]))
            traces.append(be.k.traces == t0)
            compiles.append(CompileWatch.stats()["compiles"] - c0)
        for r in made:
            await r.close()

    asyncio.run(scenario())
    assert widths == [3 * cell, 2 * cell, 2 * cell, 2 * cell]
    # Back on the starting meshes (after 2 and 4): cached kernels, no retrace, no compile.
    assert kernels[1] == kernels[3] == "cached"
    assert traces[1] and traces[3] and compiles[1] == compiles[3] == 0, (traces, compiles)
    # State moved exactly: after five steps it equals the run without role changes.
    d_params = rel_diff(be.state["params"], ref_be.state["params"])
    d_opt = rel_diff(be.state["opt"], ref_be.state["opt"])
    print(f"cells of {cell}: relative Δ params {d_params:.1e}, optimizer {d_opt:.1e}; "
          f"kernels {kernels}, compiles per step after a change {compiles}")
    assert d_params <= REL_TOL and d_opt <= REL_TOL
    assert be.version == ref_be.version == 5
    # Where things live now: Actor state on the two trainer cells, Ref on its own cell.
    assert devices_of(be.state) == {devs[d] for d in layout.devices([1, 2])}
    assert devices_of(be.ref_params) == {devs[d] for d in layout.cells[3]}
    mu = be.state["opt"][1][0].mu["embed_vd"][...]  # optimizer moments stay sharded as pinned
    assert mu.sharding.spec == be.state["params"]["embed_vd"][...].sharding.spec == (
        jax.sharding.PartitionSpec(None, "fsdp" if cell > 1 else None))
    for b in (be, ref_be):
        b.close()


def test_set_meshes_refuses_to_change_the_cell_shape(policy):
    devs = jax.devices()
    from tiderl.models.sharding import make_mesh

    be = TrainerBackend(TrainerConfig(actor_devices=2, fsdp=2, kl_coef=0.0), TINY,
                        actor_mesh=make_mesh(devs[:2], fsdp=2), policy=policy)
    with pytest.raises(ValueError, match="only the data axis may change"):
        be.set_meshes(make_mesh(devs[:4], data=1, fsdp=4))
    out = be.set_meshes(make_mesh(devs[:4], data=2, fsdp=2))
    assert set(out) == {"kernels", "move_s"} and dp_size(be.actor_mesh) == 4
    be.close()


def test_world_cells_keep_a_trainer_cell_on_every_process():
    """The cells of two 4-device hosts (as `tests/test_multihost.py` runs them): the trainer
    mesh groups its cells by process, role maps number rollout ranks by cell, and the planner
    never takes a process's last trainer cell."""
    from tiderl.control.ers import ERSPlanner
    from tiderl.control.plans import Signals
    from tiderl.runtime.cells import host_plan
    from tiderl.runtime.devices import cell_layout
    from tiderl.runtime.worldcells import KeepTrainerPerProcess, WorldCells

    plan = host_plan(n_processes=2, local_devices=4, ranks=4, devices_per_rank=1,
                     actor_devices=4, ref_devices=0, fsdp=2, model_parallel=1)
    cells = WorldCells(cell_layout(plan, 2), jax.devices(), local_devices=4, fsdp=2,
                       model_parallel=1)
    start = cells.initial
    assert start.roles == ("rollout", "rollout", "trainer", "trainer")
    assert [cells.process(c) for c in range(4)] == [0, 1, 0, 1]
    joined = CellMap(("rollout", "trainer", "trainer", "trainer"))
    mesh = cells.actor_mesh(joined)  # process 0's cell first, then process 1's two
    assert [[d.id for d in mesh.devices[i].flat] for i in range(3)] == [
        [jax.devices()[i].id for i in ids] for ids in ((2, 3), (4, 5), (6, 7))]
    rm = cells.role_map(start, epoch=3)
    assert rm.epoch == 3 and [(c.process, c.local, c.index) for c in rm.rollout()] == [
        (0, (0,), 0), (0, (1,), 1), (1, (0,), 2), (1, (1,), 3)]
    assert cells.problem(joined) is None
    assert "process(es) [1]" in cells.problem(CellMap(("rollout", "rollout", "trainer",
                                                       "rollout")))
    assert "Ref" in cells.problem(CellMap(("ref", "rollout", "trainer", "trainer")))
    assert cells.last_trainer_cells(start) == {2, 3}
    assert cells.last_trainer_cells(joined) == {2}
    # A generation deficit would send a trainer cell to rollout: with one per process, none
    # may go; with process 1 holding two, one of those goes.
    planner = KeepTrainerPerProcess(ERSPlanner(ERSConfig(patience=1, cooldown=0)), cells)
    planner.plan(Signals(step=0), start)
    gen = dict(generation_deficit=True, deficit_reason="short")
    assert planner.plan(Signals(step=1, **gen), start).cells == start
    planner.plan(Signals(step=2), joined)
    after = planner.plan(Signals(step=3, **gen), joined).cells
    assert after.count("trainer") == 2 and cells.problem(after) is None
