"""What a run is built on: JAX started with the device plan checked (`start_devices`), then the
role meshes and the policy with its first weights (`build_policy`); `build` does both. Used by
the composition root (`tiderl.runtime.job`), `launch --plan`, the hosts of a several-process
world and the simulator's calibration."""

from __future__ import annotations

from typing import Any

from tiderl.config import RunConfig


def start_devices(cfg: RunConfig) -> tuple[list, Any]:
    """Joins the world, starts JAX and lays the roles onto its devices; returns (devices, plan).
    A plan the devices cannot hold raises ConfigError here, before the run folder is touched."""
    from tiderl.runtime.cells import device_plan_for
    from tiderl.runtime.devices import init_jax
    from tiderl.runtime.world import initialize

    world = initialize(cfg.distributed)  # before any JAX backend starts; one process: no-op
    if cfg.cluster.fake_cpu_devices and cfg.cluster.platform == "cpu":
        # Validate the plan before JAX starts when the device count is known up front.
        device_plan_for(cfg, world.size, cfg.cluster.fake_cpu_devices)
    devices = init_jax(cfg.cluster, low_memory=cfg.trainer.remat)
    plan = device_plan_for(cfg, world.size, len(devices) // world.size, devices[0].platform)
    return devices, plan


def build_policy(cfg: RunConfig, devices: list, plan: Any) -> tuple[dict, Any, Any]:
    """The role meshes and the policy (graphdef, params) on the Actor's mesh: from
    `model.checkpoint`, `model.init_from` or a fresh init. Returns (meshes, graphdef, params)."""
    import jax

    from tiderl.models.policy import abstract_policy, check_contract, init_policy
    from tiderl.runtime.devices import compile_cache_dir, enable_compile_cache, role_meshes
    from tiderl.runtime.world import current

    # Several processes (asked for, or found): no persistent cache (see compile_cache_dir).
    enable_compile_cache(compile_cache_dir(
        cfg.cluster, cfg.run_dir,
        processes=max(current().size, cfg.distributed.num_processes, jax.process_count())))
    meshes = role_meshes(plan, devices, fsdp=cfg.trainer.fsdp,
                         model_parallel=cfg.trainer.model_parallel)
    # The graphdef always comes from cfg.model: its shape is the checkpoint's (load_config
    # resolved it) and its numerics (compute dtype) are the run's.
    graphdef, abstract = abstract_policy(cfg.model)
    if cfg.model.checkpoint:
        from flax import nnx

        from tiderl.models.hf import from_pretrained

        _, params = nnx.split(from_pretrained(cfg.model.checkpoint, dtype=cfg.model.param_dtype,
                                              mesh=meshes["actor"],
                                              scan_layers=cfg.model.scan_layers))
    elif cfg.model.init_from:
        from tiderl.config import split_init_from
        from tiderl.models.policy import convert_layout
        from tiderl.runtime.runparams import load_run_params

        source = load_run_params(*split_init_from(cfg.model.init_from), mesh=meshes["actor"])
        params = convert_layout(source.params, source.model, scan_layers=cfg.model.scan_layers)
        params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract)
    else:
        graphdef, params = init_policy(cfg.model, seed=cfg.seed, mesh=meshes["actor"])
    check_contract(graphdef, params, cfg.model)
    return meshes, graphdef, params


def build(cfg: RunConfig):
    """Starts JAX and returns (devices, plan, meshes, graphdef, params)."""
    devices, plan = start_devices(cfg)
    meshes, graphdef, params = build_policy(cfg, devices, plan)
    return devices, plan, meshes, graphdef, params
