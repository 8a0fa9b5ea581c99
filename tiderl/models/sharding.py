"""Logical axis names → mesh axes, in one table (MaxText's `logical_axis_rules`).

Model code names axes ("embed", "mlp", "heads", ...); `LOGICAL_RULES` maps them onto the mesh
axes `("data", "fsdp", "model")`. Shardings of the train state are computed once from the
abstract state and pinned as jit in/out shardings, optimizer moments included (otherwise they come
out replicated).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "model")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),  # the stacked layer axis (model.scan_layers): every device holds all
)


def make_mesh(devices: Sequence[jax.Device], *, data: int = 1, fsdp: int = 1,
              model: int = 1) -> Mesh:
    """A ("data", "fsdp", "model") mesh over exactly `devices`."""
    if data * fsdp * model != len(devices):
        raise ValueError(
            f"mesh data={data} × fsdp={fsdp} × model={model} = {data * fsdp * model} does not "
            f"match the {len(devices)} devices of this role; change the role's mesh axes"
        )
    arr = np.asarray(devices, dtype=object).reshape(data, fsdp, model)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> PartitionSpec:
    """Maps logical names to a PartitionSpec; drops a mesh axis that does not divide the dim."""
    if not names:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    out: list[Any] = []
    for name, dim in zip(names, shape, strict=True):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        keep = []
        size = 1
        for ax in axes:
            n = mesh.shape.get(ax, 1)
            if ax in used or n == 1:
                continue
            if dim % (size * n):
                log.warning("logical axis %r (dim %d) not divisible by mesh axis %r (%d); "
                            "replicating that dim", name, dim, ax, n)
                continue
            keep.append(ax)
            size *= n
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """NamedShardings for an (abstract) nnx.State, from each Variable's `sharding` metadata."""

    def one(x: Any) -> Any:
        if _is_var(x):
            names = x.get_metadata().get("out_sharding")
            return x.replace(NamedSharding(mesh, logical_to_spec(names, x.shape, mesh)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, abstract_state, is_leaf=_is_var)


def optimizer_shardings(tx: optax.GradientTransformation, abstract_params: Any,
                        param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of `tx.init(params)`: moments follow their parameter, the rest replicated.
    A parameter the optimizer masks out (`optax.MaskedNode`: no state) stays masked."""
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return optax.tree_map_params(
        tx, lambda x, s: x if masked(x) else s, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=masked,
    )
