"""Trainer config: devices, optimizer, GRPO loss, micro-batching (JAX-free)."""

from __future__ import annotations

import dataclasses

from tiderl.configlib import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Actor/Ref placement and the optimisation of the policy."""

    actor_devices: int = 1
    ref_devices: int = 0
    """Devices for a decoupled Ref; 0 colocates Ref with the Actor."""
    fsdp: int = 1
    """FSDP axis of the actor mesh (data axis = actor_devices / (fsdp × model_parallel))."""
    model_parallel: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self):
        if self.actor_devices <= 0:
            raise ConfigError("config key 'trainer.actor_devices' must be positive")
        if self.ref_devices < 0:
            raise ConfigError("config key 'trainer.ref_devices' must be >= 0 (0 colocates)")
        if self.actor_devices % (self.fsdp * self.model_parallel):
            raise ConfigError(
                f"config key 'trainer.fsdp'={self.fsdp} × trainer.model_parallel="
                f"{self.model_parallel} must divide trainer.actor_devices={self.actor_devices}; "
                "change one of them"
            )
        if self.lr <= 0:
            raise ConfigError(f"config key 'trainer.lr' must be positive, got {self.lr}")
