"""The Policy protocol users implement, and building/initialising a policy from config."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.decoder import AttentionCache, Decoder
from tiderl.models.lora import LoraSpec, merge_lora, unstack_adapters
from tiderl.models.sharding import state_shardings
from tiderl.models.vlm import VisionLanguageModel


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
    """Resolves `model.policy`: 'decoder' or 'package.module:Class'. The built-in decoder with
    `model.vision` set is the vision-language policy (models/vlm.py)."""
    if cfg.policy == "decoder":
        return Decoder if cfg.vision is None else VisionLanguageModel
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


def abstract_policy(cfg: ModelConfig, *, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract params): shapes, dtypes and sharding names, no arrays."""
    cls = policy_class(cfg)
    return nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=seed))))


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


def convert_layout(params: nnx.State, cfg: ModelConfig, *, scan_layers: bool) -> nnx.State:
    """The built-in decoder's params (of `cfg`'s layout) in the per-layer (`scan_layers=False`)
    or stacked layout, with the target layout's variable metadata (logical axis names).

    Pure tree operations: runs eagerly or under jit. Identity when the layouts already agree.
    """
    if cfg.policy != "decoder" or cfg.scan_layers == scan_layers:
        return params
    target = dataclasses.replace(cfg, scan_layers=scan_layers)
    src = dict(nnx.to_flat_state(params))
    out = []
    for path, var in nnx.to_flat_state(abstract_policy(target)[1]):
        if path[0] != "layers":
            value = src[path][...]
        elif scan_layers:  # ('layers', *rest) ← ('layers', i, *rest) for every i
            value = jnp.stack([src[("layers", i, *path[1:])][...]
                               for i in range(cfg.n_layers)])
        else:  # ('layers', i, *rest) ← ('layers', *rest)[i]
            value = src[("layers", *path[2:])][...][path[1]]
        out.append((path, var.replace(value)))
    return nnx.from_flat_state(out)


def serving_config(cfg: ModelConfig) -> ModelConfig:
    """The config of the policy the engines run: the built-in decoder per layer (the serving
    path indexes layers one by one to hand their k/v to the cache)."""
    return dataclasses.replace(cfg, scan_layers=False) if cfg.policy == "decoder" else cfg


def serving_params(params: nnx.State, cfg: ModelConfig) -> nnx.State:
    """Fresh serving weights from training params: per-layer layout, and under bf16 compute the
    built-in decoder's matrices and biases (ndim ≥ 2) in the compute dtype, as the decoder
    casts them anyway (identical logits, half the bytes to sync and to read per decode step).
    1-D parameters (RMSNorm scales, applied in fp32) keep their dtype. Custom policies: a copy.
    Jit it (the trainer does): the output never aliases the input."""
    from tiderl.models.decoder import DTYPES

    if cfg.policy != "decoder":
        return jax.tree.map(jnp.copy, params)
    cd = DTYPES[cfg.compute_dtype]
    per_layer = convert_layout(params, cfg, scan_layers=False)
    return jax.tree.map(lambda x: x.astype(cd) if x.ndim >= 2 else jnp.copy(x), per_layer)


def _lora_module(cfg: ModelConfig, spec: LoraSpec, seed: int) -> Decoder:
    if cfg.policy != "decoder":
        raise ConfigError(f"config key 'trainer.lora_rank'={spec.rank} needs the built-in "
                          f"decoder, not model.policy={cfg.policy!r}; set trainer.lora_rank=0")
    # The base draws from 'params' exactly as without LoRA; the adapters from 'lora'. A
    # vision-language policy gets adapters on its language model only.
    return policy_class(cfg)(cfg, rngs=nnx.Rngs(params=seed, lora=seed + 1), lora=spec)


def lora_policy(cfg: ModelConfig, spec: LoraSpec, *, seed: int = 0, mesh: Mesh | None = None,
                ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef of the decoder with adapters, fresh adapters, abstract base): the adapters
    (`nnx.LoRAParam`) created directly in their shardings on `mesh`; merge the graphdef with
    (adapters, base params of the plain decoder of `cfg`: same paths)."""
    graphdef, abstract_adapters, abstract_base = nnx.split(
        nnx.eval_shape(lambda: _lora_module(cfg, spec, seed)), nnx.LoRAParam, ...)

    def create() -> nnx.State:  # the base's initialisation is dead code: XLA drops it
        return nnx.split(_lora_module(cfg, spec, seed), nnx.LoRAParam, ...)[1]

    out = None if mesh is None else state_shardings(abstract_adapters, mesh)
    return graphdef, jax.jit(create, out_shardings=out)(), abstract_base


def abstract_lora(cfg: ModelConfig, spec: LoraSpec) -> nnx.State:
    """The adapters' abstract state (shapes, dtypes, sharding names) for `cfg`'s layout."""
    return nnx.split(nnx.eval_shape(lambda: _lora_module(cfg, spec, 0)), nnx.LoRAParam, ...)[1]


def serving_adapters(adapters: nnx.State, cfg: ModelConfig, spec: LoraSpec) -> nnx.State:
    """Adapters in the engines' per-layer layout (fresh arrays; jit it, as `serving_params`)."""
    if not cfg.scan_layers:
        return jax.tree.map(jnp.copy, adapters)
    return unstack_adapters(adapters, abstract_lora(serving_config(cfg), spec))


@dataclasses.dataclass
class LoraExport:
    """What a LoRA trainer exports at a sync: the adapters in the engines' per-layer layout
    (fresh copies: the next update donates the trainer's) and the frozen base they apply to
    (the trainer's own arrays, never updated). `full()` gives merged serving weights (a rank
    that starts, or any path that moves whole weights); the site's sync moves `adapters` only
    and merges on each rollout device over a `serving_base()` kept there
    (`tiderl.runtime.parts`)."""

    adapters: nnx.State
    base: nnx.State
    scale: float
    cfg: ModelConfig

    def serving_base(self) -> nnx.State:
        """The base in the engines' layout and dtype (a fresh tree, `serving_params`)."""
        return _serving_jit(self.cfg)(self.base)

    def full(self) -> nnx.State:
        """Merged serving weights: W + scale·A·B over the serving base."""
        return merge_lora(self.serving_base(), self.adapters, self.scale)


@functools.lru_cache(maxsize=8)
def _serving_jit(cfg: ModelConfig) -> Any:
    return jax.jit(functools.partial(serving_params, cfg=cfg))


class _ProbeCache:
    """Wraps the serving cache to see what a policy hands it: which layers, and k/v shapes."""

    def __init__(self, inner: Any, cfg: ModelConfig):
        self.inner, self.cfg, self.layers = inner, cfg, []

    def attend(self, layer, q_bthd, k_btkd, v_btkd):
        want = (self.cfg.n_kv_heads, self.cfg.head_dim)
        if not isinstance(layer, int) or not 0 <= layer < self.cfg.n_layers:
            raise _ContractError(f"cache.attend got layer={layer!r}; layers are the ints "
                                 f"0..{self.cfg.n_layers - 1} (model.n_layers)")
        for name, x in (("k", k_btkd), ("v", v_btkd)):
            if tuple(x.shape[2:]) != want or x.shape[:2] != q_bthd.shape[:2]:
                raise _ContractError(
                    f"cache.attend(layer={layer}) got {name} of shape {tuple(x.shape)}; it takes "
                    f"[batch, time, model.n_kv_heads={want[0]}, model.head_dim={want[1]}] "
                    f"(q is {tuple(q_bthd.shape)})")
        self.layers.append(layer)
        out, self.inner = self.inner.attend(layer, q_bthd, k_btkd, v_btkd)
        return out, self


class _ContractError(Exception):
    """A contract check inside the traced call; `check_contract` reports it as a ConfigError."""


def check_contract(graphdef: nnx.GraphDef, params: nnx.State, cfg: ModelConfig) -> None:
    """Traces the policy once on each path (shapes only, nothing runs) and raises a
    `ConfigError` naming `model.policy` when it breaks the contract the trainer and the engine
    rely on: `(tokens, positions, segment_ids) -> (logits [B, T, vocab], cache)`, and on the
    serving path every layer hands its k/v (`model.n_kv_heads` heads) to `cache.attend`."""
    import jax.numpy as jnp

    from tiderl.serving.kv import PagedKV, init_pools

    b, t, v = 2, 8, cfg.vocab_size
    rule = ("a policy is called as policy(tokens, positions, segment_ids, cache=None) and returns "
            "(logits [batch, time, model.vocab_size], cache); with a cache it hands each layer's "
            "q/k/v to cache.attend(layer, q, k, v) and returns the cache attend gave back")

    def fail(path: str, why: Any) -> ConfigError:
        return ConfigError(f"config key 'model.policy'={cfg.policy!r} does not meet the policy "
                           f"contract on the {path} path: {why}; {rule}")

    def logits_of(out: Any, path: str) -> Any:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise fail(path, f"it returned {type(out).__name__}, not (logits, cache)")
        shape = getattr(out[0], "shape", None)
        if shape is None or tuple(shape) != (b, t, v):
            raise fail(path, f"logits have shape {shape}, expected {(b, t, v)}")
        return out

    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def train(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens))

    try:
        logits_of(jax.eval_shape(train, params, tokens), "training")
    except (ConfigError, _ContractError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: any error is a contract problem
        raise fail("training", f"{type(e).__name__}: {e}") from e

    pools = jax.eval_shape(lambda: init_pools(
        n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, num_pages=2,
        page_size=t, dtype=jnp.float32))
    probe: list[_ProbeCache] = []

    def serve(params, tokens, pools):
        cache = _ProbeCache(PagedKV(pools, jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32),
                                    jnp.full((b,), t, jnp.int32)), cfg)
        probe.append(cache)
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        out = nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens), cache=cache)
        logits_of(out, "serving")
        return out[0]

    try:
        jax.eval_shape(serve, params, tokens, pools)
    except ConfigError:
        raise
    except _ContractError as e:
        raise fail("serving", e) from e
    except Exception as e:  # noqa: BLE001
        raise fail("serving", f"{type(e).__name__}: {e}") from e
    if not probe[0].layers:
        raise fail("serving", "it never called cache.attend, so the engine cannot keep its KV")
