"""Task sources: deterministic, shardable, checkpointable group streams; disjoint splits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiderl.envs.config import EnvConfig
from tiderl.envs.tasks import TaskSource, TaskStream, eval_tasks, grain_iterator


def take(it, n):
    return [next(it) for _ in range(n)]


def src(split="train", groups=10, group_size=4, **kw):
    return TaskSource("default", split, groups=groups, group_size=group_size, **kw)


def test_groups_share_a_seed_and_tasks_have_unique_ids():
    stream = TaskStream(src())
    groups = take(stream, 25)  # 2.5 epochs
    ids = [t["task_id"] for g in groups for t in g["tasks"]]
    assert len(ids) == len(set(ids)) == 100
    for g in groups:
        assert [t["member"] for t in g["tasks"]] == [0, 1, 2, 3]
        assert {t["seed"] for t in g["tasks"]} == {g["env_seed"]}
        assert all(t["group_id"] == g["group_id"] for t in g["tasks"])


def test_every_train_epoch_is_a_fresh_permutation_of_the_split():
    groups = take(TaskStream(src()), 30)
    epochs = [[g["env_seed"] for g in groups[i:i + 10]] for i in (0, 10, 20)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert [g["epoch"] for g in groups] == [0] * 10 + [1] * 10 + [2] * 10


def test_streams_are_deterministic_and_seeded():
    a = [g["env_seed"] for g in take(TaskStream(src()), 20)]
    assert a == [g["env_seed"] for g in take(TaskStream(src()), 20)]
    assert a != [g["env_seed"] for g in take(TaskStream(src(task_seed=2)), 20)]


def test_train_and_eval_splits_are_disjoint():
    cfg = EnvConfig(train_groups=500, eval_groups=64, group_size=2)
    train = {t["seed"] for g in TaskStream(TaskSource.from_config(cfg, "train"), num_epochs=1)
             for t in g["tasks"]}
    evals = eval_tasks(cfg)
    assert len(evals) == 128 and len(train) == 500
    assert not train & {t["seed"] for t in evals}
    # Eval runs once, in order.
    assert [t["group_id"] for t in evals[::2]] == [f"eval/e0/g{i}" for i in range(64)]


@pytest.mark.parametrize("shard_count", [1, 3])
def test_shards_are_disjoint_and_cover_the_stream(shard_count):
    whole = [g["group_id"] for g in TaskStream(src(), num_epochs=2)]
    shards = [[g["group_id"] for g in TaskStream(src(), shard_index=s, shard_count=shard_count,
                                                   num_epochs=2)] for s in range(shard_count)]
    assert sorted(sum(shards, [])) == sorted(whole) and len(whole) == 20
    for s, ids in enumerate(shards):
        assert ids == whole[s::shard_count]


@pytest.mark.parametrize("shard", [(0, 1), (1, 3)])
def test_grain_iterator_equals_the_jax_free_stream_and_resumes(shard):
    i, n = shard
    grain_it = grain_iterator(src(), shard_index=i, shard_count=n)
    plain = TaskStream(src(), shard_index=i, shard_count=n)
    assert take(grain_it, 7) == take(plain, 7)
    state = json.loads(json.dumps(grain_it.get_state()))  # JSON-able, as orbax stores it
    assert state == plain.get_state()
    expected = take(grain_it, 5)
    fresh = grain_iterator(src(), shard_index=i, shard_count=n)
    fresh.set_state(state)
    resumed = TaskStream(src(), shard_index=i, shard_count=n)
    resumed.set_state(state)
    assert take(fresh, 5) == expected == take(resumed, 5)


def test_grain_iterator_checkpoints_with_orbax(tmp_path):
    grain = pytest.importorskip("grain")
    ocp = pytest.importorskip("orbax.checkpoint")
    it = grain_iterator(src())
    take(it, 13)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(1, args=ocp.args.Composite(tasks=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        expected = take(it, 4)
        restored = grain_iterator(src())
        mngr.restore(1, args=ocp.args.Composite(tasks=grain.checkpoint.CheckpointRestore(
            restored)))
    assert take(restored, 4) == expected


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="env.train_groups"):
        src(groups=0)
    with pytest.raises(ValueError, match="shard_index"):
        TaskStream(src(), shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="next_index"):
        TaskStream(src()).set_state({"next_index": "x"})


def test_envs_package_imports_without_jax():
    mods = ["tiderl.envs", "tiderl.envs.protocol", "tiderl.envs.config", "tiderl.envs.server",
            "tiderl.envs.client", "tiderl.envs.latency", "tiderl.envs.suites",
            "tiderl.envs.tasks", "tiderl.envs.templates", "tiderl.envs.__main__",
            "tiderl.envs.adapters.base", "tiderl.envs.adapters.default",
            "tiderl.envs.adapters.gym", "tiderl.envs.adapters.textworld",
            "tiderl.envs.adapters.textarena"]
    code = (
        "import sys, importlib\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "from tiderl.envs.tasks import TaskSource, TaskStream\n"
        "next(TaskStream(TaskSource('textworld', 'train', groups=4, group_size=2)))\n"
        "bad = sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'grain') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
