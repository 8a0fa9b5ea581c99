"""Orbax checkpoints of the trainer: params, optimizer state, step, weight version, RNG, Ref params
and the caller's opaque (JSON) task-stream iterator state.

Saves are asynchronous (the device→host copy happens before `save` returns, so the caller may
donate the state right after; files are written in the background) and the newest
`keep` are kept. Orbax writes into a temporary directory and renames it when complete, so a
write killed midway leaves only a `*.orbax-checkpoint-tmp-*` directory, which `latest_step`
ignores: resume picks the newest complete checkpoint. The model config and the train-state
structure are stored beside the arrays; resuming with a different one is a `ConfigError`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tiderl.configlib import ConfigError, to_dict

log = logging.getLogger(__name__)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _structure(tree: Any) -> list[str]:
    """Leaf paths with shapes and dtypes: what must match for a restore to make sense."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in leaves]


class Checkpointer:
    """One run's checkpoint directory (orbax CheckpointManager, async, keep N)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                            enable_async_checkpointing=async_save)
        self.mgr = ocp.CheckpointManager(self.directory, options=opts,
                                         item_names=("state", "meta"))

    @classmethod
    def from_config(cls, run_dir: str | Path, cfg) -> Checkpointer:
        """`<run_dir>/checkpoints`, keeping `trainer.keep_checkpoints`."""
        return cls(Path(run_dir) / "checkpoints", keep=cfg.keep_checkpoints)

    def save_if_due(self, backend, every: int, *, data_state: Any = None) -> int | None:
        """Saves when the backend's step is a multiple of `every` (trainer.checkpoint_every)."""
        step = int(jax.device_get(backend.state["step"]))
        if every <= 0 or step == 0 or step % every:
            return None
        return self.save(backend, data_state=data_state)

    def _tree(self, backend) -> dict:
        # Offloaded models come back to device memory first (the shardings saved are those).
        backend.swap("actor", "device")
        backend.swap("ref", "device")
        return {"train": backend.state, "ref": backend.ref_params, "rng": backend.rng_key}

    def save(self, backend, *, data_state: Any = None, wait: bool = False) -> int:
        """Checkpoints `backend` at its current step; `data_state` must be JSON-serialisable."""
        tree = self._tree(backend)
        step = int(jax.device_get(backend.state["step"]))
        try:
            json.dumps(data_state)
        except TypeError as e:
            raise TypeError(f"data_state is not JSON-serialisable ({e}); pass the iterator's "
                            "plain-data state (e.g. grain's get_state() decoded)") from e
        meta = {"step": step, "version": backend.version, "data_state": data_state,
                "model": to_dict(backend.model_cfg), "structure": _structure(tree)}
        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                    meta=ocp.args.JsonSave(meta)))
        if wait:
            self.mgr.wait_until_finished()
        return step

    def latest_step(self) -> int | None:
        self.mgr.reload()
        return self.mgr.latest_step()

    def restore(self, backend, step: int | None = None) -> tuple[int, Any] | None:
        """Restores the newest complete checkpoint (or `step`) into `backend`.

        Returns (step, data_state), or None when the directory holds no complete checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        meta = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        want = to_dict(backend.model_cfg)
        if meta["model"] != want:
            diff = sorted(k for k in set(want) | set(meta["model"])
                          if want.get(k) != meta["model"].get(k))
            raise ConfigError(
                f"checkpoint {self.directory}/{step} was written for a different model: "
                + ", ".join(f"model.{k}={meta['model'].get(k)!r} (now {want.get(k)!r})"
                            for k in diff)
                + "; resume with the checkpoint's model config or use a new run_dir")
        tree = self._tree(backend)
        if meta["structure"] != _structure(tree):
            raise ConfigError(
                f"checkpoint {self.directory}/{step} holds a different train state (optimizer "
                "or parameter layout changed, e.g. trainer.grad_clip/weight_decay/lr_schedule); "
                "resume with the config it was written with or use a new run_dir")
        out = self.mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(tree))))["state"]
        backend.state, backend.ref_params, backend.rng_key = out["train"], out["ref"], out["rng"]
        backend.version = int(meta["version"])
        log.info("resumed from %s/%d (version %d)", self.directory, step, backend.version)
        return step, meta["data_state"]

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()
