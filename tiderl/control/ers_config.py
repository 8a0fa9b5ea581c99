"""The ERS planner's bounds and hysteresis (`controller.elastic`), checked as they load. No JAX.

`tiderl.control.ers.ERSPlanner` reads them; `tiderl.control.ers` re-exports `ERSConfig`.
"""

from __future__ import annotations

import dataclasses

from tiderl.configlib import ConfigError
from tiderl.control.fixed_plans import script_steps


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
    cold_start_share: float = 0.5
    """The cold start lends rollout trainer cells until rollout holds this share of the cells
    (0: none). Before any rate is measured the planner cannot tell which side the first step
    needs, only that the buffer is empty, so rollout gets at least an even split; the paper
    gives rollout every cell it can (`cold_start_cells=-1`), which here would train the first
    step at the trainer's minimum width, since lent cells return at the first boundary. In the
    simulator's table2 (OSWorld, 32 GPUs, rollout at 8 of 32, 10 steps) it cut the first step
    from 956 s to 552 s."""
    cold_start_cells: int = 0
    """Trainer cells the cold start lends to rollout at least (besides `cold_start_share`);
    they return at the first boundary unless the rates measured then say rollout needs them.
    -1: every movable cell (the trainer at its minimum for the whole first step). With
    `eval_preempt`, an evaluation during the first step borrows one more."""
    compact_busy: float = 0.85
    """A generation deficit held while the rollout engines idled more than `wait_frac` of the
    step is bound by latency (environment, staleness window), not by engines: rollout cells
    then join the trainer until the engines left would be busy this share of the step
    (n_rollout · busy / compact_busy of them, rounded up; at most `max_move_cells`). When the
    groups wait on latency, the trainer's compute after the last of them arrives is what a
    cell can shorten. 0: hold the roles instead. In the simulator's table2 (OSWorld, 32 GPUs,
    10 steps) it moved rollout from 15 cells at 66% busy to 12 at step 7: 2,792 → 2,827
    tok/s."""
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
        if not 0 <= self.cold_start_share < 1:
            raise ConfigError(f"config key 'controller.elastic.cold_start_share'="
                              f"{self.cold_start_share} must lie in [0, 1) (0.5: rollout holds "
                              "at least half of the cells during the first step; 0: off)")
        if self.cold_start_cells < -1:
            raise ConfigError("config key 'controller.elastic.cold_start_cells' must be >= 0, "
                              "or -1 (every movable cell)")
        if not 0 <= self.compact_busy <= 1:
            raise ConfigError(f"config key 'controller.elastic.compact_busy'={self.compact_busy} "
                              "must lie in [0, 1] (0.85: size rollout so its engines would be "
                              "busy 85% of the step; 0: no compaction)")
        if self.max_move_cells < 0:
            raise ConfigError("config key 'controller.elastic.max_move_cells' must be >= 0 "
                              "(0: up to half of the giving role's cells)")
