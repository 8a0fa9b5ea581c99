"""CTB's token accounting: what each rank's active tasks need, its budget, and whether a task
fits. No JAX. The scheduler's round (`tiderl.serving.ctb`) decides from these figures.

A rank's usage is the KV its *active* tasks need: each task's context plus a reserve for the
next action (with `shared_prompts`, a GRPO group's prompt, in whole pages, counts once per
rank: ranks share it between siblings). Paused tasks do not count (the rank keeps their KV
until pages are needed). Usage is refreshed once per turn (`update_usage`). With
`overcommit_max` > 1 a rank's budget stretches past its pool while its engine idles
(`stretch`).

The probe: a group whose size is unknown sends one task first; its first turn sizes the
siblings (and other groups of its type). With `plan_growth`, admission also projects growth
(learned online per task type) so tasks are not admitted only to be paused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tiderl.serving.tasktable import LIVE_STATES, Task, TaskTable

if TYPE_CHECKING:
    from tiderl.serving.ctb_config import CTBConfig


class UsageTable(TaskTable):
    """The task table with each rank's KV usage, budget and fit (see the module docstring).

    Each rank's usage (current sizes, and the grown sizes admission plans with) is cached:
    updated in O(1) as tasks join or leave the rank, recomputed over the rank's active tasks
    only after something its tasks' sizes depend on changed (a turn, a probe, growth stats).
    """

    def __init__(self, cfg: CTBConfig, capacities: Iterable[int], *, max_context: int,
                 max_tasks_per_rank: int | None = None, page_size: int = 1):
        super().__init__(cfg, capacities, max_context=max_context,
                         max_tasks_per_rank=max_tasks_per_rank)
        self.page_size = page_size
        """KV page size of the ranks (tokens): what prefix sharing shares is whole pages."""
        n = len(self.capacity)
        self._own = [0] * n
        """Per rank: what its active tasks need besides shared prompts (all of it without)."""
        self._prompt_max: list[dict[str, int]] = [{} for _ in range(n)]
        self._prompt_sum = [0] * n
        """Per rank, with `shared_prompts`: each group's prompt, counted once."""
        self._grown_own = [0] * n
        """`_own` at the grown sizes `plan_growth` admits by; valid at `_grown_version`."""
        self._grown_version = [-1] * n
        self._admit_memo: list[dict[str, bool]] = [{} for _ in range(n)]
        self._round_budgets: list[int] | None = None
        """Every rank's `budget` during a round (`schedule` fixes them at its start)."""

    def _shared_part(self, t: Task) -> int:
        """The part of `t`'s prompt its siblings on a rank hold once: whole KV pages (each
        sibling writes its own copy of a partial last page)."""
        return t.prompt_tokens // self.page_size * self.page_size

    def budget(self, rank: int) -> int:
        b = self._round_budgets
        if b is not None:  # inside a round: capacities and busy shares do not change there
            return b[rank]
        return int(self.capacity[rank] * self.cfg.budget_fraction * self.stretch(rank))

    def stretch(self, rank: int) -> float:
        """How far the rank's budget stretches past its KV pool: 1 / its engine's busy share,
        at most `overcommit_max` (see there)."""
        top = self.cfg.overcommit_max
        busy = self.engine_busy[rank]
        return 1.0 if top <= 1.0 or busy >= 1.0 else min(top, 1.0 / max(busy, 1e-9))

    def within_budget(self, rank: int) -> bool:
        """No task on `rank` needs pausing for room: its usage is within its budget."""
        return self.usage(rank) <= self.budget(rank)

    def limit(self, rank: int) -> int:
        """What a task joining `rank` may bring its usage up to: the budget, or on a rank with
        nothing active its whole capacity. The budget's slack is for other tasks' growth; a
        task grown past the budget must still run somewhere (the pause step never pauses a
        rank's last task), or it would wait forever and its group with it."""
        return self.budget(rank) if self._active[rank] else self.capacity[rank]

    def usage(self, rank: int, extra: Task | None = None) -> int:
        """KV tokens the rank's active tasks (plus `extra`) need; shared prompts count once."""
        if self._dirty[rank]:  # (`_refresh` checks too; this skips a call per rank per round)
            self._refresh(rank)
        used = self._own[rank] + self._prompt_sum[rank]
        if extra is not None:
            used += self.marginal(rank, extra, self.footprint(extra))
        return used

    def _usage_of(self, tasks: list[Task]) -> int:
        return self.sum_usage([(t, self.footprint(t)) for t in tasks])

    def sum_usage(self, sized: list[tuple[Task, int]]) -> int:
        """What tasks at the given sizes need together on one rank (shared prompts once)."""
        reserve = self.cfg.action_reserve
        if not self.cfg.shared_prompts:
            return sum(size + reserve for _, size in sized)
        prompts: dict[str, int] = {}
        own = 0
        for t, size in sized:
            sp = self._shared_part(t)
            prompts[t.group_id] = max(prompts.get(t.group_id, 0), sp)
            own += size - sp + reserve
        return sum(prompts.values()) + own

    def marginal(self, rank: int, t: Task, size: int) -> int:
        """What `t`, at `size`, adds to the rank's (fresh) usage."""
        extra = size + self.cfg.action_reserve
        if self.cfg.shared_prompts:
            held = self._prompt_max[rank].get(t.group_id, 0)
            sp = self._shared_part(t)
            extra += max(held, sp) - held - sp
        return extra

    def _refresh(self, rank: int) -> None:
        if not self._dirty[rank]:
            return
        reserve, shared = self.cfg.action_reserve, self.cfg.shared_prompts
        own = 0
        prompts: dict[str, int] = {}
        for t in self._active[rank].values():
            own += self.footprint(t) + reserve
            if shared:
                sp = self._shared_part(t)
                own -= sp
                prompts[t.group_id] = max(prompts.get(t.group_id, 0), sp)
        self._own[rank], self._prompt_max[rank] = own, prompts
        self._prompt_sum[rank] = sum(prompts.values())
        self._grown_version[rank] = -1
        self._dirty[rank] = False

    def _resized(self, t: Task, tokens: int, measured: bool, prompt_tokens: int) -> None:
        # A measured task whose prompt is known changes only its own footprint (its shared
        # prompt part is the same): update the sum in place instead of recounting the rank
        # on its next read (once per turn, over every task there).
        r = t.rank
        if self._dirty[r] or not measured or prompt_tokens != t.prompt_tokens:
            self._dirty[r] = True
            return
        self._own[r] += t.tokens - tokens
        self._grown_version[r] = -1

    def grown_usage(self, rank: int) -> int:
        """`usage` with every active task at its grown size (see `_admit_fits`)."""
        self._refresh(rank)
        if self._grown_version[rank] != self._stats_version:
            reserve, shared = self.cfg.action_reserve, self.cfg.shared_prompts
            self._grown_own[rank] = sum(
                self.grown_size(t) + reserve - (self._shared_part(t) if shared else 0)
                for t in self._active[rank].values())
            self._grown_version[rank] = self._stats_version
        return self._grown_own[rank] + self._prompt_sum[rank]

    def _load_join(self, rank: int, t: Task) -> None:
        if self._admit_memo[rank]:
            self._admit_memo[rank].clear()
        if self._dirty[rank]:
            return
        reserve = self.cfg.action_reserve
        own = self._shared_part(t) if self.cfg.shared_prompts else 0
        self._own[rank] += self.footprint(t) + reserve - own
        if self._grown_version[rank] == self._stats_version:
            self._grown_own[rank] += self.grown_size(t) + reserve - own
        if self.cfg.shared_prompts:
            prompts = self._prompt_max[rank]
            held = prompts.get(t.group_id, 0)
            prompts[t.group_id] = max(held, own)
            self._prompt_sum[rank] += prompts[t.group_id] - held

    def _load_leave(self, rank: int, t: Task) -> None:
        if self._admit_memo[rank]:
            self._admit_memo[rank].clear()
        if self._dirty[rank]:
            return
        if self.cfg.shared_prompts:
            # The group's prompt may be held by siblings still there: recount on the next read.
            self._dirty[rank] = True
            return
        # Sizes are those summed in: any change to them marked the rank dirty.
        self._own[rank] -= self.footprint(t) + self.cfg.action_reserve
        if self._grown_version[rank] == self._stats_version:
            self._grown_own[rank] -= self.grown_size(t) + self.cfg.action_reserve

    def _check_indexes(self) -> None:
        super()._check_indexes()
        for r in range(len(self.capacity)):
            tasks = self.active_on(r)
            if not self._dirty[r]:
                fresh = self._usage_of(tasks)
                if self._own[r] + self._prompt_sum[r] != fresh:
                    raise AssertionError(f"scheduler index out of step: rank {r} usage "
                                         f"{self._own[r] + self._prompt_sum[r]} != {fresh}")
                if self._grown_version[r] == self._stats_version:
                    grown = self.sum_usage([(t, self.grown_size(t)) for t in tasks])
                    if self._grown_own[r] + self._prompt_sum[r] != grown:
                        raise AssertionError(f"scheduler index out of step: rank {r} grown "
                                             f"usage {self._grown_own[r]} != {grown}")
            if self.usage(r) != self._usage_of(tasks):
                raise AssertionError(f"scheduler index out of step: rank {r} usage")

    def footprint(self, t: Task) -> int:
        """The measured context; before the task's first turn, the probed estimate."""
        if t.measured:
            return t.tokens
        return max(t.tokens, self.estimate(t) or 0)

    def probe_size(self, t: Task) -> int:
        """What `t` would hold if it joined a rank now (never less than its prompt)."""
        return max(self.footprint(t), t.prompt_tokens)

    def estimate(self, t: Task) -> int | None:
        """First-turn footprint of `t`'s group: its probe, else the largest probe among groups
        of the same task type; None when nothing is known yet."""
        probe = self.group_probe.get(t.group_id)
        if probe is not None:
            return probe
        return self._type_probe_max.get(t.task_type)

    def probing(self, t: Task) -> bool:
        """`t`'s size (or, planning growth, its type's growth) is unknown and a task already
        went ahead as the probe: wait for the probe's first turns."""
        if self._growth_unknown(t):
            return self._live_by_type.get(t.task_type, 0) > 0
        if t.prompt_tokens or self.estimate(t) is not None:
            return False
        return any(self.tasks[s].state in LIVE_STATES and not self.tasks[s].measured
                   for s in self.groups[t.group_id])

    def fits(self, t: Task, rank: int) -> bool:
        """`t`, at its current size, fits `rank` now (room and a free slot)."""
        if self.max_tasks_per_rank is not None and not (t.state == "active" and t.rank == rank) \
                and len(self._active[rank]) >= self.max_tasks_per_rank:
            return False
        return self.usage(rank) + self.marginal(rank, t, self.probe_size(t)) \
            <= self.limit(rank)

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

    def grown_size(self, t: Task) -> int:
        """The size `plan_growth` admits `t` at: its projected final context (at least its
        footprint and prompt)."""
        return max(self.projected(t) or 0, self.footprint(t), t.prompt_tokens)

    def _admit_fits_now(self, t: Task, rank: int) -> bool:
        """`_admit_fits`, remembered for the round: within a round nothing that sizes a task
        changes, so the answer holds until `rank`'s active set does (`_join`, `_leave`)."""
        memo = self._admit_memo[rank]
        fits = memo.get(t.task_id)
        if fits is None:
            fits = memo[t.task_id] = self._admit_fits(t, rank)
        return fits

    def _admit_fits(self, t: Task, rank: int) -> bool:
        """`fits` for a new task; with `plan_growth`, at everyone's projected final size."""
        if not self.fits(t, rank):
            return False
        if not self.cfg.plan_growth or t.is_eval:
            return True
        return self.grown_usage(rank) + self.marginal(rank, t, self.grown_size(t)) \
            <= self.limit(rank)

    def _growth_unknown(self, t: Task) -> bool:
        """Planning growth, but neither finished tasks nor a second turn of `t`'s type yet."""
        return (self.cfg.plan_growth and self.horizon_turns is not None and not t.is_eval
                and self.projected(t) is None)

    def _best_headroom(self, ranks: list[int]) -> int | None:
        """The most room any rank with a free slot has left; None when none has a slot."""
        cap = self.max_tasks_per_rank
        active, own, prompts = self._active, self._own, self._prompt_sum
        best = None
        for r in ranks:  # `limit(r) - usage(r)`, inlined (every rank, several times a round)
            if cap is not None and len(active[r]) >= cap:
                continue
            if self._dirty[r]:
                self._refresh(r)
            head = (self.budget(r) if active[r] else self.capacity[r]) - (own[r] + prompts[r])
            if best is None or head > best:
                best = head
        return best

    def least_need(self, t: Task) -> int:
        """The least `t` adds to any rank: its own tokens (its prompt may be there already)."""
        need = self.probe_size(t) + self.cfg.action_reserve
        return need - self._shared_part(t) if self.cfg.shared_prompts else need
