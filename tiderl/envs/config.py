"""Environment-side config (JAX-free)."""

from __future__ import annotations

import dataclasses

from tiderl.configlib import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Which environment suite the run talks to, and how."""

    suite: str = "default"
    """Adapter suite served by the env server ('default', 'gym', 'textworld', 'textarena')."""
    url: str = ""
    """Base URL of a running env server; '' starts one in-process on 127.0.0.1 (port 0)."""
    token: str = ""
    """Bearer token sent to (and, in-process, required by) the env server; '' for none."""
    concurrency: int = 64
    """Max concurrent env sessions (requests in flight) from this job."""

    def __post_init__(self):
        if self.concurrency <= 0:
            raise ConfigError(f"config key 'env.concurrency' must be positive, got "
                              f"{self.concurrency}")
