"""Elastic Resource Scaling (arXiv 2608.10402, §5.2): the planner, its inputs and its plans. No JAX.

Devices are grouped into **cells** (a cell's size is the unit both roles use: the trainer's
FSDP × model group, or that many one-device rollout ranks). Every cell holds one role:
`rollout`, `trainer` (the Actor's data-parallel width is its number of cells) or `ref` (a
decoupled RA2P Ref; none means colocated). Right after each actor update and before the weight
sync the controller builds `Signals` from the readiness buffer, asks the planner for a
`ScalingPlan` and, when the plan changes anything, carries it out (`tiderl.control.roles`).

Interface (what a simulator implements to reuse the planner and the controller unchanged):

- The controller takes `cells=CellMap(...)` (the initial role of each cell, cell id = index)
  and `ranks_per_cell=k`: cell c serves rollout ranks `c·k … c·k + k − 1`. The rollout
  manager's scheduler must have a slot for every such rank id; ranks of cells that do not
  start in rollout are created dead (`RolloutManager.add_rank` revives a slot).
- `Hooks.apply_roles(change: RoleChange, weights) -> RoleChangeResult` is awaited at the
  boundary after the controller drained the rollout ranks of every cell leaving rollout
  (their tasks migrate through CTB, cache-free, `RolloutManager.drain_rank`). It must move the
  trainer and Ref to the cells of `change.after` (Actor data width = trainer cells; Ref on the
  ref cells when `change.ref_mode == "decoupled"`, else on the Actor's), start one rollout
  rank (`serving.rank.RolloutRank`, any engine; rank id as above, weights = `weights` at
  `change.version`) per rank slot of every cell joining rollout, and return those ranks
  (started) with what the change cost in seconds (`RoleChangeResult.cost`: `move_s`, `join_s`,
  any further numbers). The controller then adds the ranks, syncs weights to every live rank,
  and logs one `role_change` record with the plan's reason, the drain time and that cost.
  The real implementation is `tiderl.runtime.elastic.CellRuntime`; a virtual-time one charges loop time.
- `Hooks.compile_stats() -> {"compiles": n, "compile_s": s}` (optional, cumulative): lets the
  record count compilations during the change and during the step after it.
- The trainer port may offer `uses_ref` (bool: the loss has a KL term), `cost_model(m_actor)
  -> tiderl.train.ra2p.CostModel` (measured phase costs; gives the break-even RAS) and
  `advise_mode(ready_times, m_actor) -> ra2p.ModeChoice`; without them the Ref counts as used
  and the RA2P advice is the current mode. `m_actor` is the number of trainer cells.
- `Controller(..., planner=ERSPlanner(cfg), cells=CellMap(...), ranks_per_cell=k,
  ref_mode="decoupled" | "colocated")` — nothing else changes; a hook-less run keeps its roles.
- The planner sees only `Signals` and the `CellMap`; it keeps its own hysteresis state and is
  deterministic, so a replayed trace gives the same plans.

Calling the planner directly (a simulator that runs its own loop): one planner object per run
(it holds the hysteresis), one call per sync boundary, JAX-free:

    from tiderl.control.ers import CellMap, ERSConfig, ERSPlanner, Signals
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

`ScriptedPlanner` (`controller.elastic.script`) replaces the rules by a fixed sequence of
role maps, one per named boundary, for tests and for replaying a trace.

Rules of `ERSPlanner` (each plan carries its reason):

1. Cold start (before any rollout): lend rollout what an empty buffer leaves idle — every Ref
   cell (RAS = 0 is below any RA2P break-even, so colocated) and `cold_start_cells` trainer
   cells (default 0; -1 lends every movable cell, the paper's maximal preemption), one more
   when an evaluation runs during the first step (rule 3). At the first boundary the lent trainer cells return, all at once, unless generation is then the
   deficit; then as many stay as the rates say rollout needs.
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
   `patience` boundaries: a Ref cell joins rollout (colocated RA2P), else trainer cells do.
6. Sizing: the signals choose the direction, the measured rates the size. Groups generated per
   rollout cell (the throttled share of the interval taken out) against groups trained per
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
from typing import Any, Literal, Protocol

from tiderl.configlib import ConfigError
from tiderl.control.ers_rates import RateModel

ROLES = ("rollout", "trainer", "ref")
Role = Literal["rollout", "trainer", "ref"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERSConfig:
    """Bounds and hysteresis of the ERS planner (`controller.elastic`)."""

    tau: float = 0.5
    """τ: head-of-line latency over τ·T_step is a consumption deficit, and a step that holds
    B_min stops waiting for more data once its wait would pass τ·T_step (elastic batch)."""
    wait_frac: float = 0.25
    """A step whose trainer waited (TWT), or whose rollout sat throttled (RWT), more than this
    share of the step time shows a generation (resp. consumption) deficit."""
    patience: int = 2
    """Consecutive boundaries a deficit must hold before a cell moves."""
    cooldown: int = 3
    """Boundaries before a move may undo the previous move."""
    cold_start: bool = True
    """Before the first step, lend rollout the cells an empty buffer leaves idle: every Ref
    cell (RAS = 0 is below any RA2P break-even) and `cold_start_cells` trainer cells."""
    cold_start_cells: int = 0
    """Trainer cells the cold start lends to rollout; they return at the first boundary unless
    the rates measured then say rollout needs them. -1: every movable cell (the trainer at its
    minimum for the whole first step). 0 by default: a streaming trainer needs its width as
    soon as the first micro-batch is ready. With `eval_preempt`, an evaluation during the
    first step borrows one more."""
    max_move_cells: int = 0
    """Most cells one plan moves when the measured rates call for several (0: up to half of
    the giving role's cells, rounded up)."""
    eval_preempt: bool = True
    """Move one cell to rollout for the step that runs an evaluation, and back after it."""
    learned_rates: bool = False
    """Size and gate a deficit's move by what it is predicted to buy from the rates measured
    at each width (`ers_rates.RateModel`: the size that saves the most waiting over
    cooldown + patience steps net of the move's cost; a `hold` plan when none pays), and call
    a consumption deficit from those rates before the buffer shows one. Off by default: in
    the simulator's fig8 (Qwen2.5-7B, 32 H100s, 20 steps) it lowered tiderl's goodput from
    5.71k to 5.08k tok/s (its first move overshot: predicted 2.01 groups/s, realised 1.16);
    off, moves are sized linearly by the rates (`_size`).
    Each step record's `plan_effect` carries the prediction and what a move realised."""
    min_rollout_cells: int = 1
    max_rollout_cells: int = 0
    """0: no upper bound."""
    min_trainer_cells: int = 1
    max_trainer_cells: int = 0
    """0: no upper bound."""
    max_ref_cells: int = 1
    """At most this many cells hold a decoupled Ref (0: the Ref always shares the Actor's)."""
    script: tuple[str, ...] = ()
    """A fixed role sequence instead of the readiness rules (`ScriptedPlanner`; for tests and
    for replaying a trace): entries 'STEP:ROLE,ROLE,...', the role of every cell (rollout,
    trainer or ref, in cell order) to take at the boundary after update STEP. Bounds,
    patience and cooldown do not apply; the roles must keep a trainer cell."""

    def __post_init__(self):
        script_steps(self.script)
        if self.tau <= 0:
            raise ConfigError(f"config key 'controller.elastic.tau'={self.tau} must be > 0 "
                              "(e.g. 0.5: half a step of head-of-line latency)")
        if not 0 < self.wait_frac < 1:
            raise ConfigError("config key 'controller.elastic.wait_frac' must lie in (0, 1)")
        if self.patience < 1 or self.cooldown < 0:
            raise ConfigError("config keys 'controller.elastic.patience' (>= 1) / 'cooldown' "
                              "(>= 0) out of range")
        for name in ("min_rollout_cells", "min_trainer_cells"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key 'controller.elastic.{name}' must be >= 1")
        for lo, hi in (("min_rollout_cells", "max_rollout_cells"),
                       ("min_trainer_cells", "max_trainer_cells")):
            top = getattr(self, hi)
            if top and top < getattr(self, lo):
                raise ConfigError(f"config key 'controller.elastic.{hi}'={top} is below "
                                  f"controller.elastic.{lo}={getattr(self, lo)}; raise it or "
                                  "set 0 (no bound)")
        if self.max_ref_cells < 0:
            raise ConfigError("config key 'controller.elastic.max_ref_cells' must be >= 0")
        if self.cold_start_cells < -1:
            raise ConfigError("config key 'controller.elastic.cold_start_cells' must be >= 0, "
                              "or -1 (every movable cell)")
        if self.max_move_cells < 0:
            raise ConfigError("config key 'controller.elastic.max_move_cells' must be >= 0 "
                              "(0: up to half of the giving role's cells)")


@dataclasses.dataclass(frozen=True)
class CellMap:
    """The role of every cell (cell id = index into `roles`)."""

    roles: tuple[str, ...]

    def __post_init__(self):
        bad = [r for r in self.roles if r not in ROLES]
        if bad:
            raise ValueError(f"cell roles must be one of {ROLES}, got {bad}")

    def cells(self, role: str) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r == role)

    def count(self, role: str) -> int:
        return sum(r == role for r in self.roles)

    def with_role(self, cell: int, role: str) -> CellMap:
        roles = list(self.roles)
        roles[cell] = role
        return CellMap(tuple(roles))

    def describe(self) -> dict[str, list[int]]:
        return {r: list(self.cells(r)) for r in ROLES}


@dataclasses.dataclass(frozen=True)
class Move:
    cell: int
    src: str
    dst: str


@dataclasses.dataclass(frozen=True)
class ScalingPlan:
    """What the roles should be for the next step, and why."""

    cells: CellMap
    moves: tuple[Move, ...] = ()
    reason: str = "keep"
    rule: str = "keep"
    """keep | cold_start | cold_return | no_ref | eval | eval_return | consumption | generation |
    hold (a deficit no move pays for) | ra2p | scripted"""
    ref_mode: str = "colocated"
    """RA2P mode for the next step: decoupled (Ref on the ref cells) or colocated."""
    effect: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    """What the planner predicts this plan's move buys (`predicted_*`, `move_cost_s`) and,
    once measured, what the previous move realised (`realised`): `RateModel`."""


@dataclasses.dataclass(frozen=True)
class RoleChange:
    """A plan the controller is carrying out (see the module docstring)."""

    step: int
    version: int
    before: CellMap
    after: CellMap
    moves: tuple[Move, ...]
    ref_mode: str
    reason: str
    ranks_per_cell: int = 1

    def joining_rollout(self) -> list[int]:
        return [m.cell for m in self.moves if m.dst == "rollout"]

    def rank_ids(self, cell: int) -> list[int]:
        k = self.ranks_per_cell
        return list(range(cell * k, cell * k + k))


@dataclasses.dataclass
class RoleChangeResult:
    """What `Hooks.apply_roles` returns: started ranks for the cells joining rollout, and costs."""

    ranks: list[Any] = dataclasses.field(default_factory=list)
    cost: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Signals:
    """What the planner reads at a boundary (the buffer's `Readiness` plus the run's state)."""

    step: int = 0
    cold_start: bool = False
    eval_next: bool = False
    """An evaluation starts now and runs during the next step."""
    uses_ref: bool = True
    """The loss has a KL term (a Ref forward runs)."""
    ras_next: int = 0
    """Micro-batches ready now (the next step's RAS if it started now)."""
    break_even_ras: int = 0
    """The RA2P break-even: from this RAS on, decoupled beats colocated."""
    ra2p_mode: str = "colocated"
    """The cost model's advice for the next step (C_dec vs C_col)."""
    generation_deficit: bool = False
    consumption_deficit: bool = False
    """Data waits for the trainer (head-of-line latency over τ·T_step, or rollout throttled)."""
    above_break_even: bool = False
    """RAS now is at or above the RA2P break-even (with a Ref forward to run)."""
    deficit_reason: str = ""
    pinned: frozenset[int] = frozenset()
    """Cells never moved (e.g. a rollout rank there failed)."""
    gen_rate: float = float("nan")
    """Trainable groups per second arriving from rollout (the buffer's `gen_rate`)."""
    train_rate: float = float("nan")
    """Groups per second the trainer trains while computing (its last step's groups over
    its step time less TWT): the consumption capacity at the current width."""
    twt_frac: float = 0.0
    """Share of the last step the trainer waited for data."""
    rwt_frac: float = 0.0
    """Share of the interval since the previous boundary rollout sat throttled."""
    hol_limit_s: float = float("inf")
    """τ·T_step (the buffer's head-of-line limit): gives the planner the step time."""
    move_cost_s: float = float("nan")
    """Seconds a role change costs (drain, weight loads, join), when the caller knows it."""
    ref_pace: float = float("inf")
    """Actor cells one Ref cell keeps pace with in decoupled mode: (t_act_f + t_act_b) / t_ref
    of the trainer's measured phase costs (a Ref forward is about a third of an Actor's forward
    and backward: 2 against 6 FLOPs per parameter per token, so about 3). A Ref cell serving
    more Actor cells than this makes the Ref the pipeline's bottleneck. inf: unknown."""

    @classmethod
    def from_readiness(cls, r: Any, *, step: int, eval_next: bool = False,
                       cold_start: bool = False, uses_ref: bool = True,
                       ra2p_mode: str | None = None, train_rate: float = float("nan"),
                       ref_pace: float = float("inf"),
                       pinned: frozenset[int] = frozenset()) -> Signals:
        """The planner's view of a boundary's `Readiness` (`ReadinessBuffer.boundary`), plus
        the run's state the buffer does not know. `ra2p_mode`: the cost model's advice (None:
        decoupled when RAS is at or above the break-even, else colocated); `train_rate`: the
        trainer's groups per second of compute (without it the planner moves one cell at a
        time)."""
        if ra2p_mode is None:
            ra2p_mode = "decoupled" if r.above_break_even else "colocated"
        return cls(step=step, cold_start=cold_start, eval_next=eval_next, uses_ref=uses_ref,
                   ras_next=r.ras_next, break_even_ras=r.break_even_ras, ra2p_mode=ra2p_mode,
                   generation_deficit=r.generation_deficit,
                   consumption_deficit=r.consumption_deficit,
                   above_break_even=r.above_break_even, deficit_reason=r.deficit_reason,
                   pinned=pinned, ref_pace=ref_pace,
                   gen_rate=float(getattr(r, "gen_rate", float("nan"))),
                   train_rate=train_rate, twt_frac=float(getattr(r, "twt_frac", 0.0)),
                   rwt_frac=float(getattr(r, "rwt_frac", 0.0)),
                   hol_limit_s=float(getattr(r, "hol_limit_s", float("inf"))))


class Planner(Protocol):
    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan: ...


class KeepSplit:
    """Keeps the cells where they are (every fixed-ratio baseline, and ERS off). With
    `ra2p_live`, the RA2P mode follows the cost model's advice (held `patience` boundaries)
    on the cells as they are: a reserved Ref cell serves when decoupled and idles otherwise."""

    def __init__(self, *, ra2p_live: bool = False, patience: int = 2,
                 ref_mode: str | None = None):
        self.ra2p_live = ra2p_live
        self.patience = patience
        self.ref_mode = ref_mode
        self._streak = 0
        self._settle = True  # the run's first boundary (compilation) and one after a switch

    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        have_ref = cells.count("ref") > 0
        mode = self.ref_mode or ("decoupled" if have_ref else "colocated")
        if not self.ra2p_live or not have_ref:
            return ScalingPlan(cells, ref_mode=mode)
        want = signals.ra2p_mode if signals.uses_ref else "colocated"
        if signals.cold_start or self._settle:
            self._settle = signals.cold_start
            self._streak = 0
            return ScalingPlan(cells, ref_mode=mode)
        self._streak = self._streak + 1 if want != mode else 0
        if self._streak >= self.patience:
            self.ref_mode, self._streak, self._settle = want, 0, True
            return ScalingPlan(cells, ref_mode=want, rule="ra2p",
                               reason=f"RA2P: {want} (cost model advice held {self.patience} "
                                      "boundaries); cells unchanged (ERS off)")
        return ScalingPlan(cells, ref_mode=mode)


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
                           rule=rule, ref_mode=_ref_mode(after))

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
            return ScalingPlan(cells, rule="hold", ref_mode=_ref_mode(cells), effect=pred,
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
        realised = self._learn(signals, cells)
        plan = self._plan(signals, cells)
        if realised is not None:
            plan = dataclasses.replace(plan, effect={**plan.effect, "realised": realised})
        return plan

    def _plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        if self.home is None:
            self.home = cells.roles
        self._since_last += 1
        s, c = signals, self.cfg
        keep = ScalingPlan(cells, ref_mode=_ref_mode(cells))
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
            p = self._cold_return(s, cells, gen)
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
            return ScalingPlan(cells, ref_mode=_ref_mode(cells))
        self._lent = tuple(m for m in moves if m.src == "trainer")
        self._since_last = math.inf  # nothing to undo: the steady-state rules start fresh
        return ScalingPlan(after, tuple(moves), rule="cold_start",
                           reason="cold start: preemptive rollout allocation while the buffer "
                                  f"is empty ({len(moves)} cells → rollout)",
                           ref_mode=_ref_mode(after))

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


def script_steps(script: Sequence[str]) -> dict[int, tuple[str, ...]]:
    """`controller.elastic.script` parsed: boundary step → the roles of every cell."""
    out: dict[int, tuple[str, ...]] = {}
    for entry in script:
        step, sep, roles = str(entry).partition(":")
        cells = tuple(r.strip() for r in roles.split(",") if r.strip())
        if not sep or not step.strip().isdigit() or not cells or any(r not in ROLES
                                                                     for r in cells):
            raise ConfigError(f"config key 'controller.elastic.script' entry {entry!r} is not "
                              "'STEP:ROLE,ROLE,...' with roles from " + "/".join(ROLES) +
                              " (e.g. '2:rollout,trainer,trainer,trainer')")
        if "trainer" not in cells:
            raise ConfigError(f"config key 'controller.elastic.script' entry {entry!r} leaves "
                              "no trainer cell; keep at least one")
        if int(step) in out:
            raise ConfigError(f"config key 'controller.elastic.script' names step {step} twice")
        out[int(step)] = cells
    return out


class ScriptedPlanner:
    """Takes the roles `controller.elastic.script` names at its steps, and keeps them
    otherwise (no cold start, no bounds, no hysteresis): a reproducible role sequence."""

    def __init__(self, script: Sequence[str]):
        self.steps = script_steps(script)

    def check(self, cells: CellMap, *, ref_ok: bool = True) -> None:
        """A ConfigError unless every scripted map has one role per cell of `cells` (and,
        `ref_ok` False, no Ref cell)."""
        for step, roles in self.steps.items():
            if len(roles) != len(cells.roles):
                raise ConfigError(
                    f"config key 'controller.elastic.script' step {step} names {len(roles)} "
                    f"cells; this run has {len(cells.roles)} ({','.join(cells.roles)})")
            if not ref_ok and "ref" in roles:
                raise ConfigError(
                    f"config key 'controller.elastic.script' step {step} makes a Ref cell; "
                    "a decoupled Ref is not supported on several processes (use rollout and "
                    "trainer only)")

    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        roles = self.steps.get(signals.step) if not signals.cold_start else None
        if roles is None or len(roles) != len(cells.roles):
            return ScalingPlan(cells, ref_mode=_ref_mode(cells))
        after = CellMap(roles)
        return ScalingPlan(after, moves_between(cells, after), rule="scripted",
                           reason=f"scripted (controller.elastic.script, step "
                                  f"{signals.step})", ref_mode=_ref_mode(after))


def _ref_mode(cells: CellMap) -> str:
    return "decoupled" if cells.count("ref") else "colocated"


def make_planner(ers: bool, cfg: ERSConfig, *, ra2p_live: bool,
                 patience: int | None = None) -> Planner:
    """ERS on: the readiness-aware planner (or the scripted one, `controller.elastic.script`).
    Off: the split stays (RA2P still live if asked)."""
    if ers and cfg.script:
        return ScriptedPlanner(cfg.script)
    if ers:
        return ERSPlanner(cfg)
    return KeepSplit(ra2p_live=ra2p_live, patience=patience or cfg.patience)


def moves_between(before: CellMap, after: CellMap) -> tuple[Move, ...]:
    return tuple(Move(i, a, b) for i, (a, b) in enumerate(zip(before.roles, after.roles,
                                                               strict=True)) if a != b)


def initial_cells(counts: Sequence[tuple[str, int]]) -> CellMap:
    """A map from (role, cells) in device order, e.g. [("rollout", 1), ("trainer", 2)]."""
    return CellMap(tuple(r for r, n in counts for _ in range(n)))
