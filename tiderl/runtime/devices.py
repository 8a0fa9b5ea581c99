"""Device pool and roles: which devices hold rollout ranks, the Actor and the Ref.

The plan itself is pure data (device indices per role) so it can be validated before JAX starts;
`init_jax` and `role_meshes` turn it into devices and meshes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from tiderl.configlib import ConfigError
from tiderl.runtime.platforms import CPU_LOW_MEMORY_FLAG, Platform, plan_remedy

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the job runs (per-platform handling: tiderl/runtime/platforms.py)."""

    platform: Platform = "auto"
    """'auto' (an accelerator JAX finds, else the CPU), 'cpu', 'gpu' or 'tpu'. An explicit
    'gpu'/'tpu' that JAX cannot start is an error, never a silent CPU run."""
    fake_cpu_devices: int = 2
    """> 0: when JAX runs on the CPU, split it into this many devices (laptops, tests); sets
    jax_num_cpu_devices. A CPU-only setting: ignored with platform 'gpu'/'tpu' (and by 'auto'
    when an accelerator is found)."""
    colocate_rollout: bool | Literal["auto"] = "auto"
    """Rollout and training share devices (the `sync` baseline alternates on them). 'auto':
    share on an accelerator too small to give them devices of their own (one GPU), keep them
    apart otherwise and on the CPU."""
    memory_fraction: float = 0.9
    """GPU: the share of each GPU XLA's allocator reserves at start
    (XLA_PYTHON_CLIENT_MEM_FRACTION; an environment value wins). Weights, optimizer state,
    the engine's KV pool and activations all live inside it."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache: 'auto' (an existing $JAX_COMPILATION_CACHE_DIR,
    else the user cache dir, $XDG_CACHE_HOME or ~/.cache, under tiderl/jax), 'run'
    (<run_dir>/compile_cache), 'off', or a directory. Executables that took over a second to
    compile are reused by later runs (and by a resumed one), including those of every trainer
    mesh elastic scaling visits. Always off in a multi-process job (cached CPU collectives
    executables do not survive a multi-process resume)."""

    def __post_init__(self):
        if self.fake_cpu_devices < 0:
            raise ConfigError("config key 'cluster.fake_cpu_devices' must be >= 0")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"config key 'cluster.memory_fraction'={self.memory_fraction} "
                              "must lie in (0, 1]; e.g. 0.9")


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
                 ref_devices: int, colocate_rollout: bool = False,
                 platform: str = "cpu") -> DevicePlan:
    """Lays roles onto devices in order: rollout ranks, then Actor, then Ref.

    Raises ConfigError naming the keys when the roles need more devices than there are, with
    the remedy that applies on `platform` (the one JAX started on).
    """
    need_rollout = ranks * devices_per_rank
    if colocate_rollout:
        need = max(need_rollout, actor_devices + ref_devices)
        if need > n_devices:
            raise ConfigError(
                f"config keys 'rollout.ranks'={ranks} × rollout.devices_per_rank="
                f"{devices_per_rank} / trainer.actor_devices={actor_devices} + "
                f"trainer.ref_devices={ref_devices} need {need} devices but {n_devices} are "
                f"visible; lower them {plan_remedy(platform, colocated=True)}"
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
            f"or the trainer devices, {plan_remedy(platform)}"
        )
    rollout = _rank_devices(ranks, devices_per_rank)
    actor = tuple(range(need_rollout, need_rollout + actor_devices))
    ref = tuple(range(need_rollout + actor_devices, need))
    return DevicePlan(n_devices, rollout, actor, ref)


def _rank_devices(ranks: int, per_rank: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks))


__all__ = ["CPU_LOW_MEMORY_FLAG", "ClusterConfig", "DevicePlan", "init_jax", "plan_devices",
           "role_meshes"]


def init_jax(cfg: ClusterConfig, *, low_memory: bool = False) -> list[jax.Device]:
    """Configures and starts JAX per `cfg` (see tiderl/runtime/platforms.py); returns the visible
    devices of the platform it started on.

    `low_memory` (launch passes `trainer.remat`) adds XLA:CPU's memory-ordered scheduler on
    the CPU (`CPU_LOW_MEMORY_FLAG`) and fixes glibc's mmap threshold there
    (`cpu_low_memory_malloc`). Environment variables and flags are read when a backend
    starts; a started backend keeps its own."""
    import os

    import jax

    from tiderl.runtime.platforms import check_platform, launch_env

    env = launch_env(cfg.platform, fake_cpu_devices=cfg.fake_cpu_devices,
                     memory_fraction=cfg.memory_fraction, environ=os.environ,
                     low_memory=low_memory)
    os.environ.update(env.env)
    if env.jax_platforms is not None:
        jax.config.update("jax_platforms", env.jax_platforms)
    if env.num_cpu_devices:
        jax.config.update("jax_num_cpu_devices", env.num_cpu_devices)
    devices = list(jax.devices())
    check_platform(cfg.platform, devices[0].platform)
    if low_memory and devices[0].platform == "cpu":
        from tiderl.runtime.platforms import cpu_low_memory_malloc

        cpu_low_memory_malloc()  # host memory is the device's: freed buffers go back
    return devices


ENV_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"


def compile_cache_dir(cfg: ClusterConfig, run_dir: str, *, processes: int = 1,
                      environ: Mapping[str, str] | None = None) -> str | None:
    """Where `cluster.compile_cache` puts JAX's persistent compilation cache (None: off).

    `processes`: how many processes the job has (the most of what the config asks for and
    `jax.process_count()`): more than one turns the cache off, since executables cached by
    one process of a CPU world (its gloo collectives) break the world a resume builds. An
    existing $JAX_COMPILATION_CACHE_DIR wins over every setting but 'off' (JAX itself reads
    it, and a harness that sets it means it)."""
    import os

    environ = os.environ if environ is None else environ
    v = cfg.compile_cache
    if v == "off" or not v or processes > 1:
        return None
    if environ.get(ENV_COMPILE_CACHE):
        return environ[ENV_COMPILE_CACHE]
    if v == "auto":
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "tiderl", "jax")
    if v == "run":
        return os.path.join(run_dir, "compile_cache")
    return os.path.expanduser(v)


def enable_compile_cache(path: str | None) -> None:
    """Turns the persistent compilation cache on at `path`, or off with None (before the
    first compilation: JAX decides once per process whether to use it). Off also clears a
    directory JAX took from $JAX_COMPILATION_CACHE_DIR, so 'off' and several processes mean
    off."""
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
