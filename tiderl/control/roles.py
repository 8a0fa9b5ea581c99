"""Carrying out ERS plans at a sync boundary. No JAX.

`RoleSwitch` owns the cell map of a run. Given a `ScalingPlan` that differs from the current
roles it (1) drains the rollout ranks of every cell leaving rollout — their tasks migrate
through CTB, cache-free, each taking its `Handoff` — (2) awaits `Hooks.apply_roles`, which
moves the trainer and Ref and starts ranks for the cells joining rollout (JAX side, or a
simulator's), (3) adds those ranks to the rollout manager. The weight sync that follows reaches
every live rank, the new ones included. Each change becomes one `role_change` record in
`metrics.jsonl` (and a console line): moves, reason, drain time, the hook's costs (state move,
rank start), compilations during the change, and — added once the next step has run, since
that is where a new mesh's kernels compile — the compilations of that step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tiderl.control.plans import CellMap, Move, RoleChange, RoleChangeResult, ScalingPlan

log = logging.getLogger(__name__)


class RoleSwitch:
    """The run's cell → role map and the mechanism that changes it (see the module docstring)."""

    def __init__(self, *, manager: Any, cells: CellMap, ranks_per_cell: int, ref_mode: str,
                 apply_roles: Callable[[RoleChange, Any], Awaitable[RoleChangeResult]] | None,
                 compile_stats: Callable[[], dict] | None, log_record: Callable[[dict], None],
                 clock: Callable[[], float]):
        self.manager = manager
        self.cells = cells
        self.ranks_per_cell = ranks_per_cell
        self.ref_mode = ref_mode
        self._apply = apply_roles
        self._compiles = compile_stats
        self._log = log_record
        self._now = clock
        self.changes = 0
        self._pending: dict | None = None
        self._after: dict | None = None
        self._warned = False

    def rank_ids(self, cell: int) -> list[int]:
        k = self.ranks_per_cell
        return list(range(cell * k, cell * k + k))

    def _compile_now(self) -> dict:
        return dict(self._compiles()) if self._compiles is not None else {}

    def differs(self, plan: ScalingPlan) -> bool:
        return plan.cells != self.cells or plan.ref_mode != self.ref_mode

    async def apply(self, plan: ScalingPlan, *, step: int, version: int, weights: Any
                    ) -> dict | None:
        """Carries out `plan` (a no-op when it keeps everything); returns the change record."""
        if not self.differs(plan):
            return None
        if self._apply is None:
            if not self._warned:
                log.warning("scaling plan %r ignored: this run has no role-change mechanism "
                            "(Hooks.apply_roles)", plan.reason)
                self._warned = True
            return None
        self.finish_pending()
        t0 = self._now()
        c0 = self._compile_now()
        leaving = [m.cell for m in plan.moves if m.src == "rollout"]
        drained = await asyncio.gather(*(self.manager.drain_rank(r) for c in leaving
                                         for r in self.rank_ids(c)))
        t_drain = self._now()
        change = RoleChange(step=step, version=version, before=self.cells, after=plan.cells,
                            moves=plan.moves, ref_mode=plan.ref_mode, reason=plan.reason,
                            ranks_per_cell=self.ranks_per_cell)
        try:
            result = await self._apply(change, weights)
        except Exception:
            # A plan never stops the run: undo what the hook may have done (the drained
            # cells come back to rollout, the trainer returns to its cells) and keep going.
            log.exception("ERS step %d: role change failed (%s); reverting", step, plan.reason)
            back = dataclasses.replace(change, before=plan.cells, after=self.cells,
                                       moves=tuple(Move(m.cell, m.dst, m.src)
                                                   for m in plan.moves),
                                       ref_mode=self.ref_mode, reason="revert")
            result = await self._apply(back, weights)
            for rank in result.ranks:
                self.manager.add_rank(rank)
            self._log({"kind": "role_change_failed", "step": step, "reason": plan.reason,
                       "drain_s": t_drain - t0})
            return None
        for rank in result.ranks:
            self.manager.add_rank(rank)
        self.cells, self.ref_mode = plan.cells, plan.ref_mode
        self.changes += 1
        c1 = self._compile_now()
        rec = {
            "kind": "role_change", "step": step, "version": version, "epoch": self.changes,
            "rule": plan.rule, "reason": plan.reason, "ref_mode": plan.ref_mode,
            "moves": [dataclasses.asdict(m) for m in plan.moves],
            "cells": plan.cells.describe(), "before": change.before.describe(),
            "drain_s": t_drain - t0,
            "tasks_migrated": sum(d.get("tasks", 0) for d in drained),
            "handoffs": sum(d.get("handoffs", 0) for d in drained),
            "change_s": self._now() - t0,
            **{k: v for k, v in result.cost.items()},
            **{f"{k}_change": c1.get(k, 0) - c0.get(k, 0) for k in c1},
        }
        log.info("ERS step %d: %s [%s; drain %.3fs, total %.3fs]", step, plan.reason,
                 plan.ref_mode, rec["drain_s"], rec["change_s"])
        self._pending, self._after = rec, c1
        return rec

    def finish_pending(self) -> None:
        """Logs the last change's record, with the compilations of the step that followed."""
        if self._pending is None:
            return
        now = self._compile_now()
        for k, v in now.items():
            self._pending[f"{k}_next_step"] = v - (self._after or {}).get(k, 0)
        self._log(self._pending)
        self._pending = self._after = None

    def summary(self) -> dict[str, Any]:
        return {"role_changes": self.changes,
                "rollout_cells": self.cells.count("rollout"),
                "trainer_cells": self.cells.count("trainer"),
                "ref_cells": self.cells.count("ref"), "ref_mode": self.ref_mode}
