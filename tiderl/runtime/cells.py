"""Device cells across hosts: the per-host device plan and the role map. No JAX.

A cell is a group of devices inside one process, keyed by (process, local device ids): a
rollout rank's devices (its engine runs SPMD over them), one trainer data-parallel slice (its
`fsdp × model` group: params and optimizer state sharded inside it, replicated across cells),
or a Ref group. Every host gets the same layout (`host_plan`): its share of the rollout ranks,
then its trainer cells, then its Ref devices, so the trainer's `data` axis counts trainer cells
and runs across hosts while `fsdp` and `model` stay inside one.

`RoleMap` is what process 0 publishes at a sync boundary (one epoch per change; epoch 0 is the
initial layout): cell → role. Elastic scaling moves cells between roles by publishing a new
epoch; every process applies it at the same point of its plan stream.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError
from tiderl.runtime.devices import DevicePlan, plan_devices

Role = Literal["rollout", "actor", "ref"]


@dataclasses.dataclass(frozen=True)
class Cell:
    process: int
    local: tuple[int, ...]
    """Positions in that process's `jax.local_devices()`."""
    role: Role
    index: int
    """Rollout rank id, trainer cell (data) index or Ref cell index, counted over the world."""


@dataclasses.dataclass(frozen=True)
class RoleMap:
    epoch: int
    cells: tuple[Cell, ...]

    def of(self, process: int) -> list[Cell]:
        return [c for c in self.cells if c.process == process]

    def rollout(self) -> list[Cell]:
        return sorted((c for c in self.cells if c.role == "rollout"), key=lambda c: c.index)

    def to_wire(self) -> dict:
        return {"epoch": self.epoch,
                "cells": [[c.process, list(c.local), c.role, c.index] for c in self.cells]}

    @classmethod
    def from_wire(cls, d: dict) -> RoleMap:
        return cls(int(d["epoch"]), tuple(Cell(int(p), tuple(int(i) for i in loc), role, int(k))
                                          for p, loc, role, k in d["cells"]))


def _per_host(key: str, total: int, n: int, what: str) -> int:
    if total % n:
        raise ConfigError(
            f"config key '{key}'={total} does not split over {n} processes; use a multiple of "
            f"{n} (every host runs the same number of {what})")
    return total // n


def host_plan(*, n_processes: int, local_devices: int, ranks: int, devices_per_rank: int,
              actor_devices: int, ref_devices: int, fsdp: int, model_parallel: int,
              colocate_rollout: bool = False) -> DevicePlan:
    """The world's device plan in global device indices (process p's local device i is
    p × local_devices + i, JAX's order): every host lays out its share the same way."""
    if ref_devices and n_processes > 1:
        # The Ref's logprobs would have to move between two meshes spanning processes, a
        # cross-process reshard JAX does not do; colocated RA2P keeps them on the Actor's mesh.
        raise ConfigError(
            f"config key 'trainer.ref_devices'={ref_devices}: a decoupled Ref on several "
            "processes is not supported yet; set trainer.ref_devices=0 (Ref colocated with "
            "the Actor)")
    ranks_h = _per_host("rollout.ranks", ranks, n_processes, "rollout ranks")
    actor_h = _per_host("trainer.actor_devices", actor_devices, n_processes, "trainer devices")
    ref_h = _per_host("trainer.ref_devices", ref_devices, n_processes, "Ref devices")
    cell = fsdp * model_parallel
    if actor_h % cell:
        raise ConfigError(
            f"config keys 'trainer.fsdp'={fsdp} × trainer.model_parallel={model_parallel} = "
            f"{cell} devices per trainer cell do not divide a host's {actor_h} trainer devices "
            f"(trainer.actor_devices={actor_devices} over {n_processes} processes): a trainer "
            "cell must sit inside one process; lower trainer.fsdp or raise trainer.actor_devices")
    local = plan_devices(local_devices, ranks=ranks_h, devices_per_rank=devices_per_rank,
                         actor_devices=actor_h, ref_devices=ref_h,
                         colocate_rollout=colocate_rollout)

    def shift(idx: tuple[int, ...], p: int) -> tuple[int, ...]:
        return tuple(p * local_devices + i for i in idx)

    procs = range(n_processes)
    return DevicePlan(
        n_devices=n_processes * local_devices,
        rollout=tuple(shift(r, p) for p in procs for r in local.rollout),
        actor=tuple(i for p in procs for i in shift(local.actor, p)),
        ref=tuple(i for p in procs for i in shift(local.ref, p)))


def role_map(plan: DevicePlan, *, local_devices: int, fsdp: int, model_parallel: int,
             epoch: int = 0) -> RoleMap:
    """The cells of `plan` (global indices) keyed by (process, local device ids)."""

    def cell(idx: tuple[int, ...], role: Role, k: int) -> Cell:
        procs = {i // local_devices for i in idx}
        if len(procs) != 1:
            raise ConfigError(f"a {role} cell spans processes {sorted(procs)}; cells sit inside "
                              "one process (check trainer.fsdp and rollout.devices_per_rank)")
        return Cell(procs.pop(), tuple(i % local_devices for i in idx), role, k)

    size = fsdp * model_parallel
    cells = [cell(r, "rollout", k) for k, r in enumerate(plan.rollout)]
    cells += [cell(plan.actor[i:i + size], "actor", i // size)
              for i in range(0, len(plan.actor), size)]
    per_ref = max(1, len(plan.ref) // max(1, len({i // local_devices for i in plan.ref})))
    cells += [cell(plan.ref[i:i + per_ref], "ref", i // per_ref)
              for i in range(0, len(plan.ref), per_ref)]
    return RoleMap(epoch, tuple(cells))


def device_plan_for(cfg, n_processes: int, local_devices: int,
                    platform: str = "cpu") -> DevicePlan:
    """The run's device plan: `cfg.device_plan` in one process, `host_plan` across several."""
    if n_processes == 1:
        return cfg.device_plan(local_devices, platform)
    from tiderl.runtime.platforms import resolve_colocate

    t, r = cfg.trainer, cfg.rollout
    n = n_processes * local_devices
    colocate = cfg.controller.mode == "sync" or resolve_colocate(
        cfg.cluster.colocate_rollout, platform=platform, n_devices=n,
        separate_need=r.ranks * r.devices_per_rank + t.actor_devices + t.ref_devices,
        colocated_need=max(r.ranks * r.devices_per_rank, t.actor_devices + t.ref_devices))
    return host_plan(n_processes=n_processes, local_devices=local_devices, ranks=r.ranks,
                     devices_per_rank=r.devices_per_rank, actor_devices=t.actor_devices,
                     ref_devices=t.ref_devices, fsdp=t.fsdp, model_parallel=t.model_parallel,
                     colocate_rollout=colocate)
