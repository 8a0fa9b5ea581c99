"""tiderl.envs: the env HTTP protocol, server, client, adapters, task sources. No JAX."""

from tiderl._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Adapter": "tiderl.envs.adapters.base",
    "EndReason": "tiderl.envs.protocol",
    "EnvClient": "tiderl.envs.client",
    "EnvConfig": "tiderl.envs.config",
    "EnvServer": "tiderl.envs.server",
    "LatencyConfig": "tiderl.envs.config",
    "Step": "tiderl.envs.adapters.base",
    "adapter_class": "tiderl.envs.suites",
})
