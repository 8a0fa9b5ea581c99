"""GRPO group-normalised advantages on the host (numpy, no JAX: the control plane calls it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """Per-group advantages; `keep[g]` is False for groups the zero-variance policy dropped."""

    advantages: list[np.ndarray]
    keep: np.ndarray
    n_zero_var: int
    """Groups whose rewards were all equal, counted under either policy."""


def group_advantages(rewards_by_group: Sequence[Sequence[float]], *, eps: float = 1e-6,
                     zero_var: Literal["drop", "keep"] = "drop") -> GroupAdvantages:
    """`(r − mean) / (std + eps)` per group, std with Bessel's correction (as verl/torch.std).

    A zero-variance group carries no GRPO signal: 'drop' marks it not kept (its tokens would
    only add KL), 'keep' trains it with zero advantage (KL still applies). Either way it is
    counted in `n_zero_var`. Groups may have different sizes (elastic or failed tasks).
    """
    if zero_var not in ("drop", "keep"):
        raise ValueError(f"zero_var={zero_var!r}; use 'drop' or 'keep' (trainer.zero_var_groups)")
    advs, keep, n_zero = [], [], 0
    for g, rewards in enumerate(rewards_by_group):
        r = np.asarray(rewards, dtype=np.float64)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"group {g}: rewards must be a non-empty 1-D list, got {rewards!r}")
        if not np.all(np.isfinite(r)):
            raise ValueError(f"group {g}: rewards {r.tolist()} contain NaN/inf; fix the env "
                             "reward or mark the task failed before grouping")
        if r.size == 1 or np.ptp(r) == 0:
            n_zero += 1
            advs.append(np.zeros(r.size, np.float32))
            keep.append(zero_var == "keep")
            continue
        advs.append(((r - r.mean()) / (r.std(ddof=1) + eps)).astype(np.float32))
        keep.append(True)
    return GroupAdvantages(advs, np.asarray(keep, dtype=bool), n_zero)
