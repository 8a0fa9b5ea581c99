"""RA2P cost model (paper Appendix A) and the Ref/Actor execution-mode choice. No JAX.

Ready times `a_i` are relative to the step start (≤ 0: ready at start, counted in RAS = N0).

- `c_dec`: closed form, `Σ_{i=0}^{M-1} i·t_ref + Σ_{i=1}^{N} max(δ_i, t_act_f + t_act_b)` with
  δ_i = 0 for i ≤ N0, δ_{N0+1} = max(a_{N0+1}, 0), δ_i = a_i − a_{i−1} otherwise.
- `c_col`: simulation of ready-batch aggregation: wait for the next micro-batch if idle, take the
  k ready ones (capped by memory), `T += t_swap + k·t_ref`, `T += t_swap + k·(t_act_f + t_act_b)`.

Both are the paper's formulas verbatim (including C_dec's approximation that the last
micro-batch's compute hides inside its ready gap), so hand-computed examples reproduce them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal


@dataclasses.dataclass(frozen=True)
class PhaseCosts:
    """Per-micro-batch phase times (seconds) and the Actor group size M."""

    t_ref: float
    t_act_f: float
    t_act_b: float
    t_swap: float
    m_actor: int = 1


def ras(ready_times: Sequence[float]) -> int:
    """Ready-at-Start: micro-batches already ready when the step begins."""
    return sum(1 for a in ready_times if a <= 0)


def tprm(ready_times: Sequence[float]) -> float:
    """Time Per Ready Micro-batch: mean post-start ready gap (0 when all were ready at start)."""
    a = sorted(ready_times)
    n0 = ras(a)
    if n0 == len(a):
        return 0.0
    return a[-1] / (len(a) - n0)  # span from the step start over the post-start arrivals


def c_dec(ready_times: Sequence[float], c: PhaseCosts) -> float:
    """Decoupled streaming cost: pipeline-fill bubble plus per-micro-batch max(gap, compute)."""
    a = sorted(ready_times)
    n0 = ras(a)
    fill = sum(i * c.t_ref for i in range(c.m_actor))
    act = c.t_act_f + c.t_act_b
    total = fill
    for i in range(len(a)):  # i is 0-based; the paper's index is i + 1
        if i < n0:
            delta = 0.0
        elif i == n0:
            delta = max(a[i], 0.0)
        else:
            delta = a[i] - a[i - 1]
        total += max(delta, act)
    return total


def c_col(ready_times: Sequence[float], c: PhaseCosts, *, max_aggregate: int | None = None
          ) -> tuple[float, int]:
    """Colocated ready-batch aggregation cost by simulation; returns (cost, number of swaps)."""
    a = sorted(ready_times)
    t, j, swaps = 0.0, 0, 0
    while j < len(a):
        if t < a[j]:
            t = a[j]
        k = 0
        while j + k < len(a) and a[j + k] <= t and (max_aggregate is None or k < max_aggregate):
            k += 1
        t += c.t_swap + k * c.t_ref
        t += c.t_swap + k * (c.t_act_f + c.t_act_b)
        swaps += 2
        j += k
    return t, swaps


@dataclasses.dataclass(frozen=True)
class ModeChoice:
    """The choice and the numbers behind it (logged by the controller)."""

    mode: Literal["decoupled", "colocated"]
    c_dec: float
    c_col: float
    ras: int
    swaps_col: int
    reason: str


def choose_mode(ready_times: Sequence[float], costs: PhaseCosts, *, slack: float = 0.1,
                max_aggregate: int | None = None) -> ModeChoice:
    """Decoupled unless colocated is within `slack` of it.

    Colocated frees the Ref devices for rollout, so it wins near-ties: when RAS is low and the
    ready gaps are long, both costs are dominated by the arrivals and C_col ≤ (1 + slack)·C_dec;
    a large RAS or short gaps expose the swaps and make decoupled strictly better.
    """
    if not ready_times:
        raise ValueError("choose_mode needs at least one ready time (a_i of the step's "
                         "micro-batches, relative to the step start)")
    dec = c_dec(ready_times, costs)
    if costs.t_ref <= 0:
        col, swaps = c_col(ready_times, costs, max_aggregate=max_aggregate)
        return ModeChoice("colocated", dec, col, ras(ready_times), swaps,
                          "no Ref forward to overlap (t_ref = 0): colocated, the Ref needs no "
                          "devices")
    col, swaps = c_col(ready_times, costs, max_aggregate=max_aggregate)
    n0 = ras(ready_times)
    if col <= (1.0 + slack) * dec:
        return ModeChoice("colocated", dec, col, n0, swaps,
                          f"C_col={col:.4g} ≤ (1+{slack})·C_dec={dec:.4g}: readiness dominates, "
                          "free the Ref devices")
    return ModeChoice("decoupled", dec, col, n0, swaps,
                      f"C_col={col:.4g} > (1+{slack})·C_dec={dec:.4g}: swaps exposed "
                      f"(RAS={n0})")


def predicted_ready_times(n_microbatches: int, ras: int, tprm: float) -> list[float]:
    """Ready times of a step not yet begun, from live signals: `ras` micro-batches ready at its
    start (a_i = 0), the rest arriving every `tprm` seconds after it (the readiness trend the
    ERS coordinator plans with; an instantaneous arrival pattern is too noisy)."""
    n0 = max(0, min(ras, n_microbatches))
    gap = tprm if tprm == tprm and tprm != float("inf") else 0.0  # NaN / inf: unknown pace
    return [0.0] * n0 + [gap * (k + 1) for k in range(n_microbatches - n0)]


def break_even_ras(n_microbatches: int, tprm: float, costs: PhaseCosts, *, slack: float = 0.1,
                   max_aggregate: int | None = None) -> int:
    """The smallest RAS from which decoupled beats colocated (`choose_mode` says decoupled)
    for a step of `n_microbatches` whose later micro-batches arrive every `tprm` seconds;
    `n_microbatches + 1` when decoupled never pays off (e.g. no Ref forward: t_ref = 0)."""
    for n0 in range(n_microbatches + 1):
        times = predicted_ready_times(n_microbatches, n0, tprm)
        if choose_mode(times, costs, slack=slack, max_aggregate=max_aggregate).mode == \
                "decoupled":
            return n0
    return n_microbatches + 1


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Measured phase costs with the choice's settings: what the controller plans RA2P with."""

    costs: PhaseCosts
    slack: float = 0.1
    max_aggregate: int | None = None

    def advise(self, ready_times: Sequence[float]) -> ModeChoice:
        return choose_mode(ready_times, self.costs, slack=self.slack,
                           max_aggregate=self.max_aggregate)

    def break_even(self, n_microbatches: int, tprm: float) -> int:
        return break_even_ras(n_microbatches, tprm, self.costs, slack=self.slack,
                              max_aggregate=self.max_aggregate)
