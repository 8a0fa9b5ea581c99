"""The scaling-plan point: after each actor update, before the weight sync. No JAX.

ERS (arXiv 2608.10402, §5.2) turns readiness signals into role changes at this boundary. This
module holds the planner interface the controller calls and the planner that keeps the
configured split (the only one so far); a readiness-driven planner plugs in here without
touching the controller.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from tiderl.control.buffer import Readiness


@dataclasses.dataclass(frozen=True)
class Roles:
    rollout_ranks: int
    trainer_ranks: int
    ref_ranks: int


@dataclasses.dataclass(frozen=True)
class ScalingPlan:
    roles: Roles
    reason: str = "keep"


class Planner(Protocol):
    def plan(self, readiness: Readiness, roles: Roles) -> ScalingPlan: ...


class KeepSplit:
    """Keeps the configured rollout/trainer split (what every fixed-ratio baseline does)."""

    def plan(self, readiness: Readiness, roles: Roles) -> ScalingPlan:
        return ScalingPlan(roles, "keep")
