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
  The real implementation is `tiderl.elastic.CellRuntime`; a virtual-time one charges loop time.
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
    cells = plan.cells       # the roles for the next step; plan.moves: at most one Move
                             # (cell, src, dst), except the cold-start plan; plan.rule,
                             # plan.reason: why; plan.ref_mode: "decoupled" iff a ref cell

`r` is the `tiderl.control.buffer.Readiness` that `ReadinessBuffer.boundary(...)` returns (or
any object with its deficit fields); `Signals(...)` can also be filled by hand. A plan whose
`cells` equal the input (`plan.moves == ()`) changes nothing.

Rules of `ERSPlanner` (each plan carries its reason; at most one cell moves per boundary, except
the cold-start plan made before any rollout has run):

1. Cold start: maximise rollout (every Ref cell and every trainer cell above the trainer's
   minimum) — preemptive generation allocation while the buffer is empty.
2. A Ref cell whose Ref runs no forward (no KL term) joins rollout.
3. Evaluation: at the boundary that starts an evaluation (it runs during the next step) one
   cell moves to rollout preemptively; at the next boundary it returns unless generation is
   then the deficit.
4. Consumption deficit (data waits for the trainer: head-of-line latency over τ·T_step, RAS at
   or above the RA2P break-even, or rollout throttled) held for `patience` boundaries: if RA2P
   advises decoupled and there is no Ref cell, a rollout cell becomes the Ref; else a rollout
   cell joins the trainer.
5. Generation deficit (the next batch is short of B_ideal and the trainer waited) held for
   `patience` boundaries: a Ref cell joins rollout (colocated RA2P), else a trainer cell does.
6. Hysteresis: besides `patience`, a move that undoes the previous one waits `cooldown`
   boundaries, and the boundary right after the run's start or a move does not count toward
   `patience` (its step compiled, or began on the old layout). Bounds are never crossed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from tiderl.configlib import ConfigError

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
    """Before the first step, move every movable cell to rollout (the buffer is empty)."""
    eval_preempt: bool = True
    """Move one cell to rollout for the step that runs an evaluation, and back after it."""
    min_rollout_cells: int = 1
    max_rollout_cells: int = 0
    """0: no upper bound."""
    min_trainer_cells: int = 1
    max_trainer_cells: int = 0
    """0: no upper bound."""
    max_ref_cells: int = 1
    """At most this many cells hold a decoupled Ref (0: the Ref always shares the Actor's)."""

    def __post_init__(self):
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
    """keep | cold_start | no_ref | eval | eval_return | consumption | generation | ra2p"""
    ref_mode: str = "colocated"
    """RA2P mode for the next step: decoupled (Ref on the ref cells) or colocated."""


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


    @classmethod
    def from_readiness(cls, r: Any, *, step: int, eval_next: bool = False,
                       cold_start: bool = False, uses_ref: bool = True,
                       ra2p_mode: str | None = None,
                       pinned: frozenset[int] = frozenset()) -> Signals:
        """The planner's view of a boundary's `Readiness` (`ReadinessBuffer.boundary`), plus
        the run's state the buffer does not know. `ra2p_mode`: the cost model's advice (None:
        decoupled when RAS is at or above the break-even, else colocated)."""
        if ra2p_mode is None:
            ra2p_mode = "decoupled" if r.above_break_even else "colocated"
        return cls(step=step, cold_start=cold_start, eval_next=eval_next, uses_ref=uses_ref,
                   ras_next=r.ras_next, break_even_ras=r.break_even_ras, ra2p_mode=ra2p_mode,
                   generation_deficit=r.generation_deficit,
                   consumption_deficit=r.consumption_deficit,
                   above_break_even=r.above_break_even, deficit_reason=r.deficit_reason,
                   pinned=pinned)


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

    def __init__(self, cfg: ERSConfig | None = None):
        self.cfg = cfg or ERSConfig()
        self.home: tuple[str, ...] | None = None
        """Each cell's role in the first map seen: moves prefer sending cells home, so the
        trainer meshes it passes through recur (compiled once)."""
        self._gen = self._con = 0
        self._settle = True
        """The next boundary follows the run's start or a move: its step compiled, or ran on a
        layout it did not start with, so its signals do not count toward `patience`."""
        self._last: Move | None = None
        self._since_last = math.inf
        self._eval_moved: Move | None = None

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
              reason: str, check_cooldown: bool = True, cell: int | None = None
              ) -> ScalingPlan | None:
        if not (self._can_leave(cells, src) and self._can_join(cells, dst)):
            return None
        if check_cooldown and self._last is not None and (self._last.src, self._last.dst) == (
                dst, src) and self._since_last < self.cfg.cooldown:
            return None
        if cell is None or cells.roles[cell] != src or cell in signals.pinned:
            cell = self._donor(cells, src, dst, signals.pinned)
        if cell is None:
            return None
        after = cells.with_role(cell, dst)
        move = Move(cell, src, dst)
        self._last, self._since_last = move, 0
        self._settle, self._con, self._gen = True, 0, 0
        return ScalingPlan(after, (move,), reason=f"{reason}: cell {cell} {src} → {dst}",
                           rule=rule, ref_mode=_ref_mode(after))

    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        if self.home is None:
            self.home = cells.roles
        self._since_last += 1
        s, c = signals, self.cfg
        keep = ScalingPlan(cells, ref_mode=_ref_mode(cells))
        if s.cold_start:
            self._settle = True
            return self._cold_start(s, cells) if c.cold_start else keep
        if self._settle:
            self._settle, self._con, self._gen = False, 0, 0
        else:
            # A backlog at the RA2P break-even asks for a Ref cell: it is no deficit once one
            # serves (or with nothing for a Ref to compute).
            con = s.consumption_deficit or (s.above_break_even and s.uses_ref
                                            and not cells.count("ref"))
            self._con = self._con + 1 if con and not s.generation_deficit else 0
            self._gen = self._gen + 1 if s.generation_deficit and not con else 0
        if cells.count("ref") and not s.uses_ref:
            p = self._move(cells, "ref", "rollout", s, rule="no_ref", check_cooldown=False,
                           reason="no KL term, so the Ref runs no forward: its cell serves "
                                  "rollout (colocated RA2P)")
            if p is not None:
                return p
        if self._eval_moved is not None and not s.eval_next:
            back, self._eval_moved = self._eval_moved, None
            if not s.generation_deficit:
                p = self._move(cells, "rollout", back.src, s, rule="eval_return",
                               check_cooldown=False, cell=back.cell,
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
        why = f" ({s.deficit_reason})" if s.deficit_reason else ""
        if self._con >= c.patience:
            if s.uses_ref and not cells.count("ref") and (s.above_break_even
                                                           or s.ra2p_mode == "decoupled"):
                p = self._move(cells, "rollout", "ref", s, rule="consumption",
                               reason=f"consumption deficit{why}, RA2P advises decoupled "
                                      f"(RAS {s.ras_next} vs break-even {s.break_even_ras}): "
                                      "a dedicated Ref")
                if p is not None:
                    return p
            p = self._move(cells, "rollout", "trainer", s, rule="consumption",
                           reason=f"consumption deficit{why}: trainer +1 cell") \
                if s.consumption_deficit else None
            if p is not None:
                return p
        if self._gen >= c.patience:
            for src, what in (("ref", "colocated RA2P, the Ref cell serves rollout"),
                              ("trainer", "rollout +1 cell")):
                p = self._move(cells, src, "rollout", s, rule="generation",
                               reason=f"generation deficit{why}: {what}")
                if p is not None:
                    return p
        return keep

    def _cold_start(self, s: Signals, cells: CellMap) -> ScalingPlan:
        moves: list[Move] = []
        after = cells
        for src in ("ref", "trainer"):
            while self._can_leave(after, src) and self._can_join(after, "rollout"):
                cell = self._donor(after, src, "rollout", s.pinned)
                if cell is None:
                    break
                moves.append(Move(cell, src, "rollout"))
                after = after.with_role(cell, "rollout")
        if not moves:
            return ScalingPlan(cells, ref_mode=_ref_mode(cells))
        self._since_last = math.inf  # nothing to undo: the steady-state rules start fresh
        return ScalingPlan(after, tuple(moves), rule="cold_start",
                           reason="cold start: preemptive rollout allocation while the buffer "
                                  f"is empty ({len(moves)} cells → rollout)",
                           ref_mode=_ref_mode(after))


def _ref_mode(cells: CellMap) -> str:
    return "decoupled" if cells.count("ref") else "colocated"


def make_planner(ers: bool, cfg: ERSConfig, *, ra2p_live: bool,
                 patience: int | None = None) -> Planner:
    """ERS on: the readiness-aware planner. Off: the split stays (RA2P still live if asked)."""
    if ers:
        return ERSPlanner(cfg)
    return KeepSplit(ra2p_live=ra2p_live, patience=patience or cfg.patience)


def moves_between(before: CellMap, after: CellMap) -> tuple[Move, ...]:
    return tuple(Move(i, a, b) for i, (a, b) in enumerate(zip(before.roles, after.roles,
                                                               strict=True)) if a != b)


def initial_cells(counts: Sequence[tuple[str, int]]) -> CellMap:
    """A map from (role, cells) in device order, e.g. [("rollout", 1), ("trainer", 2)]."""
    return CellMap(tuple(r for r, n in counts for _ in range(n)))
