"""GRPO group-normalised advantages and GiGPO step-level credit on the host (numpy, no JAX:
the control plane calls them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

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


# -- step-level credit (GiGPO, arXiv 2505.10978) ----------------------------------------------

Anchor = Literal["history", "observation"]


@dataclasses.dataclass(frozen=True)
class StepCredit:
    """GiGPO's step-level credit: `A = A_episode + omega · A_step` on each turn's action tokens.

    Turns of a group's kept siblings whose anchor recurs (two or more turns share it) form a
    step group; each such turn's step advantage is its discounted return from that turn,
    `gamma^(T−1−k) · R` (tiderl's episodes pay one reward, after the last of their T turns),
    normalised within the step group like the episode advantage ('std': `(R_k − mean) /
    (std + eps)`, zero when all are equal; 'mean': `R_k − mean`). A turn whose anchor is its
    own gets the episode advantage only.

    Anchors: 'history' — the turn's whole context (every token before its action): the exact
    policy input, so only identical inputs are compared, and a state reached by two different
    paths is two anchors. 'observation' — the tokens since the previous action (the template
    and the environment's reply; the prompt at turn 0): the paper's anchor state as its code
    keys it (the current observation), pooled over turns and siblings; right where the
    observation is the whole state, wrong where it leaves part of the state out.
    """

    omega: float = 1.0
    gamma: float = 0.95
    anchor: Anchor = "history"
    norm: Literal["std", "mean"] = "std"
    eps: float = 1e-6

    def __post_init__(self):
        if self.anchor not in ("history", "observation"):
            raise ValueError(f"anchor={self.anchor!r}; use 'history' or 'observation' "
                             "(trainer.gigpo_anchor)")
        if self.norm not in ("std", "mean"):
            raise ValueError(f"norm={self.norm!r}; use 'std' or 'mean' (trainer.gigpo_step_norm)")
        if not 0.0 < self.gamma <= 1.0 or self.omega < 0:
            raise ValueError(f"gamma={self.gamma} must lie in (0, 1] and omega={self.omega} be "
                             ">= 0 (trainer.gigpo_gamma, trainer.gigpo_omega)")


@dataclasses.dataclass(frozen=True)
class StepAdvantages:
    """Per trajectory, one step advantage per turn (0 where the anchor does not recur)."""

    per_turn: list[np.ndarray]
    turns: int
    anchored: int
    """Turns in a step group of two or more."""
    anchored_later: int
    """Of those, turns after the first (the first turns of siblings always share the prompt)."""
    groups: int
    """Step groups of two or more turns."""


def action_turns(loss_mask: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each turn's action: the maximal runs of the loss mask (the templates put
    at least one observation token between two actions)."""
    m = np.concatenate([[0], np.asarray(loss_mask, dtype=np.int8) != 0, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _anchors(tokens: np.ndarray, turns: list[tuple[int, int]], anchor: Anchor) -> list[bytes]:
    out, prev = [], 0
    for start, end in turns:
        out.append(tokens[:start].tobytes() if anchor == "history" else tokens[prev:start]
                   .tobytes())
        prev = end
    return out


def step_advantages(tokens: Sequence[Sequence[int] | np.ndarray],
                    loss_masks: Sequence[Sequence[int] | np.ndarray],
                    rewards: Sequence[float], credit: StepCredit) -> StepAdvantages:
    """Step advantages of one group's kept siblings (failed tasks left out, as for the episode
    advantage). Turns are the action runs of each loss mask (`action_turns`)."""
    keys: dict[bytes, list[tuple[int, int]]] = {}
    returns: list[np.ndarray] = []
    for i, (tok, mask, r) in enumerate(zip(tokens, loss_masks, rewards, strict=True)):
        turns = action_turns(mask)
        n = len(turns)
        returns.append(float(r) * credit.gamma ** np.arange(n - 1, -1, -1, dtype=np.float64))
        for k, key in enumerate(_anchors(np.asarray(tok, np.int32), turns, credit.anchor)):
            keys.setdefault(key, []).append((i, k))
    per_turn = [np.zeros(len(ret), np.float64) for ret in returns]
    anchored = later = groups = 0
    for members in keys.values():
        if len(members) < 2:
            continue
        groups += 1
        anchored += len(members)
        later += sum(k > 0 for _, k in members)
        rs = np.array([returns[i][k] for i, k in members])
        dev = rs - rs.mean()
        if credit.norm == "std":
            dev = np.zeros_like(rs) if np.ptp(rs) == 0 else dev / (rs.std(ddof=1) + credit.eps)
        for (i, k), a in zip(members, dev, strict=True):
            per_turn[i][k] = a
    return StepAdvantages([a.astype(np.float32) for a in per_turn],
                          sum(len(r) for r in returns), anchored, later, groups)


def token_advantages(loss_mask: Sequence[int] | np.ndarray, episode: float, per_turn: np.ndarray,
                     omega: float) -> np.ndarray:
    """float32 [L]: the episode advantage everywhere, plus `omega ·` its turn's step advantage
    on each turn's action tokens."""
    out = np.full(len(loss_mask), episode, np.float32)
    for (start, end), a in zip(action_turns(loss_mask), per_turn, strict=True):
        out[start:end] += np.float32(omega * a)
    return out


def step_credit(trainer: Any) -> StepCredit | None:
    """The StepCredit a `TrainerConfig` asks for (trainer.advantage='gigpo'), else None."""
    if trainer.advantage == "grpo":
        return None
    return StepCredit(omega=trainer.gigpo_omega, gamma=trainer.gigpo_gamma,
                      anchor=trainer.gigpo_anchor, norm=trainer.gigpo_step_norm,
                      eps=trainer.adv_eps)
