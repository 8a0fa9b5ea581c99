"""Elastic Resource Scaling (arXiv 2608.10402, §5.2): the readiness-aware planner. No JAX.

The cells, signals and plans it works on, and the contract of a role change
(`Hooks.apply_roles`), are `tiderl.control.plans`; the planners without rules (`KeepSplit`,
`ScriptedPlanner`) are `tiderl.control.fixed_plans`, and `make_planner` below picks one. Its
bounds and hysteresis, `ERSConfig`, are `tiderl.control.ers_config` (importable from here too).

Calling the planner directly (a simulator that runs its own loop): one planner object per run
(it holds the hysteresis), one call per sync boundary, JAX-free:

    from tiderl.control.ers import ERSConfig, ERSPlanner
    from tiderl.control.plans import CellMap, Signals
    planner = ERSPlanner(ERSConfig(patience=2, cooldown=3))          # controller.elastic
    cells = CellMap(("rollout", "rollout", "trainer", "ref"))       # cell id = index
    plan = planner.plan(Signals(step=0, cold_start=True), cells)    # before any rollout
    ...                                                             # after each update:
    plan = planner.plan(Signals.from_readiness(r, step=k, eval_next=False), cells)
    cells = plan.cells       # the roles for the next step; plan.moves: the Moves
                             # (cell, src, dst); plan.rule, plan.reason: why;
                             # plan.ref_mode: "decoupled" iff a ref cell

`r` is the `tiderl.control.buffer.Readiness` that `ReadinessBuffer.boundary(...)` returns (or
any object with its deficit fields); `Signals(...)` can also be filled by hand. A plan whose
`cells` equal the input (`plan.moves == ()`) changes nothing. `train_rate=` (groups the trainer
trained per second of its own compute in the last step) lets the planner size a move; without
it every deficit moves one cell.

Rules of `ERSPlanner` (each plan carries its reason):

1. Cold start (before any rollout): lend rollout what an empty buffer leaves idle — every Ref
   cell (RAS = 0 is below any RA2P break-even, so colocated) and trainer cells until rollout
   holds `cold_start_share` of the cells (default half) or `cold_start_cells` of them if more
   (-1 lends every movable cell, the paper's maximal preemption), one more when an
   evaluation runs during the first step (rule 3). At the first boundary the lent
   trainer cells return, all at once, unless generation is then the deficit; then as many stay
   as the rates say rollout needs.
2. A Ref cell whose Ref runs no forward (no KL term) joins rollout.
3. Evaluation: at the boundary that starts an evaluation (it runs during the next step) one
   cell moves to rollout preemptively; at the next boundary it returns unless generation is
   then the deficit.
4. Consumption deficit (data waits for the trainer: head-of-line latency over τ·T_step, RAS at
   or above the RA2P break-even, rollout throttled, or a ready backlog — the next batch
   nearly ready before its step while the trainer hardly waited) held for `patience`
   boundaries: if RA2P advises decoupled, there is no Ref cell and one Ref cell keeps pace
   with the trainer's cells (`Signals.ref_pace`), a rollout cell becomes the Ref; else
   rollout cells join the trainer.
5. Generation deficit (the next batch is short of B_ideal and the trainer waited) held for
   `patience` boundaries: a Ref cell joins rollout (colocated RA2P), else trainer cells do —
   unless the rollout engines idled more than `wait_frac` of the step (`Signals.rollout_busy`):
   then generation is bound by latency, not by cells, and rollout compacts instead (rule
   `compact`): its cells join the trainer until the engines left would be busy
   `compact_busy` of the step, since what a cell can shorten then is the trainer's compute
   after the last group arrives; the plan holds (rule `hold`) when no cell is to spare.
6. Sizing: the signals choose the direction, the measured rates the size. Groups generated per
   rollout cell (the throttled share of the interval taken out; the mean of the last two
   boundaries when both ran at the same roles, `_smoothed`) against groups trained per
   trainer cell put the balance at N·c/(g + c) rollout cells; a deficit's move covers the gap
   to it, at least one cell and at most `max_move_cells` (default half of the giving role's
   cells, rounded up), so a large imbalance closes in one or two boundaries instead of one
   cell per cooldown.
7. Hysteresis: besides `patience`, a move that undoes the previous one waits `cooldown`
   boundaries; the boundary after a move does not count toward `patience` (its data came
   partly from the old layout), nor does a consumption deficit at the first boundary (its
   step compiled, so the trainer looked slow). Bounds are never crossed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from tiderl.control.ers_config import ERSConfig
from tiderl.control.ers_rates import RateModel
from tiderl.control.fixed_plans import KeepSplit, ScriptedPlanner
from tiderl.control.plans import (
    CellMap,
    Move,
    Planner,
    ScalingPlan,
    Signals,
    ref_mode_of,
)


class ERSPlanner:
    """The paper's readiness-aware rules (module docstring), with bounds and hysteresis."""

    def __init__(self, cfg: ERSConfig | None = None, *, move_cost_s: float = math.nan):
        self.cfg = cfg or ERSConfig()
        self.move_cost_s = move_cost_s
        """What a role change costs when `Signals.move_cost_s` does not say (nan: unknown,
        then a move must only be predicted to help)."""
        self.rates = RateModel()
        """Measured rates by width: what a move buys (`tiderl.control.ers_rates`)."""
        self.home: tuple[str, ...] | None = None
        """Each cell's role in the first map seen: moves prefer sending cells home, so the
        trainer meshes it passes through recur (compiled once)."""
        self._gen = self._con = 0
        self._settle: str | None = "start"
        """The next boundary follows the run's start ("start": its step compiled, which makes
        the trainer look slow, so a consumption deficit there does not count toward
        `patience`; a generation deficit, which compilation only hides, does) or a move
        ("move": its data came partly from the old layout, so nothing counts)."""
        self._last: tuple[str, str] | None = None
        """(src, dst) of the last move."""
        self._since_last = math.inf
        self._eval_moved: Move | None = None
        self._lent: tuple[Move, ...] = ()
        """Trainer cells the cold start lent to rollout, until the first boundary."""
        self._gen_seen: tuple[tuple[str, ...], float] | None = None
        """The last boundary's roles and generation rate (`_smoothed`)."""

    # -- bounds ---------------------------------------------------------------------------
    def _can_leave(self, cells: CellMap, role: str) -> bool:
        c = self.cfg
        n = cells.count(role)
        if role == "rollout":
            return n > c.min_rollout_cells
        if role == "trainer":
            return n > c.min_trainer_cells
        return n > 0

    def _can_join(self, cells: CellMap, role: str) -> bool:
        c = self.cfg
        n = cells.count(role)
        if role == "rollout":
            return not c.max_rollout_cells or n < c.max_rollout_cells
        if role == "trainer":
            return not c.max_trainer_cells or n < c.max_trainer_cells
        return n < c.max_ref_cells

    def _pref(self, cell: int, role: str) -> tuple:
        """How much `cell` belongs to `role` (lower: more): cells at home there first, then by
        distance from the role's home block, then by id."""
        home = self.home or ()
        block = [i for i, r in enumerate(home) if r == role]
        return (home[cell] != role, min((abs(cell - i) for i in block), default=0), cell)

    def _donor(self, cells: CellMap, src: str, dst: str, pinned: frozenset[int]) -> int | None:
        """Which `src` cell goes: into rollout, the one that belongs least to `src`; into the
        trainer or the Ref, the one that belongs most to `dst`. So each role's membership at a
        given size is (nearly) always the same set, and the trainer's meshes recur."""
        options = [c for c in cells.cells(src) if c not in pinned]
        if not options:
            return None
        if dst == "rollout":
            return max(options, key=lambda c: self._pref(c, src))
        return min(options, key=lambda c: self._pref(c, dst))

    def _move(self, cells: CellMap, src: str, dst: str, signals: Signals, *, rule: str,
              reason: str, check_cooldown: bool = True, n: int = 1,
              prefer: Sequence[int] = ()) -> ScalingPlan | None:
        """Up to `n` cells `src` → `dst` within the bounds (the `prefer`red ones first), or
        None when none can move (bounds, pins, or the cooldown against undoing a move)."""
        if check_cooldown and self._last == (dst, src) and self._since_last < self.cfg.cooldown:
            return None
        moves: list[Move] = []
        after = cells
        wanted = [x for x in prefer if x not in signals.pinned]
        while len(moves) < n and self._can_leave(after, src) and self._can_join(after, dst):
            cell = next((x for x in wanted if after.roles[x] == src), None)
            if cell is None:
                cell = self._donor(after, src, dst, signals.pinned)
            if cell is None:
                break
            moves.append(Move(cell, src, dst))
            after = after.with_role(cell, dst)
        if not moves:
            return None
        self._last, self._since_last = (src, dst), 0
        self._settle, self._con, self._gen = "move", 0, 0
        which = (f"cell {moves[0].cell}" if len(moves) == 1 else
                 "cells " + ", ".join(str(m.cell) for m in moves))
        reason = reason.replace("{n}", f"{len(moves)} cell{'s' if len(moves) > 1 else ''}")
        return ScalingPlan(after, tuple(moves), reason=f"{reason}: {which} {src} → {dst}",
                           rule=rule, ref_mode=ref_mode_of(after))

    def _ref_keeps_up(self, s: Signals, cells: CellMap) -> bool:
        """A dedicated Ref (one cell, from rollout) pays only when it keeps pace with the Actor
        it would serve: the trainer's cells at most `Signals.ref_pace`. Past that the Ref's
        forward over the whole batch on one cell outlasts the Actor's step on the others, and
        decoupling slows the step it was meant to speed up."""
        return s.uses_ref and cells.count("trainer") <= s.ref_pace

    # -- sizing ---------------------------------------------------------------------------
    def _balance(self, s: Signals, cells: CellMap) -> float | None:
        """Rollout cells at which generation would match consumption, from the measured rates:
        groups generated per rollout cell (the throttled share of the interval taken out, so a
        throttled rollout is not read as a slow one) against groups trained per trainer cell,
        both taken as linear in cells. None without both rates."""
        n_r, n_t = cells.count("rollout"), cells.count("trainer")
        if n_r < 1 or n_t < 1 or not (math.isfinite(s.gen_rate) and s.gen_rate > 0
                                      and math.isfinite(s.train_rate) and s.train_rate > 0):
            return None
        per_rollout = s.gen_rate / max(1.0 - s.rwt_frac, 0.1) / n_r
        per_trainer = s.train_rate / n_t
        return (n_r + n_t) * per_trainer / (per_rollout + per_trainer)

    def _latency_bound(self, s: Signals) -> str | None:
        """A generation deficit that more rollout cells would not close: the rollout engines
        were idle more than `wait_frac` of the last step while the trainer waited, so the
        groups were waiting on their environments (or on the staleness window), not on engine
        capacity. None: no such finding (busy enough, or unknown)."""
        b = s.rollout_busy
        if not math.isfinite(b) or b >= 1.0 - self.cfg.wait_frac:
            return None
        return (f"rollout engines busy {b:.0%} of the step: generation is bound by latency "
                "(environment, staleness window), not by rollout cells")

    def _compact(self, s: Signals, cells: CellMap, why: str) -> ScalingPlan | None:
        """A latency-bound generation deficit (`_latency_bound`): rollout cells join the
        trainer until the engines left would be busy `compact_busy` of the step (their work
        unchanged, spread over fewer engines), at most `max_move_cells`. The groups wait on
        latency either way; what a trainer cell shortens is the trainer's compute after the
        last of them arrives. None: no cell to spare at that target (or compaction off, or
        the cooldown against undoing the last move)."""
        c = self.cfg
        n_r = cells.count("rollout")
        if not c.compact_busy or n_r <= 1:
            return None
        keep = max(1, math.ceil(n_r * s.rollout_busy / c.compact_busy - 1e-9))
        cap = c.max_move_cells or -(-n_r // 2)
        n = min(cap, n_r - keep)
        if n < 1:
            return None
        effect = {"rollout_busy": s.rollout_busy, "rollout_cells_before": n_r,
                  "predicted_rollout_busy": s.rollout_busy * n_r / (n_r - n)}
        p = self._move(cells, "rollout", "trainer", s, rule="compact", n=n,
                       reason=f"{why}: rollout compacts to engines {c.compact_busy:.0%} busy, "
                              "trainer +{n}")
        return None if p is None else dataclasses.replace(p, effect=effect)

    def _starving(self, s: Signals) -> str | None:
        """A generation deficit the rates predict before the trainer has waited (the paper's
        long TPRM): groups arrive slower than `1 − wait_frac` of what the trainer trains per
        second of compute, so the next steps wait more than `wait_frac` whatever the buffer
        holds now (a burst of groups finishing together fills it once). None: no such
        prediction (or no rates); else its words."""
        g, c = s.gen_rate, s.train_rate
        if not (math.isfinite(g) and math.isfinite(c) and g > 0 and c > 0):
            return None
        if g >= (1.0 - self.cfg.wait_frac) * c:
            return None
        return (f"{g:.3g} groups/s generated against {c:.3g} trained per second of compute: "
                f"the trainer would wait {1 - g / c:.0%} of its steps")

    def _flooded(self, cells: CellMap) -> str | None:
        """A consumption deficit the measured rates show before the buffer does (a trainer
        that never waits, rollout not yet throttled): what rollout makes at this width exceeds
        by more than `wait_frac` what the trainer trains at its width. None: no such finding."""
        g = self.rates.gen.get(cells.count("rollout"), math.nan)
        c = self.rates.train.get(cells.count("trainer"), math.nan)
        if not (math.isfinite(g) and math.isfinite(c)) or c >= (1.0 - self.cfg.wait_frac) * g:
            return None
        return (f"{g:.3g} groups/s generated against {c:.3g} trained per second of compute: "
                "the trainer is the bottleneck")

    def _size(self, s: Signals, cells: CellMap, src: str, dst: str) -> tuple[int, str]:
        """How many cells a deficit's move takes (at least one; more when the rates put the
        balance further away, at most `max_move_cells`, by default half of `src`'s cells),
        and the words for the reason."""
        target = self._balance(s, cells)
        if target is None:
            return 1, ""
        n_r = cells.count("rollout")
        gap = target - n_r if dst == "rollout" else n_r - target
        cap = self.cfg.max_move_cells or -(-cells.count(src) // 2)
        n = max(1, min(cap, math.floor(gap + 0.5)))
        return n, (f"; rates {s.gen_rate:.3g} groups/s generated, {s.train_rate:.3g} trained "
                   f"per second of compute: balance near {target:.1f} rollout cells")

    # -- what a move buys (tiderl.control.ers_rates) -------------------------------------
    def _learn(self, s: Signals, cells: CellMap) -> dict[str, Any] | None:
        """Records this boundary's rates at the widths that made them (not right after a move:
        that step's data came partly from the old layout) and, at the second boundary after a
        rated move, what it realised."""
        if s.cold_start:
            return None
        n_r, n_t = cells.count("rollout"), cells.count("trainer")
        if self._settle != "move":
            self.rates.observe(n_rollout=n_r, n_trainer=n_t, gen_rate=s.gen_rate,
                               rwt_frac=s.rwt_frac, train_rate=s.train_rate)
        p = self.rates.pending
        if p is None:
            return None
        p["age"] = p.get("age", 0) + 1
        return self.rates.realise(n_r, n_t) if p["age"] >= 2 else None

    def _rated(self, s: Signals, cells: CellMap, src: str, dst: str, *, rule: str,
               reason: str) -> ScalingPlan | None:
        """A deficit's move between rollout and the trainer, sized and gated by what it is
        predicted to buy (`RateModel.best`): the size that saves the most waiting over the
        next `cooldown + patience` steps net of the move's cost, and no move (a `hold` plan)
        when none saves more than it costs. Without measured rates: `_size`'s linear sizing."""
        c = self.cfg
        cap = c.max_move_cells or -(-cells.count(src) // 2)
        lo = c.min_rollout_cells if src == "rollout" else c.min_trainer_cells
        hi = c.max_rollout_cells if dst == "rollout" else c.max_trainer_cells
        room = min(cap, cells.count(src) - lo, (hi - cells.count(dst)) if hi else cap)
        if room < 1:  # the bounds allow no move: nothing to predict
            return None
        if not c.learned_rates:
            n, note = self._size(s, cells, src, dst)
            return self._move(cells, src, dst, s, rule=rule, n=n,
                              reason=f"{reason}{note}: {dst} +{{n}}")
        cap = room
        cost = s.move_cost_s if math.isfinite(s.move_cost_s) else self.move_cost_s
        pred = self.rates.best(n_rollout=cells.count("rollout"),
                               n_trainer=cells.count("trainer"),
                               sign=1 if dst == "rollout" else -1, most=cap,
                               step_s=s.hol_limit_s / c.tau, horizon=c.cooldown + c.patience,
                               cost_s=cost)
        if pred is None:
            n, note = self._size(s, cells, src, dst)
            return self._move(cells, src, dst, s, rule=rule, n=n,
                              reason=f"{reason}{note}: {dst} +{{n}}")
        words = (f"; predicted {pred['predicted_rate_before']:.3g} → "
                 f"{pred['predicted_rate_after']:.3g} groups/s, saving "
                 f"{pred['predicted_saved_s']:.3g} s over {pred['horizon_steps']} steps "
                 f"against a move of {pred['move_cost_s']:.3g} s")
        if not pred["pays"]:
            self._con = self._gen = 0
            return ScalingPlan(cells, rule="hold", ref_mode=ref_mode_of(cells), effect=pred,
                               reason=f"{reason}{words}: no move pays, roles kept")
        p = self._move(cells, src, dst, s, rule=rule, n=abs(pred["cells_to_rollout"]),
                       reason=f"{reason}{words}: {dst} +{{n}}")
        if p is not None:
            self.rates.pending = {**pred, "step": s.step, "rule": rule, "age": 0}
            p = dataclasses.replace(p, effect=pred)
        return p

    # -- the rules ------------------------------------------------------------------------
    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        """The plan for the next step (the rules in the module docstring); its `effect` holds
        the move's prediction and what the last rated move realised."""
        signals = self._smoothed(signals, cells)
        realised = self._learn(signals, cells)
        plan = self._plan(signals, cells)
        if realised is not None:
            plan = dataclasses.replace(plan, effect={**plan.effect, "realised": realised})
        return plan

    def _smoothed(self, s: Signals, cells: CellMap) -> Signals:
        """`s` with the generation rate the rules read averaged over this boundary and the last
        one when both steps ran at the same roles. With a staleness bound, consecutive steps
        alternate (one starts with the groups the last left nearly done, the next without
        them): in the simulator's table2, 0.08 and 0.11 groups/s on alternate steps."""
        g = s.gen_rate
        prev, self._gen_seen = self._gen_seen, (cells.roles, g)
        if s.cold_start or prev is None or prev[0] != cells.roles or not (
                math.isfinite(g) and math.isfinite(prev[1])):
            return s
        return dataclasses.replace(s, gen_rate=(g + prev[1]) / 2)

    def _plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        if self.home is None:
            self.home = cells.roles
        self._since_last += 1
        s, c = signals, self.cfg
        keep = ScalingPlan(cells, ref_mode=ref_mode_of(cells))
        if s.cold_start:
            self._settle = "start"
            return self._cold_start(s, cells) if c.cold_start else keep
        settle, self._settle = self._settle, None
        # A backlog at the RA2P break-even asks for a Ref cell: it is no deficit once one
        # serves (or with nothing for a Ref to compute).
        con = s.consumption_deficit or (s.above_break_even and self._ref_keeps_up(s, cells)
                                        and not cells.count("ref"))
        flooded = (self._flooded(cells) if c.learned_rates and not s.generation_deficit
                   else None)
        con = con or flooded is not None
        starving = self._starving(s)
        gen = (s.generation_deficit or starving is not None) and not con
        self._con = self._con + 1 if con and not s.generation_deficit and not settle else 0
        self._gen = self._gen + 1 if gen and settle != "move" else 0
        if cells.count("ref") and not s.uses_ref:
            p = self._move(cells, "ref", "rollout", s, rule="no_ref", check_cooldown=False,
                           reason="no KL term, so the Ref runs no forward: its cell serves "
                                  "rollout (colocated RA2P)")
            if p is not None:
                return p
        if self._lent:
            p = self._cold_return(s, cells, gen and self._latency_bound(s) is None)
            if p is not None:
                return p
        if self._eval_moved is not None and not s.eval_next:
            back, self._eval_moved = self._eval_moved, None
            if not gen:
                p = self._move(cells, "rollout", back.src, s, rule="eval_return",
                               check_cooldown=False, prefer=(back.cell,),
                               reason="evaluation over: the preemptive rollout cell returns")
                if p is not None:
                    return p
        if s.eval_next and c.eval_preempt:
            for src in ("ref", "trainer"):
                p = self._move(cells, src, "rollout", s, rule="eval", check_cooldown=False,
                               reason="preemptive rollout allocation: the evaluation of this "
                                      "step's weights runs during the next step")
                if p is not None:
                    self._eval_moved = p.moves[0]
                    return p
        why = s.deficit_reason if not gen or s.generation_deficit else starving
        why = f" ({why})" if why else ""
        if self._con >= c.patience:
            if not cells.count("ref") and self._ref_keeps_up(s, cells) and (
                    s.above_break_even or s.ra2p_mode == "decoupled"):
                p = self._move(cells, "rollout", "ref", s, rule="consumption",
                               reason=f"consumption deficit{why}, RA2P advises decoupled "
                                      f"(RAS {s.ras_next} vs break-even {s.break_even_ras}): "
                                      "a dedicated Ref")
                if p is not None:
                    return p
            if s.consumption_deficit or flooded:
                why = why or (f" ({flooded})" if flooded else "")
                p = self._rated(s, cells, "rollout", "trainer", rule="consumption",
                                reason=f"consumption deficit{why}")
                if p is not None:
                    return p
        if self._gen >= c.patience and (bound := self._latency_bound(s)) is not None:
            self._gen = 0
            p = self._compact(s, cells, f"generation deficit{why}, but {bound}")
            if p is not None:
                return p
            return ScalingPlan(cells, rule="hold", ref_mode=ref_mode_of(cells),
                               reason=f"generation deficit{why}, but {bound}: roles kept")
        if self._gen >= c.patience:
            p = self._move(cells, "ref", "rollout", s, rule="generation",
                           reason=f"generation deficit{why}: colocated RA2P, the Ref cell "
                                  "serves rollout")
            if p is not None:
                return p
            p = self._rated(s, cells, "trainer", "rollout", rule="generation",
                            reason=f"generation deficit{why}")
            if p is not None:
                return p
        return keep

    def _cold_start(self, s: Signals, cells: CellMap) -> ScalingPlan:
        """Lends rollout what an empty buffer leaves idle: every Ref cell (RAS = 0 is below
        any break-even: colocated RA2P) and up to `cold_start_cells` trainer cells, one more
        when an evaluation runs during the first step (rule 3)."""
        budget = self.cfg.cold_start_cells
        if budget >= 0:
            # Cells to lend so rollout holds `cold_start_share` (the Ref cells join it first).
            n_r = cells.count("rollout") + cells.count("ref")
            share = math.ceil(self.cfg.cold_start_share * len(cells.roles) - 1e-9) - n_r
            budget = max(budget, share)
        if budget >= 0 and s.eval_next and self.cfg.eval_preempt:
            budget += 1
        moves: list[Move] = []
        after = cells
        for src in ("ref", "trainer"):
            while self._can_leave(after, src) and self._can_join(after, "rollout") and (
                    src == "ref" or budget < 0 or sum(m.src == "trainer" for m in moves)
                    < budget):
                cell = self._donor(after, src, "rollout", s.pinned)
                if cell is None:
                    break
                moves.append(Move(cell, src, "rollout"))
                after = after.with_role(cell, "rollout")
        if not moves:
            return ScalingPlan(cells, ref_mode=ref_mode_of(cells))
        self._lent = tuple(m for m in moves if m.src == "trainer")
        self._since_last = math.inf  # nothing to undo: the steady-state rules start fresh
        return ScalingPlan(after, tuple(moves), rule="cold_start",
                           reason="cold start: preemptive rollout allocation while the buffer "
                                  f"is empty ({len(moves)} cells → rollout)",
                           ref_mode=ref_mode_of(after))

    def _cold_return(self, s: Signals, cells: CellMap, gen: bool) -> ScalingPlan | None:
        """The first boundary after a cold start: the lent trainer cells return, unless
        generation is then the deficit; then as many stay as the measured rates say rollout
        needs (all of them without rates). A full next batch means the generation rate was
        capped by the staleness bound, not by rollout, so it sizes nothing."""
        lent, self._lent = self._lent, ()
        own = cells.count("rollout") - sum(cells.roles[m.cell] == "rollout" for m in lent)
        target = self._balance(s, cells) if gen else None
        if target is not None:
            stay = min(len(lent), max(0, math.floor(target + 0.5) - own))
            why = (f"generation deficit; the rates ({s.gen_rate:.3g} groups/s generated, "
                   f"{s.train_rate:.3g} trained per second of compute) balance near "
                   f"{target:.1f} rollout cells")
        else:
            stay = len(lent) if gen else 0
            why = "generation deficit" if stay else "no generation deficit"
        back = len(lent) - stay
        if not back:
            return None
        return self._move(cells, "rollout", "trainer", s, rule="cold_return", n=back,
                          check_cooldown=False, prefer=[m.cell for m in lent],
                          reason=f"first readiness after the cold start: {why}; {back} of "
                                 f"{len(lent)} lent cells return")


def make_planner(ers: bool, cfg: ERSConfig, *, ra2p_live: bool,
                 patience: int | None = None) -> Planner:
    """ERS on: the readiness-aware planner (or the scripted one, `controller.elastic.script`).
    Off: the split stays (RA2P still live if asked)."""
    if ers and cfg.script:
        return ScriptedPlanner(cfg.script)
    if ers:
        return ERSPlanner(cfg)
    return KeepSplit(ra2p_live=ra2p_live, patience=patience or cfg.patience)
