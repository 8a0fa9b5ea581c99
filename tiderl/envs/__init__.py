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
    "Observation": "tiderl.envs.adapters.base",
    "Image": "tiderl.envs.images",
    "ImageConfig": "tiderl.envs.config",
    "Episode": "tiderl.envs.rewards",
    "FileSource": "tiderl.envs.taskfile",
    "TaskSource": "tiderl.envs.tasks",
    "Transcript": "tiderl.envs.templates",
    "TurnTemplate": "tiderl.envs.templates",
    "adapter_class": "tiderl.envs.suites",
    "endpoint": "tiderl.envs.server",
    "eval_tasks": "tiderl.envs.tasks",
    "load_object": "tiderl.envs.suites",
    "read_rows": "tiderl.envs.taskfile",
    "jinja_template": "tiderl.envs.chat_templates",
    "template_for": "tiderl.envs.templates",
})
