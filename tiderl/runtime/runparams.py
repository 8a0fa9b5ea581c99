"""A run's weights read back from its folder: `load_run_params` restores the Actor's params of
one checkpoint alone (no optimizer state, no Ref, no trainer), for `tiderl.export` and for a run
that starts from another (`model.init_from`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from tiderl.config import RunConfig, load_config
from tiderl.configlib import ConfigError, from_dict
from tiderl.models.config import ModelConfig

_PARAMS_PREFIX = "['train']['params']"
_BASE_PREFIX = "['base']"


class RunParams(NamedTuple):
    """A run's policy weights at one checkpoint step."""

    run: RunConfig
    model: ModelConfig
    """The model config the params were trained with (the checkpoint's own record)."""
    graphdef: Any
    params: Any
    """nnx.State of the built-in Decoder (or VLM), on the host CPU or in its shardings on
    `mesh`."""
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
    """The ModelConfig whose policy (Decoder, or VisionLanguageModel) matches the checkpoint's
    saved params, with its (graphdef, abstract state). The checkpoint's own model record comes
    first; a run started from an HF `model.checkpoint` is also tried with that folder's
    config.json."""
    from flax import nnx

    from tiderl.models.hf import load_hf_config
    from tiderl.models.policy import policy_class
    from tiderl.train.checkpoint import _structure

    # A LoRA run saves its frozen base beside the adapters' train state: the base is the model.
    prefix = _BASE_PREFIX if meta.get("lora") else _PARAMS_PREFIX
    saved = [s[len(prefix):] for s in meta.get("structure", []) if s.startswith(prefix)]

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
        # The built-in decoder, or its vision-language form when the config has a tower.
        abstract = nnx.eval_shape(lambda c=cfg: policy_class(c)(c, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        if _structure(state) == saved:
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
        lora = _lora_spec(meta)
        item = {"params": abstract}
        if lora is not None:  # the base and the adapters, merged below
            from tiderl.models.policy import abstract_lora

            item = {"params": abstract_lora(model, lora), "base": abstract}

        def target(tree: Any) -> tuple[Any, Any]:
            if mesh is None:
                host = jax.sharding.SingleDeviceSharding(_host_device())
                shardings = jax.tree.map(lambda _: host, tree)
            else:
                shardings = state_shardings(tree, mesh)
            return (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 tree, shardings),
                    jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings))

        t = {k: target(v) for k, v in item.items()}
        tree = {"train": {"params": t["params"][0]}}
        args = {"train": {"params": t["params"][1]}}
        if lora is not None:
            tree["base"], args["base"] = t["base"]
        try:
            out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=tree, restore_args=args, partial_restore=True)))["state"]
        except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
            raise _unreadable(Path(where), e, fix) from e
    finally:
        mgr.close()
    params = out["train"]["params"]
    if lora is not None:
        from tiderl.models.lora import merge_lora

        params = merge_lora(out["base"], params, lora.scale)
    return RunParams(run=run, model=model, graphdef=graphdef, params=params, step=step)


def _lora_spec(meta: dict) -> Any:
    """The LoRA a checkpoint's meta records (`models.lora.LoraSpec`), or None."""
    rec = meta.get("lora")
    if not rec:
        return None
    from tiderl.models.lora import LoraSpec

    return LoraSpec(int(rec["rank"]), float(rec["alpha"]), tuple(rec["targets"]))
