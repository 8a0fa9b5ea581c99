"""Export a run's trained policy as a Hugging Face folder, and read a run's params back.

    python -m tiderl.export RUN_DIR OUT [--step N] [--dtype bfloat16]

reads RUN_DIR/config.yaml and the newest (or step N) orbax checkpoint in RUN_DIR/checkpoints,
restores only the actor's params (not the optimizer state or the Ref copy) onto the host CPU,
and writes OUT as an HF folder: model.safetensors + config.json, plus generation_config.json and
the tokenizer files of the run's HF tokenizer when the run had them. The architecture is kept
from `model.checkpoint`'s config.json when the run started from one; otherwise it follows the
model (Qwen3 with q/k norm, Qwen2 with qkv biases, Llama otherwise). Errors are one line, exit 2.

`load_run_params` is the reading half, shared with anything that starts from a run's weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tiderl.config import RunConfig, load_config
from tiderl.configlib import ConfigError, from_dict
from tiderl.models.config import ModelConfig

# Tokenizer files an HF folder carries (whichever exist beside the run's tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
_PARAMS_PREFIX = "['train']['params']"


class RunParams(NamedTuple):
    """A run's policy weights at one checkpoint step."""

    run: RunConfig
    model: ModelConfig
    """The model config the params were trained with (the checkpoint's own record)."""
    graphdef: Any
    params: Any
    """nnx.State of the built-in Decoder, on the host CPU or in its shardings on `mesh`."""
    step: int


def load_run_config(run_dir: str | Path) -> RunConfig:
    """RUN_DIR/config.yaml as a RunConfig (ConfigError naming the folder otherwise)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run folder {str(run_dir)!r} has no config.yaml; pass a run_dir that "
                          "python -m tiderl.launch wrote")
    return load_config(str(path))


def _host_device() -> Any:
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # jax_platforms excludes cpu
        return jax.devices()[0]


def _model_config(run: RunConfig, meta: dict, where: str) -> tuple[ModelConfig, Any, Any]:
    """The ModelConfig whose Decoder matches the checkpoint's saved params, with its
    (graphdef, abstract state). The checkpoint's own model record comes first; a run started
    from an HF `model.checkpoint` is also tried with that folder's config.json."""
    from flax import nnx

    from tiderl.models.decoder import Decoder
    from tiderl.models.hf import load_hf_config
    from tiderl.train.checkpoint import _structure

    saved = [s for s in meta.get("structure", []) if s.startswith(_PARAMS_PREFIX)]

    def candidates() -> Iterator[ModelConfig]:
        try:
            yield from_dict(ModelConfig, meta["model"], prefix="model")
        except (ConfigError, KeyError, TypeError):
            pass  # metadata from before the model config was recorded: try the next source
        m = run.model
        if m.checkpoint and (Path(m.checkpoint) / "config.json").is_file():
            hf = load_hf_config(m.checkpoint, dtype=m.param_dtype)
            yield dataclasses.replace(hf, compute_dtype=m.compute_dtype, tokenizer=m.tokenizer)

    for cfg in candidates():
        abstract = nnx.eval_shape(lambda c=cfg: Decoder(c, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        if _structure({"train": {"params": state}}) == saved:
            return cfg, graphdef, state
    raise ConfigError(f"checkpoint {where} holds params that match neither the model config "
                      "it recorded nor model.checkpoint's config.json; export it with the "
                      "tiderl version and config that wrote it")


def load_run_params(run_dir: str | Path, step: int | None = None, *,
                    mesh: Any = None) -> RunParams:
    """The actor params of RUN_DIR's newest (or `step`) checkpoint, restored alone (orbax
    partial restore: no optimizer state, no Ref copy, no TrainerBackend) onto the host CPU, or
    straight into their shardings on `mesh`.

    One-line ConfigErrors: no config.yaml, a custom `model.policy`, no complete checkpoint,
    a step that is not there (the message lists the ones that are), unreadable files.
    """
    import jax
    import orbax.checkpoint as ocp

    from tiderl.models.sharding import state_shardings
    from tiderl.train.checkpoint import _unreadable

    run_dir = Path(run_dir)
    run = load_run_config(run_dir)
    if run.model.policy != "decoder":
        raise ConfigError(f"run {str(run_dir)!r} has model.policy={run.model.policy!r}, a custom "
                          "policy; only the built-in decoder has an HF layout to load or export")
    ckdir = (run_dir / "checkpoints").absolute()
    if not ckdir.is_dir():
        raise ConfigError(f"run {str(run_dir)!r} has no checkpoints folder; set "
                          "controller.checkpoint_every so the run saves some")
    opts = ocp.CheckpointManagerOptions(create=False)  # reads only: nothing is saved or deleted
    mgr = ocp.CheckpointManager(ckdir, options=opts, item_handlers={
        "state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    try:
        steps = sorted(mgr.all_steps())
        if not steps:
            raise ConfigError(f"no complete checkpoint in {ckdir}; train longer than "
                              "controller.checkpoint_every steps first")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(f"step {step} has no checkpoint in {ckdir}; available steps: "
                              f"{', '.join(map(str, steps))}")
        where = str(ckdir / str(step))
        fix = "pass another step, or re-run the job"
        try:
            meta = mgr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
            raise _unreadable(Path(where), e, fix) from e
        model, graphdef, abstract = _model_config(run, meta, where)
        if mesh is None:
            host = jax.sharding.SingleDeviceSharding(_host_device())
            shardings = jax.tree.map(lambda _: host, abstract)
        else:
            shardings = state_shardings(abstract, mesh)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              abstract, shardings)
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings)
        try:
            out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item={"train": {"params": target}},
                restore_args={"train": {"params": restore_args}},
                partial_restore=True)))["state"]
        except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
            raise _unreadable(Path(where), e, fix) from e
    finally:
        mgr.close()
    return RunParams(run=run, model=model, graphdef=graphdef, params=out["train"]["params"],
                     step=step)


def _tokenizer_folder(run: RunConfig) -> Path | None:
    """The folder of the run's HF tokenizer.json, or None for the byte tokenizer."""
    spec = run.model.tokenizer
    if spec == "byte":
        return None
    p = Path(spec)
    return p if p.is_dir() else p.parent


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None,
               dtype: str | None = None) -> tuple[RunParams, list[str]]:
    """Writes RUN_DIR's policy at `step` (default newest) as an HF folder `out`; returns what
    was loaded and the names of the files written."""
    import jax
    from flax import nnx

    from tiderl.models.decoder import DTYPES, Decoder
    from tiderl.models.hf import ARCHITECTURES, read_hf_config, save_pretrained

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {str(out)!r} exists and is not an empty folder; pass a new "
                          "or empty OUT")
    rp = load_run_params(run_dir, step)
    cfg, graphdef, params = rp.model, rp.graphdef, rp.params
    if dtype is not None and dtype != cfg.param_dtype:
        cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)  # type: ignore[arg-type]
        graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[0]
        params = jax.tree.map(lambda x: x.astype(DTYPES[dtype]), params)
    base, arch = None, None
    src = Path(rp.run.model.checkpoint) if rp.run.model.checkpoint else None
    if src is not None and (src / "config.json").is_file():
        base = read_hf_config(src)
        kept = (base.get("architectures") or [None])[0]
        arch = kept if kept in ARCHITECTURES else None
    model = nnx.merge(graphdef, params)
    try:
        save_pretrained(model, out, architecture=arch, base_config=base)
    except ValueError as e:
        shutil.rmtree(out, ignore_errors=True)
        raise ConfigError(f"cannot export run {str(run_dir)!r} as {arch}: {e}") from e
    written = ["model.safetensors", "config.json"]
    if src is not None and (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
        written.append("generation_config.json")
    tok = _tokenizer_folder(rp.run)
    if tok is not None:
        for name in TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copyfile(tok / name, out / name)
                written.append(name)
    return rp._replace(model=cfg, graphdef=graphdef, params=params), written


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tiderl.export",
        description="Write a tiderl run's trained policy as a Hugging Face folder "
                    "(safetensors + config.json + tokenizer files).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder tiderl.launch wrote")
    p.add_argument("out", metavar="OUT", help="the HF folder to write (new or empty)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint step to export (default: the newest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype written (default: the run's model.param_dtype)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from tiderl.logs import setup_logging

    args = parse_args(argv)
    setup_logging()
    try:
        import numpy as np

        rp, written = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    except (ConfigError, FileNotFoundError) as e:
        print(f"tiderl.export: error: {e}", file=sys.stderr)
        return 2
    import jax

    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(rp.params))
    print(f"exported {args.run_dir} step {rp.step} ({n:,} parameters, "
          f"{rp.model.param_dtype}) to {args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
