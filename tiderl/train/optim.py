"""The Actor's optimizer: global-norm clipping, AdamW under a warmup + constant/cosine
schedule, frozen and differently-scaled parameter groups, and the schedule's update count.

`tiderl.train.ref_actor` builds its apply kernel on `make_optimizer` and re-exports these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tiderl.train.config import TrainerConfig


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` (same state, same rule) scaling by one precomputed factor.

    optax divides every element by the norm; XLA treats a divide as too costly to recompute in
    each consumer, so the clipped gradient was materialised: one more gradient-sized buffer in
    the update. A multiply is recomputed inside the moment updates instead. (The factor is
    rounded once, so results may differ from optax's in the last bit when clipping.)"""

    def update_fn(updates, state, params=None):
        del params
        g_norm = optax.tree.norm(updates)
        scale = jnp.float32(max_norm) / g_norm
        clip = g_norm >= max_norm
        return jax.tree.map(lambda t: jnp.where(clip, t * scale.astype(t.dtype), t),
                            updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: TrainerConfig, frozen: tuple[str, ...] = (),
                   scaled: tuple[tuple[str, float], ...] = ()) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW under a warmup + constant/cosine schedule.

    `frozen`: top-level parameter names (e.g. "visual", a frozen vision tower) that get no
    update at all and no optimizer state: AdamW's weight decay would otherwise shrink them
    even with a zero gradient. `scaled`: (top-level name, factor) pairs whose AdamW runs at the
    schedule × factor (`trainer.vision_lr_scale`); the clip stays global."""
    parts = [clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
    schedule = make_schedule(cfg)

    def adamw(factor: float = 1.0) -> optax.GradientTransformation:
        lr = schedule if factor == 1.0 else (lambda step: factor * schedule(step))
        return optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                           weight_decay=cfg.weight_decay)

    if frozen or scaled:
        groups = {"train": adamw(), "frozen": optax.set_to_zero(),
                  **{f"scaled:{name}": adamw(f) for name, f in scaled}}
        parts.append(optax.multi_transform(
            groups, lambda params: frozen_labels(params, frozen, dict(scaled))))
    else:
        parts.append(adamw())
    return optax.chain(*parts)


def frozen_labels(params: Any, frozen: tuple[str, ...],
                  scaled: dict[str, float] | None = None) -> Any:
    """"frozen" on every leaf under a top-level name in `frozen`, "scaled:NAME" under one in
    `scaled`, "train" elsewhere."""

    def label(path: tuple, _: Any) -> str:
        top = path[0]
        name = getattr(top, "key", getattr(top, "name", None))
        if name in frozen:
            return "frozen"
        return f"scaled:{name}" if scaled and name in scaled else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def param_groups(model: Any, cfg: TrainerConfig, lora: bool = False
                 ) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...]]:
    """`make_optimizer`'s (frozen, scaled) for a policy: the vision tower frozen under
    `model.train_vision=false`, at `trainer.vision_lr_scale` otherwise (under LoRA the trained
    params are the adapters: neither)."""
    if lora or model.vision is None:
        return (), ()
    if not model.train_vision:
        return ("visual",), ()
    scale = cfg.vision_lr_scale
    return (), ((("visual", scale),) if scale != 1.0 else ())


def make_schedule(cfg: TrainerConfig) -> optax.Schedule:
    """The learning rate as a function of applied updates (warmup, then constant or cosine)."""
    if cfg.lr_schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0 if cfg.warmup_steps else cfg.lr, cfg.lr, max(cfg.warmup_steps, 0),
            cfg.warmup_steps + cfg.decay_steps, end_value=0.0)
    elif cfg.warmup_steps:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps])
    else:
        sched = optax.constant_schedule(cfg.lr)
    return sched


def schedule_count(opt_state: Any) -> int:
    """Updates applied so far, as the optimizer's schedule counts them (skipped ones not)."""
    for leaf in jax.tree.leaves(opt_state,
                                is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)):
        if isinstance(leaf, optax.ScaleByScheduleState):
            return int(jax.device_get(leaf.count))
    raise ValueError("optimizer state has no schedule count (not built by make_optimizer)")
