"""Test setup: 8 fake CPU devices, configured before any JAX use."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
    import jax
except ImportError:  # the JAX-free tests still run
    jax = None

if jax is not None:
    # XLA_FLAGS set after JAX starts are ignored; this config works until the backend starts.
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", False)
