"""Jitted Ref forward, Actor forward (returning its `jax.vjp`), deferred backward, optimizer apply.

Everything here is a factory closing over static things (graphdef, temperature, loss spec,
optimizer, shardings) and returning module-level-style jitted pure functions of pytrees:

- `ref_forward(ref_params, batch) -> ref_logprobs_bt`
- `actor_forward(params, batch, frozen=None) -> ((logprobs_bt, entropy_bt), vjp)`: the
  `jax.vjp` object is a pytree (residuals + a static jaxpr), so it leaves the jit and waits
  for the Ref logprobs. Its cotangent is a (logprobs, entropies) pair too (see grpo.py: the exact entropy bonus).
  The vjp (a `DeferredVjp`) refers to the params it was taken at instead of holding a copy.
- `backward(vjp, outs, ref_logprobs_bt, batch, version, grads_acc) -> (grads_acc, metrics)`:
  cotangent from grpo.cotangent, `vjp(cotangent)`, accumulated into the donated sum (None for
  the step's first micro-batch: no zero-filled sum).
  `actor_backward(vjp, cotangent) -> grads` is the bare contract form.
- `scale_grads(grads_sum, denom) -> (grads, grad_norm)`: divides once by the step normaliser,
  in place; `apply(state, grads) -> state`: clips by global norm, AdamW with a schedule, every
  leaf updated in place (the train state is donated); `skip(state) -> state` counts a step
  whose gradient is not finite (the host decides from grad_norm).

The train state is `{"params", "opt", "step"}`; its shardings (optimizer moments included) are
computed once from the abstract state and pinned as in/out shardings.

With LoRA (`trainer.lora_rank` > 0) `params` are the adapters alone (`nnx.LoRAParam`: the only
leaves with gradients and optimizer moments) and `frozen` is the base (pinned shardings of its
own, never updated); the policy is `nnx.merge(graphdef, params, frozen)`. The Ref is the base
without adapters (`ref_graphdef`, the plain decoder's). Full fine-tuning passes `frozen=None`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tiderl.models.sharding import optimizer_shardings, state_shardings
from tiderl.train.grpo import LossSpec, cotangent, loss_sum, token_logprobs, token_outputs
from tiderl.train.head import chunked_token_outputs
from tiderl.train.optim import (  # noqa: F401 (re-exported: the optimizer's home was here)
    clip_by_global_norm,
    frozen_labels,
    make_optimizer,
    make_schedule,
    param_groups,
    schedule_count,
)

BATCH_KEYS = ("tokens_bt", "positions_bt", "segment_ids_bt", "loss_mask_bt",
              "behaviour_logprobs_bt", "advantages_bt", "versions_bt")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over every data-parallel axis of `mesh` (the logical 'batch' rule)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))


def dp_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: training logprobs need T > 0; greedy "
                         "rollouts (rollout.temperature=0) cannot be trained with GRPO")


def _merge(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None) -> Any:
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def _images_kw(batch: dict) -> dict:
    """The policy call's `images=` when the batch has images (vision-language policies; text
    policies are never passed the keyword)."""
    return {"images": batch["images"]} if batch.get("images") is not None else {}


def _split_images(batch: dict) -> tuple[dict, Any]:
    """(the batch's row-sharded arrays, its images or None): the images are replicated, so
    they enter the jitted functions as an argument of their own."""
    if "images" not in batch:
        return batch, None
    rest = dict(batch)
    return rest, rest.pop("images")


def _join_images(batch: dict, images: Any) -> dict:
    return batch if images is None else {**batch, "images": images}


def _forward(graphdef: nnx.GraphDef, temperature: float, head_chunk: int, remat: bool,
             token_chunk: int = 0, remat_group: int = 1):
    """params, batch -> (logprobs, entropies): through the policy's `hidden_states` + chunked
    head when `head_chunk` > 0, `remat` or `token_chunk` > 0 asks for it and the policy
    has them (the built-in Decoder), else through its logits (custom policies)."""

    def forward(params: nnx.State, batch: dict,
                frozen: nnx.State | None = None) -> tuple[jax.Array, jax.Array]:
        model = _merge(graphdef, params, frozen)
        tokens = batch["tokens_bt"]
        has_hidden = hasattr(model, "hidden_states") and hasattr(model, "head_vd")
        if remat and not has_hidden:
            raise ValueError(f"trainer.remat=true but policy {type(model).__name__} has no "
                             "hidden_states(..., remat=) method; set trainer.remat=false")
        if has_hidden and (head_chunk > 0 or remat or token_chunk > 0):
            kw = {"token_chunk": token_chunk} if token_chunk > 0 else {}
            if remat and remat_group > 1:
                kw["remat_group"] = remat_group
            kw.update(_images_kw(batch))
            h_btd, _ = model.hidden_states(tokens, batch["positions_bt"],
                                           batch["segment_ids_bt"], remat=remat, **kw)
            if head_chunk > 0:
                return chunked_token_outputs(h_btd, model.head_vd(), tokens, temperature,
                                             head_chunk)
            return token_outputs(model.logits(h_btd), tokens, temperature)
        logits, _ = model(tokens, batch["positions_bt"], batch["segment_ids_bt"],
                          **_images_kw(batch))
        return token_outputs(logits, tokens, temperature)

    return forward


def make_logprobs(graphdef: nnx.GraphDef, temperature: float, *, head_chunk: int = 0,
                  token_chunk: int = 0):
    """params, batch -> per-token logprobs at the engine's temperature (fp32).

    `head_chunk` > 0 applies the vocab head that many tokens at a time (train/head.py);
    `token_chunk` > 0 attends that many queries at a time (built-in decoder)."""
    _check_temperature(temperature)
    if head_chunk <= 0 and token_chunk <= 0:
        def logprobs(params: nnx.State, batch: dict, frozen: nnx.State | None = None
                     ) -> jax.Array:
            model = _merge(graphdef, params, frozen)
            logits, _ = model(batch["tokens_bt"], batch["positions_bt"], batch["segment_ids_bt"],
                              **_images_kw(batch))
            return token_logprobs(logits, batch["tokens_bt"], temperature)

        return logprobs
    forward = _forward(graphdef, temperature, head_chunk, False, token_chunk)
    return lambda params, batch, frozen=None: forward(params, batch, frozen)[0]


def make_outputs(graphdef: nnx.GraphDef, temperature: float, entropy_grad: bool = True, *,
                 head_chunk: int = 0, remat: bool = False, token_chunk: int = 0,
                 remat_group: int = 1):
    """params, batch -> (per-token logprobs, per-token entropies): what the Actor differentiates.

    Without an entropy bonus (`entropy_grad=False`) the entropies are only a metric: behind
    `stop_gradient` they add no B×T×V residual to the saved vjp. `head_chunk` > 0 applies the
    head in token chunks with a recomputing backward (no B×T×V residual at all); `remat`
    recomputes each decoder block in the backward (policies with `hidden_states` only);
    `token_chunk` > 0 attends that many queries at a time, each chunk's scores recomputed
    in the backward (built-in decoder); `remat_group` > 1 with scanned layers keeps only every
    that-many-th block input (`decoder.scan_remat`)."""
    _check_temperature(temperature)
    forward = _forward(graphdef, temperature, head_chunk, remat, token_chunk, remat_group)

    def outputs(params: nnx.State, batch: dict,
                frozen: nnx.State | None = None) -> tuple[jax.Array, jax.Array]:
        logp, ent = forward(params, batch, frozen)
        return logp, ent if entropy_grad else jax.lax.stop_gradient(ent)

    return outputs


@dataclasses.dataclass(frozen=True)
class TrainShardings:
    """Pinned shardings of the Actor train state and of its gradient sum."""

    state: Any
    params: Any
    batch: NamedSharding
    tokens: NamedSharding
    frozen: Any = None
    """The frozen base's shardings under LoRA (None: full fine-tuning)."""


def train_shardings(abstract_params: Any, tx: optax.GradientTransformation,
                    mesh: Mesh, abstract_frozen: Any = None) -> TrainShardings:
    params = state_shardings(abstract_params, mesh)
    opt = optimizer_shardings(tx, abstract_params, params, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    frozen = None if abstract_frozen is None else state_shardings(abstract_frozen, mesh)
    return TrainShardings({"params": params, "opt": opt, "step": replicated}, params,
                          batch_sharding(mesh), batch_sharding(mesh), frozen)


def init_train_state(params: nnx.State, tx: optax.GradientTransformation,
                     sh: TrainShardings) -> dict:
    """{"params", "opt", "step"} with the optimizer state created in its pinned shardings."""
    make = jax.jit(lambda p: {"params": p, "opt": tx.init(p), "step": jnp.zeros((), jnp.int32)},
                   in_shardings=(sh.params,), out_shardings=sh.state)
    return make(params)


@jax.tree_util.register_pytree_node_class
class DeferredVjp:
    """`jax.vjp` of params → outputs, without its residuals that *are* the params.

    A `jax.vjp` object returned from a jit holds every residual as a fresh output buffer, the
    parameters included (they are residuals of every matmul): one more copy of the weights
    would live from each Actor forward to its backward. Here those slots are left empty inside
    the jit and filled, outside it, with the caller's own param arrays (no copy); the params
    must not change before the backward (the backend applies updates only after every
    micro-batch's backward). Calling it is calling the vjp.
    """

    def __init__(self, treedef: Any, slots: tuple[int, ...], residuals: tuple,
                 params: tuple = ()):
        self.treedef, self.slots = treedef, slots
        self.residuals, self.params = residuals, params

    @classmethod
    def strip(cls, vjp: Any, params: Any) -> DeferredVjp:
        """Inside the trace: residual leaves identical to a param leaf become slot indices."""
        leaves, treedef = jax.tree.flatten(vjp)
        index = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
        slots, residuals = [], []
        for leaf in leaves:
            if id(leaf) in index:
                slots.append(index[id(leaf)])
            else:
                slots.append(-1)
                residuals.append(leaf)
        return cls(treedef, tuple(slots), tuple(residuals))

    def with_params(self, params: Any) -> DeferredVjp:
        return DeferredVjp(self.treedef, self.slots, self.residuals,
                           tuple(jax.tree.leaves(params)))

    def __call__(self, cot: Any) -> Any:
        res = iter(self.residuals)
        leaves = [next(res) if i < 0 else self.params[i] for i in self.slots]
        return jax.tree.unflatten(self.treedef, leaves)(cot)

    def tree_flatten(self):
        return (self.residuals, self.params), (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], *children)


@dataclasses.dataclass
class Kernels:
    """The jitted functions of one (graphdef, mesh) pair; `traces` counts retraces per name."""

    ref_forward: Any
    logprobs: Any
    actor_forward: Any
    backward: Any
    actor_backward: Any
    scale_grads: Any
    apply: Any
    skip: Any
    zeros_like_grads: Any
    fused_grads: Any
    fused_accumulate: Any
    traces: dict[str, int]


class _Traces(dict):
    """Traces per kernel name; `count(name)` runs at trace time only."""

    def count(self, name: str) -> None:
        self[name] = self.get(name, 0) + 1


def _forward_kernels(logprobs: Any, outputs: Any, sh: TrainShardings, traces: _Traces,
                     ref_mesh: Mesh | None, ref_param_shardings: Any,
                     ref_logprobs: Any) -> tuple[Any, Any, Any]:
    """(ref_forward, logprobs, actor_forward): the Ref and policy logprobs, and the Actor
    forward returning its `DeferredVjp`."""

    # A batch's images (vision-language policies) are replicated, not row-sharded: they are
    # split off into an argument of their own (None without images).
    actor_replicated = NamedSharding(sh.batch.mesh, PartitionSpec())

    def ref_fwd(ref_params, batch, images):
        traces.count("ref_forward")
        return ref_logprobs(ref_params, _join_images(batch, images))

    ref_tokens = batch_sharding(ref_mesh) if ref_mesh is not None else sh.tokens
    ref_forward_jit = jax.jit(
        ref_fwd, in_shardings=(ref_param_shardings if ref_param_shardings is not None
                               else sh.params, ref_tokens,
                               NamedSharding(ref_tokens.mesh, PartitionSpec())),
        out_shardings=ref_tokens)

    def ref_forward(ref_params, batch):
        return ref_forward_jit(ref_params, *_split_images(batch))

    def policy_logprobs(params, batch, images, frozen):
        traces.count("logprobs")
        return logprobs(params, _join_images(batch, images), frozen)

    policy_lp_jit = jax.jit(policy_logprobs, in_shardings=(sh.params, sh.batch, actor_replicated,
                                                           sh.frozen), out_shardings=sh.tokens)

    def policy_lp(params, batch, frozen=None):
        return policy_lp_jit(params, *_split_images(batch), frozen)

    def actor_fwd(params, batch, images, frozen):
        traces.count("actor_forward")
        batch = _join_images(batch, images)
        # Gradients w.r.t. `params` only (the adapters under LoRA); the frozen base's arrays
        # are residuals like the params', so the vjp refers to them in place too.
        outs, vjp = jax.vjp(lambda p: outputs(p, batch, frozen), params)
        return outs, DeferredVjp.strip(vjp, (params, frozen))

    actor_forward_jit = jax.jit(actor_fwd, in_shardings=(sh.params, sh.batch, actor_replicated,
                                                         sh.frozen))

    def actor_forward(params, batch, frozen=None):
        outs, vjp = actor_forward_jit(params, *_split_images(batch), frozen)
        return outs, vjp.with_params((params, frozen))

    return ref_forward, policy_lp, actor_forward


def _backward_kernels(spec: LossSpec, sh: TrainShardings, traces: _Traces) -> tuple[Any, Any]:
    """(backward, actor_backward): the deferred backward from the GRPO cotangent, accumulated
    into the donated sum, and the bare `vjp(cotangent)` contract form."""

    def bwd(vjp, outs, ref_logp, batch, version, acc):
        traces.count("backward")
        cot, metrics = cotangent(outs, ref_logp, batch, version, spec)
        (g,) = vjp(cot)
        # acc None: the step's first micro-batch, no zero-filled sum to add to.
        return (g if acc is None else jax.tree.map(jnp.add, acc, g)), metrics

    # Only the gradient sum is donated: the vjp residuals have no output of their shape to alias.
    backward = jax.jit(bwd, donate_argnums=(5,), out_shardings=(sh.params, None))

    def bare_bwd(vjp, cot):
        traces.count("actor_backward")
        return vjp(cot)[0]

    return backward, jax.jit(bare_bwd, out_shardings=sh.params)


def _update_kernels(tx: optax.GradientTransformation, sh: TrainShardings,
                    traces: _Traces) -> tuple[Any, Any, Any, Any]:
    """(scale_grads, apply, skip, zeros_like_grads): the step's normalisation and update."""

    def scale(grads_sum, denom):
        grads = jax.tree.map(lambda g: g / denom, grads_sum)
        return grads, optax.tree.norm(grads)

    # In place (the sum is donated and aliased): no second gradient-sized buffer.
    scale_grads = jax.jit(scale, in_shardings=(sh.params, None), out_shardings=(sh.params, None),
                          donate_argnums=(0,))

    def apply_fn(state, grads):
        traces.count("apply")
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
                "step": state["step"] + 1}

    # Every leaf's params and moments are updated in place (the state is donated; the clip
    # multiplies, so nothing gradient-sized is materialised: XLA's own count is 0 bytes of
    # temporaries). A non-finite gradient is the host's decision (`skip` instead): a
    # lax.cond here kept a copy of the largest parameter's state in the temporaries.
    apply = jax.jit(apply_fn, in_shardings=(sh.state, sh.params), out_shardings=sh.state,
                    donate_argnums=(0,))
    skip = jax.jit(lambda state: {**state, "step": state["step"] + 1}, in_shardings=(sh.state,),
                   out_shardings=sh.state, donate_argnums=(0,))
    zeros_like_grads = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p),
                               in_shardings=(sh.params,), out_shardings=sh.params)
    return scale_grads, apply, skip, zeros_like_grads


def _fused_kernels(outputs: Any, spec: LossSpec, sh: TrainShardings,
                   traces: _Traces) -> tuple[Any, Any]:
    """(fused_grads, fused_accumulate): the reference paths, `jax.grad` of the fused loss."""

    def fused(params, batches, refs, version, frozen=None):
        """The reference path: one `jax.grad` through the whole loss, summed over batches."""
        traces.count("fused")

        def total(p):
            out = 0.0
            for b, r in zip(batches, refs, strict=True):
                out = out + loss_sum(outputs(p, b, frozen), r, b, version, spec)[0]
            return out

        return jax.grad(total)(params)

    fused_grads = jax.jit(fused, out_shardings=sh.params)

    def fused_acc(params, batch, ref, version, acc, frozen=None):
        """The plain streaming step per micro-batch: `jax.grad` of the fused loss, accumulated."""
        traces.count("fused_accumulate")
        g, metrics = jax.grad(lambda p: loss_sum(outputs(p, batch, frozen), ref, batch, version,
                                                 spec), has_aux=True)(params)
        return jax.tree.map(jnp.add, acc, g), metrics

    fused_accumulate = jax.jit(fused_acc, donate_argnums=(4,), out_shardings=(sh.params, None))
    return fused_grads, fused_accumulate


def make_kernels(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, spec: LossSpec,
                 temperature: float, sh: TrainShardings,
                 ref_mesh: Mesh | None = None, ref_param_shardings: Any = None, *,
                 head_chunk: int = 0, remat: bool = False, token_chunk: int = 0,
                 remat_group: int = 1, ref_graphdef: nnx.GraphDef | None = None) -> Kernels:
    """Builds all jitted step functions for the Actor mesh (and the Ref's, when separate).

    `head_chunk`/`remat`/`token_chunk`/`remat_group`: the trainer keys of those names
    (`make_outputs`). `ref_graphdef`: the Ref's model when it differs from the Actor's (LoRA:
    the plain decoder, run on the base params)."""
    logprobs = make_logprobs(graphdef, temperature, head_chunk=head_chunk,
                             token_chunk=token_chunk)
    ref_logprobs = logprobs if ref_graphdef is None else make_logprobs(
        ref_graphdef, temperature, head_chunk=head_chunk, token_chunk=token_chunk)
    outputs = make_outputs(graphdef, temperature, entropy_grad=bool(spec.entropy_coef),
                           head_chunk=head_chunk, remat=remat, token_chunk=token_chunk,
                           remat_group=remat_group)
    traces = _Traces()
    ref_forward, policy_lp, actor_forward = _forward_kernels(logprobs, outputs, sh, traces,
                                                             ref_mesh, ref_param_shardings,
                                                             ref_logprobs)
    backward, actor_backward = _backward_kernels(spec, sh, traces)
    scale_grads, apply, skip, zeros_like_grads = _update_kernels(tx, sh, traces)
    fused_grads, fused_accumulate = _fused_kernels(outputs, spec, sh, traces)
    return Kernels(ref_forward, policy_lp, actor_forward, backward, actor_backward, scale_grads,
                   apply, skip, zeros_like_grads, fused_grads, fused_accumulate, traces)
