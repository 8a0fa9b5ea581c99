"""Continuous Task Batching (paper §4, Algorithm 1) and the request-level baseline. No JAX.

One scheduler sees every rollout rank. It holds no device state: ranks report usage, the
scheduler answers with decisions (`Admit`, `Pause`, `Resume`) that the ranks apply.

Token accounting. A rank's usage is the KV its *active* tasks need: for each GRPO group on the
rank its shared prompt once, plus each task's own tokens beyond the prompt, plus a reserve for the
next action. Paused tasks do not count (the rank may keep their KV until pages are needed).
Usage is refreshed at the start of every turn (`update_usage`); a group's first measured turn
replaces the prompt-based footprint estimate of its not-yet-admitted siblings (the probe).

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

    def __post_init__(self):
        if not self.w_active > self.w_context:
            raise ConfigError("config key 'rollout.ctb.w_active' must exceed rollout.ctb.w_context "
                              "(tier order: active > context length)")
        if not self.w_eval > self.w_group + self.w_active + self.w_context:
            raise ConfigError("config key 'rollout.ctb.w_eval' must exceed w_group + w_active + "
                              "w_context (eval is the top tier)")
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

    def __init__(self, cfg: CTBConfig, capacities: Iterable[int], *, max_context: int):
        self.cfg = cfg
        self.capacity = list(capacities)
        self.max_context = max_context
        self.tasks: dict[str, Task] = {}
        self.groups: dict[str, list[str]] = {}
        self.queue: OrderedDict[str, list[str]] = OrderedDict()  # group -> unadmitted task ids
        self.group_done: dict[str, int] = {}
        self.group_probe: dict[str, int] = {}
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
        t.tokens = tokens
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
        t.state, t.executing = "done", False
        self.group_done[t.group_id] += 1

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
        prompts: dict[str, int] = {}
        own = 0
        for t in tasks:
            prompts[t.group_id] = max(prompts.get(t.group_id, 0), t.prompt_tokens)
            own += t.tokens - t.prompt_tokens + self.cfg.action_reserve
        return sum(prompts.values()) + own

    def footprint(self, t: Task) -> int:
        """Probed estimate for an unadmitted task; the measured context otherwise."""
        if t.state == "new":
            return max(t.tokens, self.group_probe.get(t.group_id, t.tokens))
        return t.tokens

    def _fits(self, t: Task, rank: int) -> bool:
        probe = dataclasses.replace(t, tokens=self.footprint(t))
        return self.usage(rank, probe) <= self.budget(rank)

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
        #    eval task that fits nowhere preempts non-eval tasks, as a paused one does.
        while True:
            pick = self._pick_new(ranks) if self.n_active() < self.cfg.env_concurrency else None
            if pick is None:
                pick = self._pick_eval_by_preemption(ranks, out)
            if pick is None or not self._take_admission():
                break
            t, rank = pick
            self.queue[t.group_id].remove(t.task_id)
            if not self.queue[t.group_id]:
                del self.queue[t.group_id]
            t.state, t.rank = "active", rank
            out.append(Admit(t.task_id, rank))
        return out

    def _preemptible_rank(self, t: Task, ranks: list[int]) -> int | None:
        """A rank where pausing non-eval tasks makes room for eval task `t`, if any."""
        for r in ranks:
            active = self.active_on(r)
            evals = [s for s in active if s.is_eval]
            probe = dataclasses.replace(t, tokens=self.footprint(t), state="active", rank=r)
            if len(evals) < len(active) and self._usage_of(evals + [probe]) <= self.budget(r):
                return r
        return None

    def _preempt_on(self, t: Task, r: int) -> list[Pause]:
        out: list[Pause] = []
        while not (self._fits(t, r) and self.n_active() < self.cfg.env_concurrency):
            victim = min((s for s in self.active_on(r) if not s.is_eval),
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

    def _pick_new(self, ranks: list[int]) -> tuple[Task, int] | None:
        best: tuple[float, Task, int] | None = None
        for pos, (gid, tids) in enumerate(self.queue.items()):
            if pos >= self.cfg.lookahead or not tids:
                break
            t = self.tasks[tids[0]]
            # Eval groups jump the queue; siblings go where the group already is.
            home = self.affinity(t)
            candidates = [home] if home is not None and self._fits(t, home) else [
                r for r in ranks if self._fits(t, r)]
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
                   max_context: int) -> CTBScheduler | VanillaScheduler:
    if kind == "ctb":
        return CTBScheduler(cfg, capacities, max_context=max_context)
    if kind == "vanilla":
        return VanillaScheduler(cfg, capacities, max_context=max_context)
    raise ConfigError(f"config key 'rollout.scheduler'={kind!r}: use 'ctb' or 'vanilla'")
