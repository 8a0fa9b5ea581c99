"""CTB's configuration (`rollout.ctb`): priority weights, budgets, admission constraints and the
release valve. No JAX."""

from __future__ import annotations

import dataclasses

from tiderl.configlib import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class CTBConfig:
    """Weights and constraints of the task scheduler."""

    w_eval: float = 64.0
    w_group: float = 32.0
    w_active: float = 2.0
    w_context: float = 1.0
    budget_fraction: float = 0.85
    """Share of a rank's KV capacity CTB may plan with; the rest absorbs page rounding and lets
    paused tasks keep their KV until it is needed."""
    action_reserve: int = 16
    """Tokens reserved per active task for its next action."""
    env_concurrency: int = 1024
    """Max active tasks across all ranks (what the environments can run in parallel)."""
    diversity_weight: float = 1.0
    """Penalty, in queue positions, per group of the same task type already on a rank."""
    lookahead: int = 8
    """How many queued groups admission may look past the head to honour diversity."""
    vanilla_concurrency: int = 64
    """Baseline only: fixed cap on tasks in flight (request-level continuous batching)."""
    plan_growth: bool = True
    """Admit a new task only if the rank's active tasks and it still fit once each has grown to
    its projected final context: the mean final context of finished tasks of its type, or before
    any has finished, its context plus the type's mean growth per turn times the turns it has
    left (`horizon_turns`). Contexts grow every turn; admitting by current size alone
    over-admits and later pauses (and, when pages run short, evicts) tasks in mid-flight.
    Resumes use current sizes: those tasks are underway."""
    growth_horizon: float = 0.5
    """Share of a task's remaining growth that admission plans for (see `plan_growth`). 1 never
    over-admits but idles KV that tasks reach only at their last turn; staggered tasks hold
    about half their final context on average, and pausing absorbs the rest."""
    overcommit_max: float = 1.0
    """Most a rank's budget stretches past its KV pool while its engine idles: to 1 / its
    busy share (exponential average), so an engine busy half the time plans with twice its
    budget. Keeping a waiting task's KV is worth the room only while recomputing it would
    take engine time that is scarce; past the pool, the KV of tasks waiting on their
    environment is evicted as pages run short (paused or parked ones first, lowest
    `keep_value` first; then the others, least recently used) and computed again
    in time the engine would otherwise idle. A busy engine (long contexts, expensive
    recompute) keeps the plain budget. 1 (the default) turns it off. Measured, it pays for
    short contexts on a slow engine and loses in the simulated GPU cluster, where computing
    long contexts again is not free even while the engine idles between environment waits."""
    shared_prompts: bool = True
    """Count a GRPO group's prompt (its whole KV pages) once per rank: ranks with prefix
    sharing (`rollout.share_prefixes`, on by default) hold it once for all siblings there.
    A run with sharing off counts prompts per task whatever this says."""
    park_below_busy: float = 0.9
    """Release valve: while a rank's engine is busy less than this share of the time and
    ready or queued tasks wait for room, park (pause) tasks there that wait on their
    environment (for a queued task, only those that will for a while yet, see
    `park_min_wait`): they keep their KV until pages are needed, hold no budget, and are
    resumed first once their environment answers. A rank busier than this parks nothing:
    its engine has no time for more work, and parked KV evicted when pages run short is
    computed again. 0 turns parking off (tasks pause only when their rank is over budget)."""
    park_min_wait: float = 0.5
    """Park only a task whose expected remaining environment wait (learned per task type) is
    at least this share of the type's mean wait."""
    park_per_round: int = 8
    """Most tasks one scheduling round parks (keeps a round cheap)."""
    wait_samples: int = 8
    """Environment waits of a task type seen before CTB weighs expected waits (parking, the
    context tier of `keep_value`)."""

    def __post_init__(self):
        if not self.w_active > self.w_context:
            raise ConfigError("config key 'rollout.ctb.w_active' must exceed rollout.ctb.w_context "
                              "(tier order: active > context length)")
        if not self.w_eval > self.w_group + self.w_active + self.w_context:
            raise ConfigError("config key 'rollout.ctb.w_eval' must exceed w_group + w_active + "
                              "w_context (eval is the top tier)")
        if not 0 <= self.growth_horizon <= 1:
            raise ConfigError("config key 'rollout.ctb.growth_horizon' must be in [0, 1]")
        if not 0 < self.budget_fraction <= 1:
            raise ConfigError("config key 'rollout.ctb.budget_fraction' must be in (0, 1]")
        if self.action_reserve < 0:
            raise ConfigError("config key 'rollout.ctb.action_reserve' must be >= 0")
        if not 0 <= self.park_below_busy <= 1:
            raise ConfigError("config key 'rollout.ctb.park_below_busy' must be in [0, 1] "
                              "(0 turns parking off)")
        if self.overcommit_max < 1:
            raise ConfigError("config key 'rollout.ctb.overcommit_max' must be >= 1 (1 keeps "
                              "the budget within the KV pool)")
        if self.park_min_wait < 0:
            raise ConfigError("config key 'rollout.ctb.park_min_wait' must be >= 0")
        for name in ("env_concurrency", "lookahead", "vanilla_concurrency", "park_per_round",
                     "wait_samples"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'rollout.ctb.{name}' must be positive")

    def check_group_size(self, group_size: int) -> None:
        """Group completion moves in steps of 1/G; one step must outrank the lower tiers."""
        if self.w_group / group_size <= self.w_active + self.w_context:
            raise ConfigError(
                f"config key 'rollout.ctb.w_group'={self.w_group} is too small for groups of "
                f"{group_size}: w_group / group_size must exceed w_active + w_context; raise it "
                f"above {group_size * (self.w_active + self.w_context)}"
            )
