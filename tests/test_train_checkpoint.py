"""Orbax checkpoints: save → SIGKILL → resume restores params, optimizer state, step, version,
RNG, Ref params and the data-iterator state bit-exactly; an interrupted write is skipped; a
model or train-state mismatch, or a checkpoint orbax cannot read, is a clear ConfigError."""

import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.sharding import make_mesh
from tiderl.train.backend import TrainerBackend
from tiderl.train.checkpoint import Checkpointer
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
CFG = TrainerConfig(actor_devices=2, kl_coef=0.1)

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 2)
    from tiderl.models.sharding import make_mesh
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.checkpoint import Checkpointer
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories
    from tests.test_train_checkpoint import CFG, TINY

    out = sys.argv[1]
    be = TrainerBackend(CFG, TINY, actor_mesh=make_mesh(jax.devices(), data=2), seed=3)
    ck = Checkpointer(os.path.join(out, "ckpt"), keep=2)
    trajs = synthetic_trajectories(12, vocab=64, min_len=6, max_len=30, seed=0)
    mbs, _ = microbatches(trajs, n_ranks=2, row_len=64, rows_per_rank=2)

    def dump(step, data):
        tree = {"train": be.state, "ref": be.ref_params}
        np.savez(os.path.join(out, f"expect{step}.npz"),
                 *[np.asarray(x) for x in jax.tree.leaves(tree)])
        with open(os.path.join(out, f"expect{step}.json"), "w") as f:
            json.dump({"version": be.version, "data": data}, f)

    for step in range(1, 4):
        be.train_step(mbs)
        data = {"epoch": 0, "cursor": 10 * step, "order": [step, 7, 3]}
        dump(step, data)
        if step < 3:
            ck.save(be, data_state=data, wait=True)
            print("SAVED", step, flush=True)
        else:
            ck.save(be, data_state=data)  # async: files are being written right now
            print("WRITING", step, flush=True)
    while True:  # keep the device busy until the parent kills us
        be.train_step(mbs)
""")


def _backend():
    return TrainerBackend(CFG, TINY, actor_mesh=make_mesh(jax.devices()[:2], data=2), seed=11)


def _check_restored(be, out: Path, step: int, data):
    expect = np.load(out / f"expect{step}.npz")
    meta = json.loads((out / f"expect{step}.json").read_text())
    leaves = jax.tree.leaves({"train": be.state, "ref": be.ref_params})
    assert len(leaves) == len(expect.files)
    for i, x in enumerate(leaves):
        np.testing.assert_array_equal(np.asarray(x), expect[f"arr_{i}"])  # bit-exact
    assert int(be.state["step"]) == step and be.version == meta["version"] == step
    assert data == meta["data"]


@pytest.mark.slow
def test_save_kill_resume_and_interrupted_write(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(repo))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("WRITING"):
                break
        assert lines[-1:] == ["WRITING 3"], (lines, proc.stderr.read() if proc.poll() else "")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    ckpt = tmp_path / "ckpt"
    # Whatever the kill left of step 3 (often a tmp dir), the newest *complete* one is used.
    ck = Checkpointer(ckpt)
    latest = ck.latest_step()
    assert latest in (2, 3)
    print(f"after SIGKILL: newest complete step {latest}, on disk {sorted(os.listdir(ckpt))}")
    be = _backend()
    step, data = ck.restore(be)
    assert step == latest
    _check_restored(be, tmp_path, step, data)
    m = be.train_step(microbatches(synthetic_trajectories(12, vocab=64, min_len=6, max_len=30),
                                   n_ranks=2, row_len=64, rows_per_rank=2)[0])
    assert m["version"] == step + 1  # training continues from the restored state
    ck.close()

    # A write interrupted midway (deterministically: what orbax leaves on a POSIX filesystem,
    # a tmp dir missing files) for a newer step is skipped for the previous complete one.
    partial = ckpt / "7.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(ckpt / str(latest), partial)
    shutil.rmtree(partial / "state")
    ck2 = Checkpointer(ckpt)
    assert ck2.latest_step() == latest
    be2 = _backend()
    step2, data2 = ck2.restore(be2)
    _check_restored(be2, tmp_path, step2, data2)
    ck2.close()


def test_resume_mismatch_is_a_config_error(tmp_path):
    be = _backend()
    ck = Checkpointer(tmp_path / "ck")
    assert ck.restore(be) is None  # empty directory: fresh start
    params0 = jax.tree.map(np.asarray, be.state["params"])
    ck.save(be, data_state={"cursor": 0}, wait=True)
    policy = (be.graphdef, be.state["params"])
    other_model = dataclasses.replace(TINY, rope_theta=500000.0)
    be_m = TrainerBackend(CFG, other_model, actor_mesh=be.actor_mesh, policy=policy)
    with pytest.raises(ConfigError, match=r"model.rope_theta=10000.0 \(now 500000.0\)"):
        ck.restore(be_m)
    be_o = TrainerBackend(dataclasses.replace(CFG, grad_clip=0.0), TINY,
                          actor_mesh=be.actor_mesh, policy=policy)
    with pytest.raises(ConfigError, match="different train state"):
        ck.restore(be_o)
    # A checkpoint written before a ModelConfig key existed reads that key as its default.
    meta_file = tmp_path / "ck" / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    for key in ("qk_norm", "rope_scaling", "rope_factor"):
        del meta["model"][key]
    meta_file.write_text(json.dumps(meta))
    be.train_step(microbatches(synthetic_trajectories(12, vocab=64, min_len=6, max_len=30),
                               n_ranks=2, row_len=64, rows_per_rank=2)[0])  # moves on; the restore must bring step 0 back exactly
    ck.restore(be)
    assert int(be.state["step"]) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, be.state["params"]),
                 params0)
    with pytest.raises(TypeError, match="JSON"):
        ck.save(be, data_state={"bad": object()})
    ck.close()


def _garble(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            f.write_bytes(b"not a checkpoint" * 8)


# orbax leaves the reads of the other arrays behind when one fails (coroutines never awaited).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["meta", "arrays", "state_missing"])
def test_unreadable_checkpoint_is_one_config_error_naming_it(tmp_path, damage):
    """A real orbax checkpoint, damaged on disk: restore names the step folder and the fix in
    one line instead of raising orbax's/tensorstore's own (multi-page) errors."""
    be = _backend()
    ck = Checkpointer(tmp_path / "ck")
    ck.save(be, data_state={"cursor": 0}, wait=True)
    ck.close()
    step_dir = tmp_path / "ck" / "0"
    if damage == "meta":
        _garble(step_dir / "meta")
    elif damage == "arrays":  # the array data itself (metadata intact): fails while reading
        _garble(next((step_dir / "state").glob("ocdbt.process_*")))
    else:
        shutil.rmtree(step_dir / "state")
    ck = Checkpointer(tmp_path / "ck")
    with pytest.raises(ConfigError) as e:
        ck.restore(_backend())
    msg = str(e.value)
    assert f"checkpoint {step_dir.absolute()} cannot be read" in msg, msg
    assert f"delete {step_dir.absolute()}" in msg and "new run_dir" in msg
    assert "\n" not in msg and len(msg) < 600
    ck.close()
    gc.collect()  # orbax's abandoned reads are collected here, under this test's filter
