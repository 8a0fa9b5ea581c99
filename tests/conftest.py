"""Test setup: 8 fake CPU devices, configured before any JAX use, and one persistent
compilation cache for the whole session (its subprocesses included)."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same kernels (the tiny default model's engine and trainer steps), and
# the entry-point tests do so again in subprocesses: a session-wide cache compiles each once.
# The environment variables reach the subprocesses; a fresh directory keeps runs independent.
_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiderl-jaxcache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

try:
    import jax
except ImportError:  # the JAX-free tests still run
    jax = None

if jax is not None:
    # XLA_FLAGS set after JAX starts are ignored; this config works until the backend starts.
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", False)


# Tests write run folders under tmp_path only: the checkout's runs/ (where a user's own
# `python -m tiderl.launch` writes) must be the same after the suite as before it.
_CHECKOUT_RUNS = Path(__file__).resolve().parent.parent / "runs"


def _checkout_runs() -> list[tuple[str, int]]:
    if not _CHECKOUT_RUNS.exists():
        return []
    return sorted((str(p.relative_to(_CHECKOUT_RUNS)), p.stat().st_mtime_ns)
                  for p in _CHECKOUT_RUNS.rglob("*"))


def pytest_sessionstart(session):
    session.config._tiderl_runs = _checkout_runs()


def pytest_sessionfinish(session, exitstatus):
    if _CACHE is not None:
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once
        return
    if _checkout_runs() != session.config._tiderl_runs:
        print(f"\nerror: the test suite changed {_CHECKOUT_RUNS} (a test ran a job without a "
              "run_dir under tmp_path)")
        session.exitstatus = 1


# The longest files first (measured seconds on the 2-core machine, rounded): the two xdist
# workers take whole files (`--dist loadfile`) in collection order, so starting with the long
# ones keeps one worker from running a long file alone at the end.
_LONG_FILES = {
    "test_real_model_run.py": 600, "test_train_memory.py": 180, "test_ctb_bench.py": 155,
    "test_multihost.py": 145, "test_train_lora.py": 140, "test_train_your_model.py": 105,
    "test_launch_models.py": 80, "test_gpu_path.py": 80, "test_byo_tasks.py": 75,
    "test_serving_faults.py": 75, "test_models_gguf.py": 70, "test_models_vlm.py": 60,
    "test_serving_engine.py": 60, "test_serving_vlm.py": 60, "test_models_hf.py": 55,
    "test_serving_hostkv.py": 45, "test_serving_tp.py": 40, "test_train_grpo.py": 40,
    "test_train_vlm.py": 40, "test_agents_run.py": 40,
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -_LONG_FILES.get(item.path.name, 0))  # stable: in-file order kept


@pytest.fixture
def rank_calls(monkeypatch):
    """`rank_calls(name)`: a list of the ids of the `RolloutRank`s whose async method `name`
    is called from then on in the test."""
    from tiderl.serving.rank import RolloutRank

    def track(name: str) -> list[int]:
        seen: list[int] = []
        method = getattr(RolloutRank, name)

        async def recorded(rank, *args, **kwargs):
            seen.append(rank.rank_id)
            return await method(rank, *args, **kwargs)

        monkeypatch.setattr(RolloutRank, name, recorded)
        return seen

    return track
