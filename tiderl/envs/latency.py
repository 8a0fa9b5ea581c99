"""Injected environment latency: per-step delays drawn from lognormal or Pareto. No JAX.

Each delay is a pure function of (seed, task id, turn), so a task sees the same delays however
the server interleaves sessions, and a benchmark rerun reproduces its timing workload.
"""

from __future__ import annotations

import hashlib
import math
import random

from tiderl.envs.config import LatencyConfig


class LatencyModel:
    """Samples the delay before a reset (turn 0) or a step (turn >= 1) of one task."""

    def __init__(self, cfg: LatencyConfig):
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return self.cfg.dist != "none"

    def _rng(self, task_id: str, turn: int) -> random.Random:
        # sha256 rather than hash(): str hashes are salted per process (PYTHONHASHSEED).
        digest = hashlib.sha256(f"{self.cfg.seed}/{task_id}/{turn}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "little"))

    def sample(self, task_id: str, turn: int) -> float:
        """Seconds to wait; 0 when disabled."""
        cfg = self.cfg
        if cfg.dist == "none":
            return 0.0
        rng = self._rng(task_id, turn)
        if cfg.dist == "lognormal":
            value = rng.lognormvariate(math.log(cfg.median_s), cfg.sigma)
        else:
            # random.paretovariate(alpha) has minimum 1; scale it to x_m.
            value = cfg.scale_s * rng.paretovariate(cfg.alpha)
        if turn == 0:
            value *= cfg.start_factor
        return min(value, cfg.cap_s)

    def mean(self) -> float:
        """Analytic mean of one step's delay before capping (for workload sizing)."""
        cfg = self.cfg
        if cfg.dist == "none":
            return 0.0
        if cfg.dist == "lognormal":
            return cfg.median_s * math.exp(cfg.sigma**2 / 2)
        return math.inf if cfg.alpha <= 1 else cfg.alpha * cfg.scale_s / (cfg.alpha - 1)
