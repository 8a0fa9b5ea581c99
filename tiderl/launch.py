"""`python -m tiderl.launch [--config PRESET.yaml] [key=value ...]`: the tiderl entry point.

Parses and validates the config (every error names the key and the fix, before any work),
initialises JAX, lays roles onto devices, builds the policy, and runs the job.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tiderl.config import RunConfig, load_config
from tiderl.configlib import ConfigError
from tiderl.control.controller import NonFiniteStop
from tiderl.serving.rollout import RolloutFailedError

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
    p.add_argument("--plan", action="store_true",
                   help="build the device plan and the policy, print them, and exit")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint (its saved "
                        "config.yaml is the base; overrides still apply)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides applied after the preset")
    # Overrides may come before, between or after the flags.
    return p.parse_intermixed_args(argv)


def validate(cfg: RunConfig) -> None:
    """The checks RunConfig cannot make without importing the user's policy module or reading the
    tokenizer file; run before any work. A ConfigError names the key and the fix."""
    from tiderl.envs.templates import template_for
    from tiderl.models.policy import check_policy
    from tiderl.models.tokenizer import load_tokenizer

    check_policy(cfg.model)
    try:
        tok = load_tokenizer(cfg.model.tokenizer)
        template = template_for(tok, "auto")
    except ValueError as e:
        raise ConfigError(f"config key 'model.tokenizer'={cfg.model.tokenizer!r}: {e}") from e
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"config key 'model.tokenizer'={cfg.model.tokenizer!r} has {tok.vocab_size:,} tokens "
            f"but the model's embedding has model.vocab_size={cfg.model.vocab_size:,} rows; use "
            "the tokenizer the checkpoint was trained with (or raise model.vocab_size)")
    if cfg.controller.system_prompt and not template.system_open:
        raise ConfigError(
            f"config key 'controller.system_prompt' is set, but the {template.name!r} turn "
            f"template of model.tokenizer={cfg.model.tokenizer!r} has no system role; set "
            "controller.system_prompt='' or use a tokenizer whose template has one (ChatML, "
            "Llama 3)")


def build(cfg: RunConfig):
    """Starts JAX and returns (devices, plan, meshes, graphdef, params)."""
    import jax

    from tiderl.cluster import init_jax, role_meshes
    from tiderl.models.policy import abstract_policy, check_contract, init_policy

    if cfg.cluster.fake_cpu_devices and cfg.cluster.platform == "cpu":
        # Validate the plan before JAX starts when the device count is known up front.
        cfg.device_plan(cfg.cluster.fake_cpu_devices)
    devices = init_jax(cfg.cluster, low_memory=cfg.trainer.remat)
    plan = cfg.device_plan(len(devices))
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
        from tiderl.export import load_run_params
        from tiderl.models.policy import convert_layout

        source = load_run_params(*split_init_from(cfg.model.init_from), mesh=meshes["actor"])
        params = convert_layout(source.params, source.model, scan_layers=cfg.model.scan_layers)
        params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract)
    else:
        graphdef, params = init_policy(cfg.model, seed=cfg.seed, mesh=meshes["actor"])
    check_contract(graphdef, params, cfg.model)
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
        preset = args.config
        if args.resume:
            preset = str(Path(args.resume) / "config.yaml")
            if not Path(preset).is_file():
                raise ConfigError(f"--resume {args.resume}: no config.yaml there; pass the run "
                                  "folder a previous tiderl.launch wrote")
        overrides = list(args.overrides)
        if args.resume:
            overrides.append(f"run_dir={args.resume}")
        cfg = load_config(preset, overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        validate(cfg)
        if args.plan:
            devices, plan, _meshes, _graphdef, params = build(cfg)
            print(f"tiderl: {devices[0].platform} × {len(devices)}; mode={cfg.controller.mode}")
            print(plan.describe())
            print(describe_policy(cfg, params))
            return 0
        import asyncio

        from tiderl.job import run_job

        setup_logging()
        summary = asyncio.run(run_job(cfg, resume=bool(args.resume),
                                      overrides=tuple(args.overrides)))
    except (ConfigError, FileNotFoundError) as e:
        print(f"tiderl.launch: error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStop, RolloutFailedError) as e:
        print(f"tiderl.launch: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("tiderl.launch: interrupted", file=sys.stderr)
        return 130
    print_report(cfg, summary)
    return 0


def setup_logging() -> None:
    """tiderl's own messages (info and up) and everyone's warnings go to the console, above the
    progress line; JAX/orbax info chatter stays quiet."""
    import logging

    from rich.logging import RichHandler

    root = logging.getLogger()
    # A library's module-level logging.warning() may have installed a plain stderr handler
    # (logging.basicConfig's); with it every message would print twice.
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler:
            root.removeHandler(h)
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        handler = RichHandler(show_path=False, log_time_format="[%X]")
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    logging.getLogger("tiderl").setLevel(logging.INFO)


def print_report(cfg: RunConfig, s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"tiderl run {cfg.run_dir} ({cfg.controller.mode})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("steps", s.get("steps")), ("wall time (s)", s.get("wall_s")),
        ("goodput (consumed action tok/s)", s.get("goodput")),
        ("generation throughput (tok/s)", s.get("gen_throughput")),
        ("KV hit rate", s.get("kv_hit_rate")), ("RWT total (s)", s.get("rwt_s")),
        ("TWT total (s)", s.get("twt_s")), ("train reward first → last",
                                             f"{s.get('reward_first', 0):.3f} → "
                                             f"{s.get('reward_last', 0):.3f}"),
        ("eval success first → last (best)",
         f"{s.get('eval_success_first', float('nan')):.3f} → "
         f"{s.get('eval_success_last', float('nan')):.3f} "
         f"({s.get('eval_success_best', float('nan')):.3f})"),
        ("dropped groups", s.get("dropped")), ("failed tasks", s.get("failed_tasks")),
        ("non-finite updates skipped", s.get("nonfinite_skipped")),
    ]
    for k, v in rows:
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(t)
    if s.get("ended"):
        print(f"ended: {s['ended']}")
    print(f"run folder: {cfg.run_dir} (config.yaml, metrics.jsonl, checkpoints/, plots/; "
          f"python -m tiderl.report {cfg.run_dir})")


if __name__ == "__main__":
    sys.exit(main())
