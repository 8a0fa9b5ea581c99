"""ERS in the simulator: the production planner and role-change path on virtual time. No JAX.

A simulated job hands the controller its layout through one function, `wire(...)`: it returns
the controller's `planner`, `cells`, `ranks_per_cell` and `ref_mode` and the
`Hooks.apply_roles` hook. The controller drains the ranks of cells leaving rollout through CTB,
and the hook moves the `SimTrainer` (Actor width, decoupled Ref), starts a `RolloutRank` over a
fresh `SimEngine` per joining rank slot, and charges the moves' costs to the loop clock.

Cells: one cell is `gpus_per_rank` devices — one rollout rank, or that many trainer (or Ref)
data-parallel devices. The initial map lists the rollout cells first (rank slot = cell id),
then the Ref's, then the trainer's.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from typing import Any

from tiderl.configlib import ConfigError

ERS = "ers"
"""`SimConfig.planner` value for the production readiness-aware planner."""


def load_planner(spec: str) -> Any:
    """`ers`: the production ERS planner (default bounds); `module:Class`: any planner class;
    '': None (the controller keeps the split)."""
    if not spec:
        return None
    if spec == ERS:
        from tiderl.control import ers

        return ers.ERSPlanner(ers.ERSConfig())
    mod, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), name)()
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"sim planner {spec!r} cannot be loaded ({e}); give 'ers' or "
                          "module:Class of a tiderl.control.ers planner") from e


def wire(*, planner: str, n_cells: int, rollout_cells: int, ref_cells: int, gpus_per_cell: int,
         actor_gpus: int, ref_gpus: int, trainer: Any, batcher: Any, new_rank: Callable[[int, Any, int], Awaitable[Any]],
         join_cost_s: float) -> tuple[dict[str, Any], Any]:
    """(controller keyword arguments, `apply_roles` hook or None) for a simulated job.

    `new_rank(rank_id, weights, version)` starts a rollout rank; `join_cost_s` is what loading
    the weights into joining ranks costs (they load concurrently: charged once per change)."""
    trainer_cells = n_cells - rollout_cells - ref_cells
    if trainer_cells < 1:
        raise ConfigError(f"sim layout: {rollout_cells} rollout + {ref_cells} Ref cells of "
                          f"{n_cells} leave no trainer cell; lower the rollout ratio or ref_gpus")
    chosen = load_planner(planner)
    if chosen is not None and getattr(chosen, "move_cost_s", None) is not None:
        # What a change costs here: the leaving ranks' role change (buffers re-allocated, the
        # other model's weights over PCIe) and the joining ranks' weight load.
        import math

        if math.isnan(chosen.move_cost_s):
            chosen.move_cost_s = trainer.costs.role_change() + join_cost_s
    from tiderl.control.plans import CellMap, RoleChangeResult

    cells = CellMap(tuple(["rollout"] * rollout_cells + ["ref"] * ref_cells
                          + ["trainer"] * trainer_cells))

    async def apply_roles(change: Any, weights: Any) -> Any:
        after = change.after
        ref = after.count("ref") * gpus_per_cell if change.ref_mode == "decoupled" else 0
        actor = after.count("trainer") * gpus_per_cell
        move_s = await trainer.change_roles(actor_gpus=actor, ref_gpus=ref)
        batcher.n_ranks = actor
        batcher.order = "decoupled" if ref else "colocated"
        joining = [rid for c in change.joining_rollout() for rid in change.rank_ids(c)]
        ranks = [await new_rank(rid, weights, change.version) for rid in joining]
        join_s = join_cost_s if joining else 0.0
        if join_s:
            await asyncio.sleep(join_s)
        return RoleChangeResult(ranks, {"move_s": move_s, "join_s": join_s,
                                        "actor_gpus": actor, "ref_gpus": ref})

    kwargs = {"planner": chosen, "cells": cells, "ranks_per_cell": 1,
              "ref_mode": "decoupled" if ref_cells else "colocated"}
    return kwargs, apply_roles
