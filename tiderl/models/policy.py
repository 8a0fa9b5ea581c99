"""The Policy protocol users implement, and building/initialising a policy from config."""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx
from jax.sharding import Mesh

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.decoder import AttentionCache, Decoder
from tiderl.models.sharding import state_shardings


@runtime_checkable
class Policy(Protocol):
    """A policy is an `nnx.Module` with this call; `cache=None` is the packed training path.

    A policy class that cannot serve grouped-query attention (its k/v have as many heads as q)
    declares `supports_gqa = False`; launch then rejects `model.n_kv_heads != model.n_heads`
    before any work. Without the attribute a policy is taken to follow `model.n_kv_heads`.
    """

    def __call__(self, tokens, positions, segment_ids, *,
                 cache: AttentionCache | None = None) -> tuple[Any, AttentionCache | None]: ...


def policy_class(cfg: ModelConfig) -> type[nnx.Module]:
    """Resolves `model.policy`: 'decoder' or 'package.module:Class'."""
    if cfg.policy == "decoder":
        return Decoder
    module_name, _, attr = cfg.policy.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"config key 'model.policy'={cfg.policy!r}: cannot import {module_name!r} ({e}); "
            "make the module importable (installed or on PYTHONPATH)"
        ) from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise ConfigError(
            f"config key 'model.policy'={cfg.policy!r}: {attr!r} is not an nnx.Module class "
            f"in {module_name}"
        )
    return cls


def check_policy(cfg: ModelConfig) -> type[nnx.Module]:
    """Resolves `model.policy` and checks `cfg` against what the class declares it supports
    (`supports_gqa`); a `ConfigError` naming the key otherwise. Launch calls it before any
    work: resolving imports the user's module."""
    cls = policy_class(cfg)
    if cfg.n_kv_heads != cfg.n_heads and not getattr(cls, "supports_gqa", True):
        raise ConfigError(
            f"config key 'model.n_kv_heads'={cfg.n_kv_heads}: policy {cfg.policy!r} does not "
            f"support grouped-query attention (supports_gqa = False); set model.n_kv_heads="
            f"{cfg.n_heads} (= model.n_heads)")
    return cls


def build_policy(cfg: ModelConfig, *, seed: int = 0) -> nnx.Module:
    """Creates the policy module eagerly on the default device (small models, tests)."""
    return policy_class(cfg)(cfg, rngs=nnx.Rngs(params=seed))


def init_policy(cfg: ModelConfig, *, seed: int = 0,
                mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) with params created directly in their shardings on `mesh`.

    Initialisation runs under jit with pinned out_shardings computed from the abstract state,
    so no device ever holds an unsharded copy.
    """
    cls = policy_class(cfg)

    def create() -> nnx.State:
        return nnx.split(cls(cfg, rngs=nnx.Rngs(params=seed)))[1]

    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=seed)))
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is None:
        return graphdef, jax.jit(create)()
    shardings = state_shardings(abstract_state, mesh)
    return graphdef, jax.jit(create, out_shardings=shardings)()
