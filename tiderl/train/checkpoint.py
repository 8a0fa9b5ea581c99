"""Orbax checkpoints of the trainer: params, optimizer state, step, weight version, Ref params and
the caller's opaque (JSON) task-stream iterator state. (Training draws no random numbers: the
GRPO step is deterministic, and rollout sampling keys derive from the run seed, the task and
the position, so there is no RNG state to save.)

Saves are asynchronous (the device→host copy happens before `save` returns, so the caller may
donate the state right after; files are written in the background) and the newest
`keep` are kept. Orbax writes into a temporary directory and renames it when complete, so a
write killed midway leaves only a `*.orbax-checkpoint-tmp-*` directory, which `latest_step`
ignores: resume picks the newest complete checkpoint. The model config and the train-state
structure are stored beside the arrays; resuming with a different one is a `ConfigError`, and so
is a checkpoint orbax cannot read (corrupt or missing files): the message names the step folder.
With LoRA (`trainer.lora_rank`) the train state is the adapters' and the frozen base is saved
beside it as `base` (no `ref`: the Ref is the base), so a checkpoint exports on its own; the
LoRA settings are recorded and must match at resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tiderl.configlib import ConfigError, from_dict, to_dict

log = logging.getLogger(__name__)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _lora_record(backend) -> dict | None:
    """The LoRA a backend trains ({rank, alpha, targets}), None for full fine-tuning."""
    spec = getattr(backend, "lora", None)
    return None if spec is None else {"rank": spec.rank, "alpha": spec.alpha,
                                      "targets": list(spec.targets)}


def _structure(tree: Any) -> list[str]:
    """Leaf paths with shapes and dtypes: what must match for a restore to make sense."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in leaves]


_META_KEYS = frozenset({"step", "version", "data_state", "model", "structure"})


def _unreadable(where: Path, e: BaseException, fix: str) -> ConfigError:
    """orbax/tensorstore errors can span pages; one line of it is enough to say what broke."""
    detail = " ".join(str(e).split()).split(" See full TensorStore details")[0] or "no detail"
    if len(detail) > 160:
        detail = detail[:157] + "..."
    return ConfigError(f"checkpoint {where} cannot be read ({type(e).__name__}: {detail}); {fix}")


class Checkpointer:
    """One run's checkpoint directory (orbax CheckpointManager, async, keep N)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                            enable_async_checkpointing=async_save)
        self.mgr = ocp.CheckpointManager(self.directory, options=opts,
                                         item_names=("state", "meta"))

    def _tree(self, backend) -> dict:
        # Offloaded models come back to device memory first (the shardings saved are those).
        backend.swap("actor", "device")
        backend.swap("ref", "device")
        if getattr(backend, "frozen", None) is not None:
            # LoRA: the adapters' train state and the frozen base (which is also the Ref: a
            # Ref copy on a mesh of its own is made again from it at restore).
            return {"train": backend.state, "base": backend.frozen}
        if backend.ref_params is None:  # no KL term: the backend keeps no Ref copy
            return {"train": backend.state}
        return {"train": backend.state, "ref": backend.ref_params}

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
                "model": to_dict(backend.model_cfg), "structure": _structure(tree),
                "lora": _lora_record(backend)}
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
        A checkpoint written for another model or train state, or one that cannot be read, is a
        one-line `ConfigError` naming it and the fix.
        """
        if step is None:
            try:
                step = self.latest_step()
            except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
                raise _unreadable(self.directory, e, "make it a readable checkpoint folder or "
                                  "start a new run_dir (without --resume)") from e
        if step is None:
            return None
        where = self.directory / str(step)
        fix = (f"delete {where} to resume from the previous checkpoint, or start a new run_dir "
               "(without --resume)")
        try:
            meta = self.mgr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict) or not _META_KEYS <= meta.keys():
                raise ValueError(f"its meta item lacks one of {sorted(_META_KEYS)}")
        except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
            raise _unreadable(where, e, fix) from e
        want = to_dict(backend.model_cfg)
        with contextlib.suppress(ConfigError, TypeError):
            # Keys added to ModelConfig since the save read as their defaults.
            meta["model"] = to_dict(from_dict(type(backend.model_cfg), meta["model"]))
        if meta["model"] != want:
            diff = sorted(k for k in set(want) | set(meta["model"])
                          if want.get(k) != meta["model"].get(k))
            raise ConfigError(
                f"checkpoint {self.directory}/{step} was written for a different model: "
                + ", ".join(f"model.{k}={meta['model'].get(k)!r} (now {want.get(k)!r})"
                            for k in diff)
                + "; resume with the checkpoint's model config or use a new run_dir")
        if meta.get("lora") != _lora_record(backend):
            raise ConfigError(
                f"checkpoint {self.directory}/{step} was written with LoRA "
                f"{meta.get('lora')} (trainer.lora_rank/lora_alpha/lora_targets), this run has "
                f"{_lora_record(backend)}; resume with the checkpoint's trainer.lora_* or use a "
                "new run_dir")
        tree = self._tree(backend)
        saved = meta["structure"]
        if "ref" not in tree:  # a Ref saved by a run with a KL term is not needed here
            saved = [s for s in saved if not s.startswith("['ref']")]
        if saved != _structure(tree):
            raise ConfigError(
                f"checkpoint {self.directory}/{step} holds a different train state (optimizer "
                "or parameter layout changed, e.g. trainer.grad_clip/weight_decay/lr_schedule); "
                "resume with the config it was written with or use a new run_dir")
        try:
            target = _abstract(tree)
            if len(saved) != len(meta["structure"]):
                # A Ref this backend does not keep (written with a KL term): read, then dropped.
                target["ref"] = _abstract(backend.state["params"])
            out = self.mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:  # noqa: BLE001 - whatever orbax raises, named in one line
            raise _unreadable(where, e, fix) from e
        backend.state = out["train"]
        if "ref" in tree:
            backend.ref_params = out["ref"]
        if "base" in tree:
            backend.frozen = out["base"]
            backend.ref_params = backend._ref_copy()
        backend.version = int(meta["version"])
        log.info("resumed from %s/%d (version %d)", self.directory, step, backend.version)
        return step, meta["data_state"]

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()
