"""Rollout-side config: engine shape, sampling, scheduler (JAX-free)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Rollout ranks (one engine each), their KV pool, sampling and scheduling policy."""

    ranks: int = 1
    devices_per_rank: int = 1
    scheduler: Literal["ctb", "vanilla"] = "ctb"
    page_size: int = 16
    num_pages: int = 256
    """KV pages per rank (the token budget is num_pages × page_size)."""
    max_slots: int = 32
    """Concurrent sequences resident per rank (the decode batch is bucketed up to this)."""
    max_context: int = 1024
    max_action_tokens: int = 16
    temperature: float = 1.0

    def __post_init__(self):
        for name in ("ranks", "devices_per_rank", "page_size", "num_pages", "max_slots",
                     "max_context", "max_action_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'rollout.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError("config key 'rollout.temperature' must be >= 0 (0 is greedy)")
