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
from tiderl.control.logs import setup_logging
from tiderl.runtime.world import WorldError

EPILOG = """\
overrides: dotted keys after the flags, e.g.
  python -m tiderl.launch --config configs/tiny-8dev.yaml trainer.lr=1e-5 rollout.ranks=2
sections: model, cluster, rollout, trainer, env, controller, distributed (every key:
docs/reference/config.md; several hosts: docs/how-to/several-hosts.md);
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
    hosts = p.add_argument_group(
        "several hosts", "one process per host, all in one JAX world (docs/how-to/several-hosts.md); "
        "shorthands for distributed.coordinator / num_processes / process_id")
    hosts.add_argument("--coordinator", metavar="HOST:PORT|auto",
                       help="process 0's address (the same on every process), or auto to take "
                            "the world from SLURM / torchrun-style / JAX_* variables")
    hosts.add_argument("--num-processes", type=int, metavar="N", help="processes in the world")
    hosts.add_argument("--process-id", type=int, metavar="I",
                       help="this process's index, 0..N-1 (0 runs the controller)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides applied after the preset")
    # Overrides may come before, between or after the flags.
    return p.parse_intermixed_args(argv)


def world_overrides(args: argparse.Namespace) -> list[str]:
    """The several-hosts flags as the config overrides they stand for."""
    out = []
    for flag, key in (("coordinator", "coordinator"), ("num_processes", "num_processes"),
                      ("process_id", "process_id")):
        if getattr(args, flag) is not None:
            out.append(f"distributed.{key}={getattr(args, flag)}")
    return out


def validate(cfg: RunConfig) -> None:
    """The checks RunConfig cannot make without importing the user's policy module or reading the
    tokenizer file; run before any work. A ConfigError names the key and the fix."""
    check_env(cfg)  # first: it needs no JAX, so a wrong env.url fails within seconds
    from tiderl.control.sinks import check_loggers
    from tiderl.envs.templates import template_for
    from tiderl.models.policy import check_policy  # imports JAX (seconds)
    from tiderl.models.tokenizer import load_tokenizer

    check_policy(cfg.model)
    check_loggers(cfg.controller.loggers)
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


def check_env(cfg: RunConfig) -> None:
    """The env side before any work: user code named by env.suite/env.reward/env.agent imports,
    task files read, and env.url answers /health within seconds (one line naming it if not)."""
    from tiderl.envs.health import env_url_error
    from tiderl.envs.suites import adapter_class, load_object
    from tiderl.envs.taskfile import check_chat_rows, read_rows

    env = cfg.env
    if env.kind == "env":
        try:
            adapter_class(env.suite_name)
        except (ValueError, ModuleNotFoundError) as e:
            raise ConfigError(f"config key 'env.suite'={env.suite!r}: {e}") from e
    for key, spec in (("env.reward", env.reward), ("env.agent", env.agent)):
        if spec and not callable(load_object(spec, key)):
            raise ConfigError(f"config key '{key}'={spec!r} is not callable")
    for key, path, split in (("env.tasks", env.tasks, "train"),
                             ("env.eval_tasks", env.eval_tasks, "eval")):
        if path:
            rows = read_rows(path, key=key, split=split)
            if env.kind == "single_turn":
                check_chat_rows(rows, key, path)
    if why := env_url_error(env):
        raise ConfigError(why)


def describe_world(cfg: RunConfig, plan, n_devices: int) -> str:
    """The device plan, and on several processes the cells each one holds."""
    from tiderl.runtime.cells import role_map
    from tiderl.runtime.world import current

    world = current()
    if world.size == 1:
        return plan.describe()
    lines = [world.describe(), plan.describe()]
    cells = role_map(plan, local_devices=n_devices // world.size, fsdp=cfg.trainer.fsdp,
                     model_parallel=cfg.trainer.model_parallel).cells
    for c in cells:
        lines.append(f"  cell (process {c.process}, local devices {list(c.local)}): "
                     f"{c.role} {c.index}")
    return "\n".join(lines)


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
    setup_logging()
    try:
        preset = args.config
        if args.resume:
            preset = str(Path(args.resume) / "config.yaml")
            if not Path(preset).is_file():
                raise ConfigError(f"--resume {args.resume}: no config.yaml there; pass the run "
                                  "folder a previous tiderl.launch wrote")
        overrides = list(args.overrides) + world_overrides(args)
        if args.resume:
            overrides.append(f"run_dir={args.resume}")
        cfg = load_config(preset, overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        if cfg.distributed.coordinator and not args.plan:
            from tiderl.runtime.supervise import supervise, supervised

            if not supervised():  # the job runs in a child; its end becomes one clear line
                return supervise(sys.argv[1:] if argv is None else list(argv),
                                 coordinator=cfg.distributed.coordinator,
                                 process_id=args.process_id, run_dir=cfg.run_dir)
        validate(cfg)
        if args.plan:
            import os

            from tiderl.runtime.platforms import launch_env

            c = cfg.cluster
            settings = launch_env(c.platform, fake_cpu_devices=c.fake_cpu_devices,
                                  memory_fraction=c.memory_fraction, environ=os.environ,
                                  low_memory=cfg.trainer.remat).notes
            from tiderl.runtime.build import build

            devices, plan, _meshes, _graphdef, params = build(cfg)
            print(f"tiderl: {devices[0].platform} × {len(devices)} ({devices[0].device_kind}); "
                  f"mode={cfg.controller.mode}")
            for line in settings:
                print(f"  {line}")
            print(describe_world(cfg, plan, len(devices)))
            print(describe_policy(cfg, params))
            return 0
        summary = _run(cfg, args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"tiderl.launch: error: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        print(f"tiderl.launch: stopped: {e.__cause__}", file=sys.stderr)
        return 3
    except WorldError as e:  # a process of a multi-host world went missing
        print(f"tiderl.launch: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("tiderl.launch: interrupted", file=sys.stderr)
        return 130
    if cfg.distributed.coordinator and "process" in summary:  # a host agent: no report
        print(f"tiderl.launch: process {summary['process']}: {summary['ended']}")
        return 0
    print_report(cfg, summary)
    return 0


class _Stopped(Exception):
    """The run stopped itself (non-finite updates, starvation, no rollout rank left); the cause
    says why."""


def _run(cfg: RunConfig, args: argparse.Namespace) -> dict:
    # Imported here: the control plane and JAX load only once the config checked out.
    import asyncio

    from tiderl.control.controller import NonFiniteStop, StarvedStop
    from tiderl.runtime.job import run_job
    from tiderl.serving.rollout import RolloutFailedError

    try:
        return asyncio.run(run_job(cfg, resume=bool(args.resume),
                                   overrides=tuple(args.overrides)))
    except (NonFiniteStop, StarvedStop, RolloutFailedError) as e:
        raise _Stopped from e


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
        ("role changes (ERS) → cells rollout/trainer/Ref",
         f"{s.get('role_changes', 0)} → {s.get('rollout_cells')}/{s.get('trainer_cells')}/"
         f"{s.get('ref_cells')}"),
        *[(f"{label} (last step)", s["last"][key]) for label, key in (
            ("policy loss", "pg_loss"), ("entropy", "entropy"),
            ("response tokens", "response_len_mean"), ("turns per episode", "turns_mean"))
          if key in s.get("last", {})],
    ]
    for k, v in rows:
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(t)
    if s.get("ended"):
        print(f"ended: {s['ended']}")
    print(f"run folder: {cfg.run_dir} (config.yaml, metrics.jsonl, checkpoints/, samples/, "
          f"plots/, report.md; python -m tiderl.report {cfg.run_dir})")


if __name__ == "__main__":
    sys.exit(main())
