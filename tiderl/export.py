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
from collections.abc import Sequence
from pathlib import Path

from tiderl.config import RunConfig
from tiderl.configlib import ConfigError

# Re-exported: `from tiderl.export import load_run_params` is how scripts read a run back.
from tiderl.runtime.runparams import RunParams, load_run_config, load_run_params

__all__ = ["RunParams", "export_run", "load_run_config", "load_run_params", "main"]

# Tokenizer files an HF folder carries (whichever exist beside the run's tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
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

    from tiderl.models.decoder import DTYPES
    from tiderl.models.hf import ARCHITECTURES, read_hf_config, save_pretrained
    from tiderl.models.policy import policy_class

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {str(out)!r} exists and is not an empty folder; pass a new "
                          "or empty OUT")
    rp = load_run_params(run_dir, step)
    cfg, graphdef, params = rp.model, rp.graphdef, rp.params
    if dtype is not None and dtype != cfg.param_dtype:
        cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)  # type: ignore[arg-type]
        cls = policy_class(cfg)
        graphdef = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))[0]
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
    from tiderl.control.logs import setup_logging

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
