"""Continuous Task Batching (paper §4, Algorithm 1) and the request-level baseline. No JAX.

One scheduler sees every rollout rank. It holds no device state: ranks report usage, the
scheduler answers with decisions (`Admit`, `Pause`, `Resume`) that the ranks apply.

Token accounting. A rank's usage is the KV its *active* tasks need: each task's context plus a
reserve for the next action (with `shared_prompts`, a GRPO group's prompt counts once per rank,
for ranks whose siblings share prompt pages through `fork`). Paused tasks do not count (the
rank may keep their KV until pages are needed). Usage is refreshed at the start of every turn
(`update_usage`). The probe: a group whose size is unknown sends one task first; its first
turn sizes the siblings (and other groups of its type). With `plan_growth`, admission also
projects growth (learned online per task type) so tasks are not admitted only to be paused.

Priority. `P(t) = w1·I_eval + w2·G_completion + w3·I_active + w4·L_context`, with L normalised to
[0, 1) by `max_context`. The weights must keep the tiers lexicographic (checked in CTBConfig).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal

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
    shared_prompts: bool = False
    """Count a GRPO group's prompt once per rank (siblings share its pages through `fork`).
    Leave off unless the ranks fork siblings: a rank that prefills each sibling separately
    holds the prompt once per task, and planning with shared prompts would overfill it."""

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
        for name in ("env_concurrency", "lookahead", "vanilla_concurrency"):
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


@dataclasses.dataclass
class Task:
    """What the scheduler knows of one task (one trajectory)."""

    task_id: str
    group_id: str
    prompt_tokens: int
    is_eval: bool = False
    task_type: str = ""
    tokens: int = 0
    """Current context length (prompt + turns so far)."""
    state: Literal["new", "active", "paused", "done"] = "new"
    rank: int | None = None
    """Where the task is active, or (paused) where its KV may still be resident."""
    executing: bool = False
    """In a prefill/decode now (vs waiting on its environment)."""
    measured: bool = False
    """Its context length has been reported (`update_usage`); until then usage uses the probe."""
    turns: int = 0
    """Turns started (`update_usage` calls)."""

    def __post_init__(self):
        self.tokens = max(self.tokens, self.prompt_tokens)


@dataclasses.dataclass(frozen=True)
class Admit:
    task_id: str
    rank: int


@dataclasses.dataclass(frozen=True)
class Pause:
    task_id: str
    rank: int


@dataclasses.dataclass(frozen=True)
class Resume:
    task_id: str
    rank: int
    migrated: bool
    """True when the task resumes on a rank other than the one that held its KV."""


Decision = Admit | Pause | Resume


class _Base:
    """Bookkeeping shared by CTB and the vanilla baseline."""

    def __init__(self, cfg: CTBConfig, capacities: Iterable[int], *, max_context: int,
                 max_tasks_per_rank: int | None = None):
        self.cfg = cfg
        self.capacity = list(capacities)
        self.max_tasks_per_rank = max_tasks_per_rank
        """Engine slots per rank: a resident task holds one while it waits on its env."""
        self.max_context = max_context
        self.tasks: dict[str, Task] = {}
        self.groups: dict[str, list[str]] = {}
        self.queue: OrderedDict[str, list[str]] = OrderedDict()  # group -> unadmitted task ids
        self.group_done: dict[str, int] = {}
        self.group_probe: dict[str, int] = {}
        self.final_context: dict[str, tuple[int, int]] = {}
        """Per task type: (sum, count) of the context lengths finished tasks reached."""
        self.growth: dict[str, tuple[int, int]] = {}
        """Per task type: (sum, count) of context growth between consecutive turns."""
        self.horizon_turns: int | None = None
        self._fresh: set[str] = set()
        """Tasks admitted in the current round: never preempted in the same round."""
        """Turn limit of an episode (the runner sets it); bounds projected growth."""
        self.dead: set[int] = set()
        self.admission_limit: int | None = None

    # -- inputs -------------------------------------------------------------------------------
    def submit(self, tasks: Iterable[Task]) -> None:
        for t in tasks:
            if t.task_id in self.tasks:
                raise ValueError(f"task {t.task_id!r} submitted twice")
            self.tasks[t.task_id] = t
            self.groups.setdefault(t.group_id, []).append(t.task_id)
            self.group_done.setdefault(t.group_id, 0)
            self.queue.setdefault(t.group_id, []).append(t.task_id)

    def update_usage(self, task_id: str, tokens: int, *, executing: bool | None = None) -> None:
        """Called at the start of every turn with the task's context length."""
        t = self.tasks[task_id]
        if t.measured and tokens > t.tokens:
            total, n = self.growth.get(t.task_type, (0, 0))
            self.growth[t.task_type] = (total + tokens - t.tokens, n + 1)
        t.tokens, t.measured = tokens, True
        t.turns += 1
        if executing is not None:
            t.executing = executing
        self.group_probe.setdefault(t.group_id, tokens)

    def set_executing(self, task_id: str, executing: bool) -> None:
        self.tasks[task_id].executing = executing

    def finish(self, task_id: str) -> None:
        t = self.tasks[task_id]
        if t.state == "done":
            return
        if t.state == "new":
            self.queue[t.group_id].remove(task_id)
        if t.measured:
            total, n = self.final_context.get(t.task_type, (0, 0))
            self.final_context[t.task_type] = (total + t.tokens, n + 1)
        t.state, t.executing = "done", False
        self.group_done[t.group_id] += 1
        if self.group_done[t.group_id] == len(self.groups[t.group_id]):
            # The whole group is over: forget it (long runs would otherwise grow without bound).
            for tid in self.groups.pop(t.group_id):
                del self.tasks[tid]
            del self.group_done[t.group_id]
            self.group_probe.pop(t.group_id, None)
            self.queue.pop(t.group_id, None)

    def set_admission_limit(self, n: int | None) -> None:
        """Staleness throttle from the controller: how many more tasks may start (None: any)."""
        self.admission_limit = n

    def remove_rank(self, rank: int) -> list[str]:
        """Quarantines `rank`; its tasks become paused with no residency (they re-prefill)."""
        self.dead.add(rank)
        moved = []
        for t in self.tasks.values():
            if t.rank == rank and t.state in ("active", "paused"):
                t.state, t.rank, t.executing = "paused", None, False
                moved.append(t.task_id)
        return moved

    def flush(self) -> None:
        """Weight sync: every rank's KV is stale, so paused tasks lose their residency."""
        for t in self.tasks.values():
            if t.state == "paused":
                t.rank = None

    # -- views --------------------------------------------------------------------------------
    def live_ranks(self) -> list[int]:
        return [r for r in range(len(self.capacity)) if r not in self.dead]

    def active_on(self, rank: int) -> list[Task]:
        return [t for t in self.tasks.values() if t.state == "active" and t.rank == rank]

    def n_active(self) -> int:
        return sum(t.state == "active" for t in self.tasks.values())

    def pending(self) -> int:
        return sum(len(v) for v in self.queue.values()) + sum(
            t.state == "paused" for t in self.tasks.values())

    def completion(self, group_id: str) -> float:
        return self.group_done[group_id] / len(self.groups[group_id])

    def _take_admission(self) -> bool:
        if self.admission_limit is None:
            return True
        if self.admission_limit <= 0:
            return False
        self.admission_limit -= 1
        return True


class CTBScheduler(_Base):
    """Algorithm 1: per-rank token budgets, RL-aware priority, pause/resume, group affinity."""

    def budget(self, rank: int) -> int:
        return int(self.capacity[rank] * self.cfg.budget_fraction)

    def priority(self, t: Task) -> float:
        c = self.cfg
        return (c.w_eval * t.is_eval + c.w_group * self.completion(t.group_id)
                + c.w_active * (t.state == "active" and t.executing)
                + c.w_context * min(t.tokens / self.max_context, 0.999))

    def usage(self, rank: int, extra: Task | None = None) -> int:
        """KV tokens the rank's active tasks (plus `extra`) need; shared prompts count once."""
        return self._usage_of(self.active_on(rank) + ([extra] if extra is not None else []))

    def _usage_of(self, tasks: list[Task]) -> int:
        if not self.cfg.shared_prompts:
            return sum(self.footprint(t) + self.cfg.action_reserve for t in tasks)
        prompts: dict[str, int] = {}
        own = 0
        for t in tasks:
            prompts[t.group_id] = max(prompts.get(t.group_id, 0), t.prompt_tokens)
            own += self.footprint(t) - t.prompt_tokens + self.cfg.action_reserve
        return sum(prompts.values()) + own

    def footprint(self, t: Task) -> int:
        """The measured context; before the task's first turn, the probed estimate."""
        if t.measured:
            return t.tokens
        return max(t.tokens, self.estimate(t) or 0)

    def estimate(self, t: Task) -> int | None:
        """First-turn footprint of `t`'s group: its probe, else the largest probe among groups
        of the same task type; None when nothing is known yet."""
        if t.group_id in self.group_probe:
            return self.group_probe[t.group_id]
        same = [self.group_probe[g] for g, tids in self.groups.items()
                if g in self.group_probe and self.tasks[tids[0]].task_type == t.task_type]
        return max(same) if same else None

    def _probing(self, t: Task) -> bool:
        """`t`'s size (or, planning growth, its type's growth) is unknown and a task already
        went ahead as the probe: wait for the probe's first turns."""
        if self._growth_unknown(t):
            return any(s.state in ("active", "paused") and s.task_type == t.task_type
                       for s in self.tasks.values())
        if t.prompt_tokens or self.estimate(t) is not None:
            return False
        return any(self.tasks[s].state in ("active", "paused") and not self.tasks[s].measured
                   for s in self.groups[t.group_id])

    def _fits(self, t: Task, rank: int) -> bool:
        if self.max_tasks_per_rank is not None and not (t.state == "active" and t.rank == rank) \
                and len(self.active_on(rank)) >= self.max_tasks_per_rank:
            return False
        probe = dataclasses.replace(t, tokens=self.footprint(t))
        return self.usage(rank, probe) <= self.budget(rank)

    def expected_final(self, task_type: str) -> int | None:
        """Mean context length finished tasks of `task_type` reached; None before the first."""
        total, n = self.final_context.get(task_type, (0, 0))
        return total // n if n else None

    def projected(self, t: Task) -> int | None:
        """`t`'s projected final context (see `plan_growth`); None when nothing is known."""
        now = self.footprint(t)
        h = self.cfg.growth_horizon
        final = self.expected_final(t.task_type)
        if final is not None:
            return max(now, int(now + h * (final - now)))
        total, n = self.growth.get(t.task_type, (0, 0))
        if n and self.horizon_turns is not None:
            left = max(0, self.horizon_turns - max(t.turns, 1))
            return min(self.max_context, now + int(h * total * left / n))
        return None

    def _admit_fits(self, t: Task, rank: int) -> bool:
        """`_fits` for a new task; with `plan_growth`, at everyone's projected final size."""
        if not self._fits(t, rank):
            return False
        if not self.cfg.plan_growth or t.is_eval:
            return True
        grown = []
        for s in self.active_on(rank) + [t]:
            size = self.projected(s)
            grown.append(dataclasses.replace(s, tokens=max(size or 0, self.footprint(s)),
                                             measured=True))
        return self._usage_of(grown) <= self.budget(rank)

    def _growth_unknown(self, t: Task) -> bool:
        """Planning growth, but neither finished tasks nor a second turn of `t`'s type yet."""
        return (self.cfg.plan_growth and self.horizon_turns is not None and not t.is_eval
                and self.projected(t) is None)

    def affinity(self, t: Task) -> int | None:
        """The rank most likely to hold the task's KV or its group's shared prompt."""
        if t.rank is not None and t.rank not in self.dead:
            return t.rank
        counts: dict[int, int] = {}
        for tid in self.groups[t.group_id]:
            s = self.tasks[tid]
            if s.state == "active" and s.rank is not None:
                counts[s.rank] = counts.get(s.rank, 0) + 1
        return max(counts, key=lambda r: (counts[r], -r)) if counts else None

    def resume_rank(self, t: Task, ranks: list[int]) -> int:
        """The affinity rank when it has headroom, else the fitting rank with most headroom."""
        home = self.affinity(t)
        if home is not None and home in ranks and self._fits(t, home):
            return home
        return max((r for r in ranks if self._fits(t, r)),
                   key=lambda r: (self.budget(r) - self.usage(r), -r))

    def schedule(self) -> list[Decision]:
        """One scheduling round; returns the decisions in the order they must be applied."""
        out: list[Decision] = []
        self._fresh = set()
        ranks = self.live_ranks()
        # 1. Pause the lowest priority while a rank is over budget (never below one task).
        for r in ranks:
            while self.usage(r) > self.budget(r) and len(self.active_on(r)) > 1:
                victim = min(self.active_on(r), key=lambda t: (self.priority(t), t.task_id))
                victim.state, victim.executing = "paused", False
                out.append(Pause(victim.task_id, r))
        # 2. Resume paused tasks, highest priority first, on their affinity rank when it fits.
        #    Eval tasks are anchored to weights and block the sync: one that fits nowhere
        #    preempts non-eval tasks on a rank where that makes room.
        while True:
            chosen = None
            room = self.n_active() < self.cfg.env_concurrency
            paused = sorted((t for t in self.tasks.values() if t.state == "paused"),
                            key=lambda t: (-self.priority(t), t.task_id))
            for t in paused:
                if room and any(self._fits(t, r) for r in ranks):
                    chosen = t
                    break
                r = self._preemptible_rank(t, ranks) if t.is_eval else None
                if r is not None:
                    out.extend(self._preempt_on(t, r))
                    chosen = t
                    break
            if chosen is None:
                break
            rank = self.resume_rank(chosen, ranks)
            migrated = chosen.rank is None or chosen.rank != rank
            chosen.state, chosen.rank = "active", rank
            out.append(Resume(chosen.task_id, rank, migrated))
        # 3. Admit new tasks while budgets, env concurrency and the staleness throttle allow.
        #    Paused tasks that fit somewhere were all resumed above, so none is overtaken. A new
        #    eval task that fits nowhere preempts non-eval tasks, as a paused one does. Evals go
        #    first, so a preempting eval never pauses a task admitted in this same round.
        while True:
            room = self.n_active() < self.cfg.env_concurrency
            pick = self._pick_new(ranks, evals_only=True) if room else None
            if pick is None:
                pick = self._pick_eval_by_preemption(ranks, out)
            if pick is None and room:
                pick = self._pick_new(ranks)
            if pick is None or not self._take_admission():
                break
            t, rank = pick
            self.queue[t.group_id].remove(t.task_id)
            if not self.queue[t.group_id]:
                del self.queue[t.group_id]
            t.state, t.rank = "active", rank
            self._fresh.add(t.task_id)
            out.append(Admit(t.task_id, rank))
        return out

    def _preemptible_rank(self, t: Task, ranks: list[int]) -> int | None:
        """A rank where pausing non-eval tasks makes room for eval task `t`, if any."""
        fresh = self._fresh
        for r in ranks:
            active = self.active_on(r)
            keep = [s for s in active if s.is_eval or s.task_id in fresh]
            probe = dataclasses.replace(t, tokens=self.footprint(t), state="active", rank=r)
            room = self.n_active() - (len(active) - len(keep)) < self.cfg.env_concurrency
            if len(keep) < len(active) and room and \
                    self._usage_of(keep + [probe]) <= self.budget(r):
                return r
        return None

    def _preempt_on(self, t: Task, r: int) -> list[Pause]:
        out: list[Pause] = []
        while not (self._fits(t, r) and self.n_active() < self.cfg.env_concurrency):
            fresh = self._fresh
            victim = min((s for s in self.active_on(r)
                          if not s.is_eval and s.task_id not in fresh),
                         key=lambda s: (self.priority(s), s.task_id))
            victim.state, victim.executing = "paused", False
            out.append(Pause(victim.task_id, r))
        return out

    def _pick_eval_by_preemption(self, ranks: list[int],
                                  out: list[Decision]) -> tuple[Task, int] | None:
        for tids in self.queue.values():
            t = self.tasks[tids[0]]
            if not t.is_eval:
                continue
            r = self._preemptible_rank(t, ranks)
            if r is not None and (self.admission_limit is None or self.admission_limit > 0):
                out.extend(self._preempt_on(t, r))
                return t, r
        return None

    def _pick_new(self, ranks: list[int], *, evals_only: bool = False
                  ) -> tuple[Task, int] | None:
        best: tuple[float, Task, int] | None = None
        for pos, (gid, tids) in enumerate(self.queue.items()):
            if not tids or (evals_only and not self.tasks[tids[0]].is_eval):
                continue
            if pos >= self.cfg.lookahead and not evals_only:
                break
            t = self.tasks[tids[0]]
            if self._probing(t):
                continue  # siblings wait for the probe's first turn to size them
            # Eval groups jump the queue; siblings go where the group already is.
            home = self.affinity(t)
            candidates = [home] if home is not None and self._admit_fits(t, home) else [
                r for r in ranks if self._admit_fits(t, r)]
            for r in candidates:
                same = {s.group_id for s in self.active_on(r)
                        if s.task_type == t.task_type and s.group_id != gid}
                score = pos + self.cfg.diversity_weight * len(same) - 1e6 * t.is_eval
                score -= 1e-6 * (self.budget(r) - self.usage(r))  # ties: most headroom
                if best is None or score < best[0]:
                    best = (score, t, r)
        return None if best is None else (best[1], best[2])


class VanillaScheduler(_Base):
    """Request-level continuous batching: a fixed cap on tasks in flight, no pausing.

    Memory is not planned: a rank that runs out of pages evicts the KV of waiting tasks (LRU)
    and re-prefills them when their observation returns (the rank does that, not this class).
    """

    def priority(self, t: Task) -> float:
        return 0.0

    def schedule(self) -> list[Decision]:
        out: list[Decision] = []
        ranks = self.live_ranks()
        cap = min(self.cfg.vanilla_concurrency, self.cfg.env_concurrency)
        paused = [t for t in self.tasks.values() if t.state == "paused"]
        for t in sorted(paused, key=lambda t: t.task_id):  # migrated off a quarantined rank
            if self.n_active() >= cap or not ranks:
                break
            rank = min(ranks, key=lambda r: (len(self.active_on(r)), r))
            t.state, t.rank = "active", rank
            out.append(Resume(t.task_id, rank, True))
        while self.n_active() < cap and self.queue and ranks and self._take_admission():
            gid = next(iter(self.queue))
            tid = self.queue[gid].pop(0)
            if not self.queue[gid]:
                del self.queue[gid]
            t = self.tasks[tid]
            rank = min(ranks, key=lambda r: (len(self.active_on(r)), r))
            t.state, t.rank = "active", rank
            out.append(Admit(tid, rank))
        return out


def make_scheduler(kind: str, cfg: CTBConfig, capacities: Iterable[int], *,
                   max_context: int, max_tasks_per_rank: int | None = None
                   ) -> CTBScheduler | VanillaScheduler:
    if kind == "ctb":
        return CTBScheduler(cfg, capacities, max_context=max_context,
                            max_tasks_per_rank=max_tasks_per_rank)
    if kind == "vanilla":
        return VanillaScheduler(cfg, capacities, max_context=max_context)
    raise ConfigError(f"config key 'rollout.scheduler'={kind!r}: use 'ctb' or 'vanilla'")
