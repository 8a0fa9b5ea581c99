"""Test setup: 8 fake CPU devices, configured before any JAX use, and one persistent
compilation cache for the whole session (its subprocesses included)."""

import os
import tempfile

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


def pytest_sessionfinish(session, exitstatus):
    if _CACHE is not None:
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)
