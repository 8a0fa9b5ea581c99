"""Cells, their roles and the plans that change them: what a scaling planner reads and returns,
and the role change the controller carries out. No JAX.

Devices are grouped into **cells** (a cell's size is the unit both roles use: the trainer's
FSDP × model group, or that many one-device rollout ranks). Every cell holds one role:
`rollout`, `trainer` (the Actor's data-parallel width is its number of cells) or `ref` (a
decoupled RA2P Ref; none means colocated). Right after each actor update and before the weight
sync the controller builds `Signals` from the readiness buffer, asks the planner for a
`ScalingPlan` and, when the plan changes anything, carries it out (`tiderl.control.roles`).

Interface (what a simulator implements to reuse the planners and the controller unchanged):

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
  The real implementation is `tiderl.runtime.elastic.CellRuntime`; a virtual-time one charges
  loop time.
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

The planners: `tiderl.control.ers.ERSPlanner` (the readiness rules), and
`tiderl.control.fixed_plans` (`KeepSplit`, `ScriptedPlanner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol

ROLES = ("rollout", "trainer", "ref")
Role = Literal["rollout", "trainer", "ref"]


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
    rollout_busy: float = float("nan")
    """Share of the last step the rollout engines had a call in flight (mean over ranks; nan:
    unknown). Well below 1 while the trainer waits: generation is bound by latency
    (environment, staleness window), not by rollout capacity."""
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
                       rollout_busy: float = float("nan"),
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
                   train_rate=train_rate, rollout_busy=rollout_busy,
                   twt_frac=float(getattr(r, "twt_frac", 0.0)),
                   rwt_frac=float(getattr(r, "rwt_frac", 0.0)),
                   hol_limit_s=float(getattr(r, "hol_limit_s", float("inf"))))


class Planner(Protocol):
    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan: ...


def ref_mode_of(cells: CellMap) -> str:
    """The RA2P mode a map implies: decoupled iff some cell holds the Ref."""
    return "decoupled" if cells.count("ref") else "colocated"


def moves_between(before: CellMap, after: CellMap) -> tuple[Move, ...]:
    return tuple(Move(i, a, b) for i, (a, b) in enumerate(zip(before.roles, after.roles,
                                                               strict=True)) if a != b)


def initial_cells(counts: Sequence[tuple[str, int]]) -> CellMap:
    """A map from (role, cells) in device order, e.g. [("rollout", 1), ("trainer", 2)]."""
    return CellMap(tuple(r for r, n in counts for _ in range(n)))
