"""Device pool and roles: which devices hold rollout ranks, the Actor and the Ref.

The plan itself is pure data (device indices per role) so it can be validated before JAX starts;
`init_jax` and `role_meshes` turn it into devices and meshes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from tiderl.configlib import ConfigError

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the job runs."""

    platform: Literal["auto", "cpu", "gpu"] = "auto"
    fake_cpu_devices: int = 2
    """> 0: when JAX runs on the CPU, split it into this many devices (laptops, tests); sets
    jax_num_cpu_devices. Ignored when a GPU backend is picked."""
    colocate_rollout: bool = False
    """Rollout and training share all devices and alternate (the `sync` baseline)."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache: 'auto' (the user cache dir, $XDG_CACHE_HOME or
    ~/.cache, under tiderl/jax), 'run' (<run_dir>/compile_cache), 'off', or a directory.
    Executables that took over a second to compile are reused by later runs (and by a
    resumed one), including those of every trainer mesh elastic scaling visits."""

    def __post_init__(self):
        if self.fake_cpu_devices < 0:
            raise ConfigError("config key 'cluster.fake_cpu_devices' must be >= 0")
        if self.fake_cpu_devices and self.platform == "gpu":
            raise ConfigError("config key 'cluster.fake_cpu_devices' needs cluster.platform "
                              "'cpu' or 'auto'; set one of them")


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Device indices per role. `ref` empty means the Ref is colocated with the Actor."""

    n_devices: int
    rollout: tuple[tuple[int, ...], ...]
    actor: tuple[int, ...]
    ref: tuple[int, ...]

    def describe(self) -> str:
        lines = [f"{self.n_devices} devices"]
        for i, devs in enumerate(self.rollout):
            lines.append(f"  rollout rank {i}: {list(devs)}")
        lines.append(f"  actor: {list(self.actor)}")
        lines.append(f"  ref:   {list(self.ref) if self.ref else 'colocated with actor'}")
        return "\n".join(lines)


def plan_devices(n_devices: int, *, ranks: int, devices_per_rank: int, actor_devices: int,
                 ref_devices: int, colocate_rollout: bool = False) -> DevicePlan:
    """Lays roles onto devices in order: rollout ranks, then Actor, then Ref.

    Raises ConfigError naming the keys when the roles need more devices than there are.
    """
    need_rollout = ranks * devices_per_rank
    if colocate_rollout:
        need = max(need_rollout, actor_devices + ref_devices)
        if need > n_devices:
            raise ConfigError(
                f"config keys 'rollout.ranks'={ranks} × rollout.devices_per_rank="
                f"{devices_per_rank} / trainer.actor_devices={actor_devices} + "
                f"trainer.ref_devices={ref_devices} need {need} devices but {n_devices} are "
                "visible; lower them or raise cluster.fake_cpu_devices"
            )
        rollout = _rank_devices(ranks, devices_per_rank)
        actor = tuple(range(actor_devices))
        ref = tuple(range(actor_devices, actor_devices + ref_devices))
        return DevicePlan(n_devices, rollout, actor, ref)
    need = need_rollout + actor_devices + ref_devices
    if need > n_devices:
        raise ConfigError(
            f"config key 'rollout.ranks'={ranks}: rollout.ranks × rollout.devices_per_rank "
            f"({need_rollout}) + trainer.actor_devices ({actor_devices}) + trainer.ref_devices "
            f"({ref_devices}) = {need} devices, but {n_devices} are visible; lower rollout.ranks "
            "or the trainer devices, or raise cluster.fake_cpu_devices"
        )
    rollout = _rank_devices(ranks, devices_per_rank)
    actor = tuple(range(need_rollout, need_rollout + actor_devices))
    ref = tuple(range(need_rollout + actor_devices, need))
    return DevicePlan(n_devices, rollout, actor, ref)


def _rank_devices(ranks: int, per_rank: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks))


CPU_LOW_MEMORY_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def init_jax(cfg: ClusterConfig, *, low_memory: bool = False) -> list[jax.Device]:
    """Configures and starts JAX per `cfg`; returns the visible devices.

    `low_memory` (launch passes `trainer.remat`): XLA:CPU's default scheduler orders for
    concurrency and runs every rematerialised block's recomputation ahead of the backward, all
    live at once, which undoes remat (XLA's own figure for the backward of a Qwen2.5-0.5B-shaped
    model at 4 × 1,024 tokens: 24.6 GiB of temporaries, 7.5 GiB with its memory-ordered
    scheduler). The flag is read when the backend starts; a started backend keeps its own."""
    import os

    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    if low_memory and CPU_LOW_MEMORY_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_LOW_MEMORY_FLAG}".strip()
    if cfg.platform != "auto":
        jax.config.update("jax_platforms", cfg.platform)
    if cfg.fake_cpu_devices:
        # Must happen before the backend starts (XLA_FLAGS after import are ignored); it only
        # shapes the CPU client, so it is harmless where a GPU backend wins.
        jax.config.update("jax_num_cpu_devices", cfg.fake_cpu_devices)
    return list(jax.devices())


def compile_cache_dir(cfg: ClusterConfig, run_dir: str) -> str | None:
    """Where `cluster.compile_cache` puts JAX's persistent compilation cache (None: off)."""
    import os

    v = cfg.compile_cache
    if v == "off" or not v:
        return None
    if v == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "tiderl", "jax")
    if v == "run":
        return os.path.join(run_dir, "compile_cache")
    return os.path.expanduser(v)


def enable_compile_cache(path: str | None) -> None:
    """Turns the persistent compilation cache on at `path` (before the first compilation: JAX
    decides once per process whether to use it)."""
    if path is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)


def role_meshes(plan: DevicePlan, devices: list[jax.Device], *, fsdp: int = 1,
                model_parallel: int = 1) -> dict[str, Mesh | list[Mesh]]:
    """Meshes per role: one per rollout rank, the actor mesh, and the ref mesh (or the actor's)."""
    from tiderl.models.sharding import make_mesh

    def pick(idx: tuple[int, ...]) -> list[jax.Device]:
        return [devices[i] for i in idx]

    n_actor = len(plan.actor)
    actor = make_mesh(pick(plan.actor), data=n_actor // (fsdp * model_parallel), fsdp=fsdp,
                      model=model_parallel)
    ref = make_mesh(pick(plan.ref), data=len(plan.ref)) if plan.ref else actor
    rollout = [make_mesh(pick(r), model=len(r)) for r in plan.rollout]
    return {"rollout": rollout, "actor": actor, "ref": ref}


# -- cells (ERS): pure data, validated before JAX starts --------------------------------------
@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Devices grouped into cells of `cell_size` (device indices, in device order) and each
    cell's role at start. A cell is the unit both roles use: one fsdp × model group of the
    trainer, or `cell_size` one-device rollout ranks; ERS moves cells, never devices."""

    cell_size: int
    cells: tuple[tuple[int, ...], ...]
    roles: tuple[str, ...]

    @property
    def ranks_per_cell(self) -> int:
        return self.cell_size  # rollout ranks are one device each

    def devices(self, cells: tuple[int, ...] | list[int]) -> list[int]:
        return [d for c in sorted(cells) for d in self.cells[c]]


def cell_size_for(*, ranks: int, devices_per_rank: int, actor_devices: int, ref_devices: int,
                  fsdp: int, model_parallel: int) -> int:
    """The cell size the roles share (trainer.fsdp × trainer.model_parallel); ConfigError
    naming the key when a role's devices are not whole cells."""
    size = fsdp * model_parallel
    checks = (("rollout.ranks × rollout.devices_per_rank", ranks * devices_per_rank),
              ("trainer.actor_devices", actor_devices), ("trainer.ref_devices", ref_devices))
    for key, n in checks:
        if n % size:
            raise ConfigError(
                f"config key '{key.split(' ')[0]}': {key} is {n} devices, not a whole number "
                f"of cells of {size} devices (trainer.fsdp × trainer.model_parallel), which "
                f"elastic scaling moves between roles; make it a multiple of {size} or set "
                "controller.ers=off")
    if size % devices_per_rank:
        raise ConfigError(f"config key 'rollout.devices_per_rank'={devices_per_rank} must divide "
                          f"the cell size {size} (trainer.fsdp × trainer.model_parallel)")
    return size


def cell_layout(plan: DevicePlan, cell_size: int) -> CellLayout:
    """The cells of a (not colocated) device plan: rollout cells first, then the Actor's, then
    the Ref's, as `plan_devices` lays the roles out."""
    groups = (("rollout", [d for r in plan.rollout for d in r]), ("trainer", list(plan.actor)),
              ("ref", list(plan.ref)))
    cells: list[tuple[int, ...]] = []
    roles: list[str] = []
    for role, devs in groups:
        if len(devs) % cell_size:
            raise ConfigError(f"the {role} role holds {len(devs)} devices, not whole cells of "
                              f"{cell_size}; set controller.ers=off or resize the role")
        for k in range(0, len(devs), cell_size):
            cells.append(tuple(devs[k:k + cell_size]))
            roles.append(role)
    return CellLayout(cell_size, tuple(cells), tuple(roles))
