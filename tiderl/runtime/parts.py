"""The pieces of a run that every site assembles the same way: the per-mode trainer and rollout
configs, the trainer's micro-batcher, and one process's rollout ranks with their weight sync.
Used by the composition root (`tiderl.runtime.job`) and by the hosts of a several-process world
(`tiderl.runtime.hosts`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from tiderl.config import RunConfig
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.weights import serving_weights
from tiderl.train.dispatch import microbatches


def trainer_config_for_mode(cfg: RunConfig):
    """The baselines' trainer settings: stream alternates Ref/Actor per micro-batch,
    async and sync aggregate a whole global batch, tiderl lets RA2P decide."""
    t = cfg.trainer
    mode = cfg.controller.mode
    if mode == "stream":
        return dataclasses.replace(t, aggregate=False)
    return t


def rollout_config_for(cfg: RunConfig, template: Any):
    """The engines' rollout config: `rollout.stop_tokens` are extra stop ids, added to the turn
    template's own (which always end an action)."""
    stops = set(cfg.rollout.stop_tokens) | set(template.stop_ids)
    return dataclasses.replace(cfg.rollout, stop_tokens=tuple(sorted(stops)))


class MicroBatcher:
    """Packs ready sequences; what does not fill a micro-batch waits for the next call."""

    def __init__(self, cfg: RunConfig, n_ranks: int, order: str):
        # ERS changes `n_ranks` (the Actor's data-parallel width) and `order` between steps,
        # when nothing waits here (a step's last call packs everything).
        self.cfg, self.n_ranks, self.order = cfg, n_ranks, order
        self.waiting: list[Any] = []

    def __call__(self, seqs: list[Any], final: bool) -> list[Any]:
        t = self.cfg.trainer
        mbs, self.waiting = microbatches(self.waiting + list(seqs), n_ranks=self.n_ranks,
                                         row_len=t.row_len, rows_per_rank=t.rows_per_rank,
                                         order=self.order, balance=t.balance, final=final)
        return mbs


class WeightPlacer:
    """Exported trainer weights → rollout ranks, device to device: `place(exported, dests)
    -> (per-rank weights, SyncStats)`; a dest is a rank's mesh (its one device or its
    tensor-parallel cell: `weightsync.rank_shardings`) or a device.

    Full weights: one replica, cast to the engines' compute dtype (bf16 runs: half the bytes per
    decode step, same values; serving/weights.py), put on every dest. LoRA (a `LoraExport`):
    the first sync to a dest puts the serving base there (whole weights, once); every sync
    then moves only the adapters and merges W + scale·A·B on the dest's devices
    (`models.lora.merge_lora`: fresh arrays for the adapted weights, the base's for the rest).
    A dest left out of a call drops its base (a cell that left rollout frees its memory).
    The stats count the bytes moved, and `full_bytes` what whole weights would have moved."""

    def __init__(self, model_cfg: Any, abstract: Any, dests: Sequence[Any] = ()):
        self.cfg, self.abstract, self.dests = model_cfg, abstract, list(dests)
        self.bases: dict[Any, Any] = {}

    @staticmethod
    def _target(tree: Any, dest: Any) -> Any:
        from tiderl.runtime.weightsync import rank_shardings

        return dest if isinstance(dest, jax.Device) else rank_shardings(tree, dest)

    def __call__(self, exported: Any, dests: Sequence[Any] | None = None
                 ) -> tuple[list[Any], Any]:
        from tiderl.models.lora import merge_lora
        from tiderl.models.policy import LoraExport
        from tiderl.runtime.weightsync import SyncStats, local_replica, put_local, tree_bytes

        dests = self.dests if dests is None else list(dests)
        if not isinstance(exported, LoraExport):
            trees, stats = put_local(local_replica(serving_weights(exported, self.cfg)),
                                     [self._target(self.abstract, d) for d in dests])
            stats.full_bytes = stats.local_bytes
            return trees, stats
        self.bases = {d: b for d, b in self.bases.items() if d in dests}
        new = [d for d in dests if d not in self.bases]
        stats = SyncStats()
        if new:  # once per dest: the serving base
            bases, stats = put_local(local_replica(exported.serving_base()),
                                     [self._target(self.abstract, d) for d in new])
            self.bases.update(zip(new, bases, strict=True))
        ads, moved = put_local(local_replica(exported.adapters),
                               [self._target(exported.adapters, d) for d in dests])
        stats.add(moved)
        trees = [merge_lora(self.bases[d], a, exported.scale)
                 for d, a in zip(dests, ads, strict=True)]
        stats.full_bytes = sum(tree_bytes(t) for t in trees)  # in the engines' dtype
        return trees, stats


async def local_ranks(cfg: RunConfig, trainer: Any, graphdef: Any, meshes: dict,
                      rcfg: Any) -> tuple[list[RolloutRank], Any]:
    """One process's rollout ranks, an engine each on its device or tensor-parallel cell
    (`rollout.devices_per_rank`), and the sync hook: one trainer replica resharded into each
    rank's layout device to device (`tiderl.runtime.weightsync`), off the event loop so env I/O keeps
    flowing; it returns the sync's bytes and GB/s for the step's record."""
    place = WeightPlacer(cfg.model, trainer.serving_abstract, meshes["rollout"])
    first, _ = await asyncio.to_thread(place, await trainer.export_weights_async())
    engines = [Engine(graphdef, w, cfg.model, rcfg, seed=cfg.seed, version=trainer.version)
               for w in first]
    ranks = [RolloutRank(i, e, max_prefills_per_step=min(rcfg.prefill_batch, rcfg.max_slots),
                         share_prefixes=rcfg.share_prefixes)
             for i, e in enumerate(engines)]

    async def sync_weights(exported: Any, version: int) -> dict:
        trees, stats = await asyncio.to_thread(place, exported)
        await asyncio.gather(*(r.update_weights(t, version)
                               for r, t in zip(ranks, trees, strict=True)))
        return stats.metrics()

    return ranks, sync_weights
