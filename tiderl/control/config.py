"""Controller config: run mode, steps, batch, evaluation, checkpoints (JAX-free)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """The RL loop: which baseline mode, how long, how big a step."""

    mode: Literal["tiderl", "sync", "async", "stream"] = "tiderl"
    steps: int = 50
    group_size: int = 8
    groups_per_step: int = 8

    def __post_init__(self):
        for name in ("steps", "group_size", "groups_per_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'controller.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
