"""What a move of cells buys, learned from what was measured (ERS, arXiv 2608.10402, §5.2). No JAX.

`RateModel` keeps, per number of rollout cells, the generation rate measured there (trainable
groups per second, the throttled share of the interval taken out: what rollout could make),
and per number of trainer cells the consumption rate (groups trained per second of the
trainer's own compute). From those points it predicts both rates at another width:

- **concave**: through the origin and the measured points, linear between them, and beyond
  the widest point along the last secant. A rate that is concave in cells with no cells
  making nothing lies at or above that interpolation below the widest point and at or below
  the extrapolation beyond it, so with one point the model is the linear one (an upper bound
  on what one more cell buys) and every move measured since tightens it: a rollout cell that
  added little — generation bound by environment latency, by the groups in flight — shows as a
  flat secant, and the next prediction uses it;
- **bounded by staleness**: what the step consumes is `min(generation, consumption)`:
  generation beyond what the trainer takes only fills the staleness window and throttles
  (RWT), so it buys nothing.

A move of k cells changes the useful rate from `min(g(n_r), c(n_t))` to
`min(g(n_r ± k), c(n_t ∓ k))`; over a horizon of H steps of T seconds it saves
`H · T · (1 − old / new)` seconds of waiting. The planner moves only when that exceeds the
move's cost (drain, weight loads, joins), and logs each move's prediction and, two boundaries
later (the first one's data came partly from the old layout), the rate it realised.
"""

from __future__ import annotations

import math
from typing import Any

EMA = 0.5
"""Weight of a new measurement at a width seen before (the rates drift as the workload does)."""


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


class RateModel:
    """Measured generation and consumption rates by width, and predictions from them."""

    def __init__(self) -> None:
        self.gen: dict[int, float] = {}
        self.train: dict[int, float] = {}
        self.pending: dict[str, Any] | None = None
        """The last move's prediction, until its rate is measured."""

    @staticmethod
    def _put(points: dict[int, float], n: int, rate: float) -> None:
        if n < 1 or not _finite(rate):
            return
        points[n] = rate if n not in points else (1 - EMA) * points[n] + EMA * rate

    def observe(self, *, n_rollout: int, n_trainer: int, gen_rate: float, rwt_frac: float,
                train_rate: float) -> None:
        """One boundary's measurements at the widths that produced them."""
        if _finite(gen_rate):
            self._put(self.gen, n_rollout, gen_rate / max(1.0 - rwt_frac, 0.1))
        self._put(self.train, n_trainer, train_rate)

    @staticmethod
    def at(points: dict[int, float], n: int) -> float:
        """The concave prediction at width `n` (nan without any point)."""
        if not points:
            return math.nan
        if n <= 0:
            return 0.0
        xs = [0, *sorted(points)]
        ys = [0.0, *(points[x] for x in xs[1:])]
        if n in points:
            return points[n]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:]), strict=False):
            if x0 < n < x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return y1 + slope * (n - x1)

    def useful(self, n_rollout: int, n_trainer: int) -> float:
        """Groups per second the steps consume at these widths: min(generation, consumption)."""
        return min(self.at(self.gen, n_rollout), self.at(self.train, n_trainer))

    def predict(self, *, n_rollout: int, n_trainer: int, delta_rollout: int, step_s: float,
                horizon: int, cost_s: float) -> dict[str, Any] | None:
        """A move of `delta_rollout` cells into rollout (negative: out of it, into the
        trainer): the useful rate before and after, the seconds it saves over `horizon` steps
        of `step_s`, its cost, and whether it pays. None when the rates are not measured."""
        if not (self.gen and self.train):
            return None
        old = self.useful(n_rollout, n_trainer)
        new = self.useful(n_rollout + delta_rollout, n_trainer - delta_rollout)
        if not (_finite(old) and math.isfinite(new)):
            return None
        cost = cost_s if math.isfinite(cost_s) and cost_s > 0 else 0.0
        gain = 1.0 - old / new if new > 0 else -math.inf
        saved = horizon * step_s * gain if math.isfinite(step_s) else (
            math.inf if gain > 0 else -math.inf)
        return {"cells_to_rollout": delta_rollout, "predicted_rate_before": old,
                "predicted_rate_after": new, "predicted_saved_s": saved,
                "move_cost_s": cost, "horizon_steps": horizon,
                "step_s": step_s if math.isfinite(step_s) else None,
                "pays": saved > cost and gain > 0}

    def best(self, *, n_rollout: int, n_trainer: int, sign: int, most: int, step_s: float,
             horizon: int, cost_s: float) -> dict[str, Any] | None:
        """Of moves of 1..`most` cells in direction `sign` (+1: into rollout), the one that
        saves the most net of its cost; its prediction (with `pays`), or None unmeasured."""
        best, key = None, None
        for k in range(1, max(1, most) + 1):
            p = self.predict(n_rollout=n_rollout, n_trainer=n_trainer, delta_rollout=sign * k,
                             step_s=step_s, horizon=horizon, cost_s=cost_s)
            if p is None:
                return None
            # Net seconds saved; without a step time, the useful rate reached.
            kk = (p["predicted_saved_s"] - p["move_cost_s"] if math.isfinite(step_s)
                  else p["predicted_rate_after"])
            if key is None or kk > key * (1 + 1e-9) + 1e-12:
                best, key = p, kk
        return best

    def realise(self, n_rollout: int, n_trainer: int) -> dict[str, Any] | None:
        """The pending move's realised useful rate, once measured at its widths (call at the
        second boundary after it); None when nothing is pending."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        got = min(self.gen.get(n_rollout, math.nan), self.train.get(n_trainer, math.nan))
        want = p["predicted_rate_after"]
        return {"step": p.get("step"), "rule": p.get("rule"), "predicted_rate": want,
                "realised_rate": got if math.isfinite(got) else None,
                "rate_before": p["predicted_rate_before"],
                "error": (got - want) / want if math.isfinite(got) and want else None}
