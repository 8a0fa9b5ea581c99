"""`python -m tiderl.launch [--config PRESET.yaml] [key=value ...]`: the tiderl entry point.

Parses and validates the config (every error names the key and the fix, before any work),
initialises JAX, lays roles onto devices, builds the policy, and runs the job.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tiderl.config import RunConfig, load_config
from tiderl.configlib import ConfigError

EPILOG = """\
overrides: dotted keys after the flags, e.g.
  python -m tiderl.launch --config configs/tiny-8dev.yaml trainer.lr=1e-5 rollout.ranks=2
sections: model, cluster, rollout, trainer, env, controller (see README "Configuration");
values are YAML (numbers, true/false, [lists]).
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tiderl.launch",
        description="Asynchronous, elastic RL for multi-turn LLM agents (tiderl). With no "
                    "arguments runs the embedded default: the default task on this CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="PRESET.yaml",
                   help="YAML preset (e.g. configs/tiny-8dev.yaml); defaults are built in")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides applied after the preset")
    return p.parse_args(argv)


def build(cfg: RunConfig):
    """Starts JAX and returns (devices, plan, meshes, graphdef, params)."""
    from tiderl.cluster import init_jax, role_meshes
    from tiderl.models.policy import init_policy

    if cfg.cluster.fake_cpu_devices and cfg.cluster.platform == "cpu":
        # Validate the plan before JAX starts when the device count is known up front.
        cfg.device_plan(cfg.cluster.fake_cpu_devices)
    devices = init_jax(cfg.cluster)
    plan = cfg.device_plan(len(devices))
    meshes = role_meshes(plan, devices, fsdp=cfg.trainer.fsdp,
                         model_parallel=cfg.trainer.model_parallel)
    if cfg.model.checkpoint:
        from flax import nnx

        from tiderl.models.hf import from_pretrained

        model = from_pretrained(cfg.model.checkpoint, dtype=cfg.model.param_dtype,
                                mesh=meshes["actor"])
        graphdef, params = nnx.split(model)
    else:
        graphdef, params = init_policy(cfg.model, seed=cfg.seed, mesh=meshes["actor"])
    return devices, plan, meshes, graphdef, params


def describe_policy(cfg: RunConfig, params) -> str:
    import jax
    import numpy as np

    leaves = jax.tree.leaves(params)
    n = sum(int(np.prod(x.shape)) for x in leaves)
    src = cfg.model.checkpoint or f"initialised (seed {cfg.seed})"
    m = cfg.model
    return (f"policy {m.policy}: {n:,} parameters, {src}\n"
            f"  layers={m.n_layers} d_model={m.d_model} heads={m.n_heads}/{m.n_kv_heads} "
            f"head_dim={m.head_dim} mlp={m.mlp_dim} vocab={m.vocab_size} "
            f"dtype={m.param_dtype}/{m.compute_dtype} tokenizer={m.tokenizer}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        devices, plan, _meshes, _graphdef, params = build(cfg)
    except (ConfigError, FileNotFoundError) as e:
        print(f"tiderl.launch: error: {e}", file=sys.stderr)
        return 2
    print(f"tiderl: {devices[0].platform} × {len(devices)}; mode={cfg.controller.mode}")
    print(plan.describe())
    print(describe_policy(cfg, params))
    print("tiderl: the RL loop (controller) is not attached in this build; nothing was trained.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
