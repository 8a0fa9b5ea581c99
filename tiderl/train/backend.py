"""The trainer backend the controller calls: the RA2P executor over jitted Ref/Actor functions.

Contract: `ref_forward(batch)`, `actor_forward(batch)`, `actor_backward(vjp, logprobs,
ref_logprobs, batch)` (forms the GRPO cotangent and accumulates), `apply()`, `swap(role, where)`,
`export_weights()`. The step-level entry point streams micro-batches (`submit(mb)`, then
`finish_step()`) to one worker thread that runs this contract: `executor.py`, the
`StepExecutor` mixin `TrainerBackend` inherits, with the decoupled and colocated schedules, the
step's metrics and the RA2P cost model's advice (`advise_mode`).

Modes: decoupled (the Ref on a mesh of its own) or colocated (one mesh). Colocated with offload
(trainer.offload 'always', or 'auto' when the two models would fill a device), the idle model's
state sits in `pinned_host` memory and each phase change moves both models.

With LoRA (`trainer.lora_rank` > 0) the train state is the adapters' (`models/lora.py`), the
policy's weights are the frozen base `frozen` (never updated, never offloaded), the Ref is the
plain decoder on that base (no copy when colocated), and `export_weights_async` hands out a
`LoraExport` (adapters + base) so a sync can move the adapters alone.

With `trainer.kl_coef = 0` the loss has no KL term, so the Ref forward is skipped altogether
(a zero placeholder stands for its logprobs; no Ref phase, alternation or swap is counted), as
verl does without a KL loss.

`set_ref_mesh(mesh | None)` switches mode between steps and `set_meshes(actor, ref)` also
changes the Actor's data-parallel width (ERS: a cell joins or leaves the trainer). The state
moves with `jax.device_put` (params and optimizer state are replicated over `data`, so a wider
mesh receives one replica's shards; a narrower one keeps a subset), and each (Actor, Ref) mesh
pair keeps its compiled kernels: returning to a mesh seen before compiles nothing.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tiderl.models.config import ModelConfig
from tiderl.models.lora import LoraSpec
from tiderl.models.policy import (
    LoraExport,
    abstract_policy,
    init_policy,
    lora_policy,
    serving_adapters,
    serving_config,
    serving_params,
)
from tiderl.models.sharding import state_shardings
from tiderl.models.vlm import image_input, mrope_positions
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import MicroBatch, bucket_rows, seqs_with_actions
from tiderl.train.executor import StepExecutor
from tiderl.train.grpo import LossSpec, normalizer
from tiderl.train.ref_actor import (
    batch_sharding,
    dp_size,
    init_train_state,
    make_kernels,
    make_optimizer,
    make_schedule,
    param_groups,
    train_shardings,
)

Role = Literal["actor", "ref"]
Where = Literal["device", "host"]


_KERNELS: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
MAX_KERNEL_SETS = 16
"""Compiled kernel sets kept per process (least recently used dropped first): a long run that
switches modes or meshes must not accumulate executables."""


def _kernels(key: tuple, build: Any) -> tuple:
    if key in _KERNELS:
        _KERNELS.move_to_end(key)
        return _KERNELS[key]
    _KERNELS[key] = value = build()
    while len(_KERNELS) > MAX_KERNEL_SETS:
        _KERNELS.popitem(last=False)
    return value


def _opt_key(cfg: TrainerConfig) -> tuple:
    return (cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.warmup_steps, cfg.lr_schedule,
            cfg.decay_steps, cfg.adam_b1, cfg.adam_b2, cfg.adam_eps)


def _copy(tree: Any) -> Any:
    # Fresh buffers: a jitted identity would forward (alias) its inputs, and the Actor state is
    # donated on every apply.
    return jax.tree.map(lambda a: a.copy(), tree)


@functools.lru_cache(maxsize=8)
def _serving_fn(model_cfg: ModelConfig) -> Any:
    return jax.jit(functools.partial(serving_params, cfg=model_cfg))


@functools.lru_cache(maxsize=8)
def _serving_adapters_fn(model_cfg: ModelConfig, spec: LoraSpec) -> Any:
    return jax.jit(functools.partial(serving_adapters, cfg=model_cfg, spec=spec))


def lora_spec(cfg: TrainerConfig) -> LoraSpec | None:
    """The adapters `trainer.lora_*` ask for, or None (full fine-tuning)."""
    return (LoraSpec(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets))
            if cfg.lora_rank else None)


def _memory(tree: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree)


class TrainerBackend(StepExecutor):
    """Actor train state, frozen Ref params, the RA2P executor and its worker thread
    (`executor.StepExecutor`)."""

    def __init__(self, cfg: TrainerConfig, model_cfg: ModelConfig, *, actor_mesh: Mesh,
                 ref_mesh: Mesh | None = None, temperature: float = 1.0, seed: int = 0,
                 policy: tuple[nnx.GraphDef, nnx.State] | None = None,
                 ref_params: nnx.State | None = None):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.temperature = temperature
        self.actor_mesh = actor_mesh
        if cfg.mode == "colocated" and ref_mesh is not None or cfg.mode == "decoupled" and (
                ref_mesh is None or ref_mesh == actor_mesh):
            raise ValueError(f"trainer.mode={cfg.mode!r} but the backend was given "
                             f"{'a separate' if ref_mesh is not None else 'no'} Ref mesh; pass "
                             "ref_mesh for decoupled or drop it for colocated")
        self.spec = LossSpec.from_config(cfg)
        self._schedule = make_schedule(cfg)
        if policy is None:
            policy = init_policy(model_cfg, seed=seed, mesh=actor_mesh)
        self.graphdef, params = policy
        # The graphdef of export_weights()' params: what the engines are built with.
        self.serving_graphdef = (abstract_policy(serving_config(model_cfg))[0]
                                 if model_cfg.scan_layers else self.graphdef)
        self.serving_abstract = (jax.eval_shape(_serving_fn(model_cfg), params)
                                 if model_cfg.scan_layers else jax.eval_shape(lambda: params))
        # LoRA: the trainable params are the adapters, `frozen` the base (the policy's params);
        # the Ref is the plain decoder on the base (`ref_graphdef`).
        self.lora, self.ref_graphdef, frozen = lora_spec(cfg), self.graphdef, None
        if self.lora is not None:
            if ref_params is not None:
                raise ValueError("trainer.lora_rank > 0: the Ref is the frozen base; pass no "
                                 "ref_params")
            self.graphdef, adapters, _ = lora_policy(model_cfg, self.lora, seed=seed,
                                                     mesh=actor_mesh)
            frozen, params = params, adapters
        self._abstract = jax.eval_shape(lambda: params)
        self._frozen_abstract = None if frozen is None else jax.eval_shape(lambda: frozen)
        self._bind(ref_mesh)
        self.frozen = None if frozen is None else jax.device_put(frozen, self.sh.frozen)
        # No KL term, no Ref forward: no Ref copy of the weights either (+1× params otherwise).
        # LoRA: the Ref reads the frozen base itself; a copy only on a Ref mesh of its own.
        if self.frozen is not None:
            self.ref_params = self._ref_copy()
        else:
            self.ref_params = (jax.device_put(_copy(params if ref_params is None
                                                    else ref_params), self.ref_param_sh)
                               if self.uses_ref else None)
        self.state = init_train_state(jax.device_put(_copy(params), self.sh.params), self.tx,
                                      self.sh)
        self.version = 0
        self.where: dict[str, Where] = {"actor": "device", "ref": "device"}
        self.offload = self._decide_offload()
        self._init_executor()
        self._last_role: Role | None = None

    def _ref_copy(self) -> Any:
        """LoRA: the Ref's params (the base) on a Ref mesh of its own, else None (the Ref
        forward reads `frozen`, no copy)."""
        if not self.uses_ref or self.mode == "colocated":
            return None
        return jax.device_put(_copy(self.frozen), self.ref_param_sh)

    def _bind(self, ref_mesh: Mesh | None) -> bool:
        """Kernels for the current Actor mesh and `ref_mesh`; True when they were cached."""
        self.ref_mesh = actor_mesh = self.actor_mesh
        if ref_mesh is not None and ref_mesh != actor_mesh:
            self.ref_mesh = ref_mesh
        self.mode: Literal["decoupled", "colocated"] = (
            "colocated" if self.ref_mesh is actor_mesh else "decoupled")
        frozen, scaled = self.frozen_params(), self.scaled_params()
        key = (self.graphdef, self.spec, _opt_key(self.cfg), self.temperature, actor_mesh,
               self.ref_mesh, self.cfg.head_chunk, self.cfg.remat, self.cfg.token_chunk,
               self.cfg.remat_group, self.lora, frozen, scaled)

        def build() -> tuple:
            # One compiled set per (model, loss, optimizer, meshes): backends built for other
            # modes of the same job (VS/VSO/CM, tests) share the compilation.
            tx = make_optimizer(self.cfg, frozen, scaled)
            sh = train_shardings(self._abstract, tx, actor_mesh, self._frozen_abstract)
            ref_sh = state_shardings(self._abstract if self._frozen_abstract is None
                                     else self._frozen_abstract, self.ref_mesh)
            return (tx, sh, ref_sh, make_kernels(
                self.graphdef, tx, self.spec, self.temperature, sh, ref_mesh=self.ref_mesh,
                ref_param_shardings=ref_sh, head_chunk=self.cfg.head_chunk,
                remat=self.cfg.remat, token_chunk=self.cfg.token_chunk,
                remat_group=self.cfg.remat_group,
                ref_graphdef=None if self.lora is None else self.ref_graphdef))

        cached = key in _KERNELS
        self.tx, self.sh, self.ref_param_sh, self.k = _kernels(key, build)
        return cached

    def frozen_params(self) -> tuple[str, ...]:
        """Top-level params the optimizer leaves alone (`ref_actor.param_groups`)."""
        return param_groups(self.model_cfg, self.cfg, self.lora is not None)[0]

    def scaled_params(self) -> tuple[tuple[str, float], ...]:
        """Top-level params at a learning rate of their own (`ref_actor.param_groups`)."""
        return param_groups(self.model_cfg, self.cfg, self.lora is not None)[1]

    def _decide_offload(self) -> bool:
        if self.cfg.offload != "auto":
            return self.cfg.offload == "always"
        stats = self.actor_mesh.devices.flat[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return False  # CPU: host memory is the device memory
        per_device = sum(x.addressable_shards[0].data.nbytes
                         for x in jax.tree.leaves((self.state, self.ref_params, self.frozen)))
        return per_device > self.cfg.offload_fraction * stats["bytes_limit"]

    def set_ref_mesh(self, ref_mesh: Mesh | None) -> None:
        """Switches RA2P mode between steps: a Ref mesh of its own (decoupled) or None
        (colocated on the Actor's devices). The Ref params move with `jax.device_put`."""
        self.set_meshes(self.actor_mesh, ref_mesh)

    def set_meshes(self, actor_mesh: Mesh, ref_mesh: Mesh | None = None) -> dict:
        """Moves the Actor train state to `actor_mesh` and the Ref to `ref_mesh` (None: the
        Actor's) between steps; returns {"kernels": "cached" | "built", "move_s": seconds}.

        The meshes must keep the Actor's fsdp × model shape (only `data` changes), so every
        shard keeps its shape and the move is a copy of one replica's shards."""
        if self._n_mbs or self._grads is not None:
            raise RuntimeError("set_meshes() inside a step; call it after finish_step()")
        for ax in ("fsdp", "model"):
            if actor_mesh.shape[ax] != self.actor_mesh.shape[ax]:
                raise ValueError(f"set_meshes: the Actor mesh's {ax!r} axis is "
                                 f"{actor_mesh.shape[ax]}, was {self.actor_mesh.shape[ax]}; "
                                 "only the data axis may change (a cell is one fsdp×model group)")
        t0 = time.perf_counter()
        self.swap("actor", "device")
        self.swap("ref", "device")
        old = (self.actor_mesh, self.ref_mesh, self.mode, self.tx, self.sh, self.ref_param_sh,
               self.k)
        try:
            self.actor_mesh = actor_mesh
            cached = self._bind(ref_mesh)
            state = self._move_tree(self.state, self.sh.state)
            frozen = (None if self.frozen is None
                      else self._move_tree(self.frozen, self.sh.frozen))
            if self.frozen is not None:  # LoRA: the Ref is the base (a copy on its own mesh)
                ref_params = (None if not self.uses_ref or self.mode == "colocated"
                              else self._move_tree(frozen, self.ref_param_sh))
            else:
                ref_params = (None if self.ref_params is None  # kl_coef=0: no Ref copy
                              else self._move_tree(self.ref_params, self.ref_param_sh))
            jax.block_until_ready((state, ref_params, frozen))
        except BaseException:
            # All or nothing: the state never left its old meshes, so keep their kernels.
            (self.actor_mesh, self.ref_mesh, self.mode, self.tx, self.sh, self.ref_param_sh,
             self.k) = old
            raise
        self.state, self.ref_params, self.frozen = state, ref_params, frozen
        self._last_role = None
        self.offload = self._decide_offload()
        self._reset_step()
        return {"kernels": "cached" if cached else "built", "move_s": time.perf_counter() - t0}

    def _move_tree(self, tree: Any, shardings: Any) -> Any:
        """`tree` into `shardings` (a set_meshes move); across processes, SpmdTrainer's."""
        return jax.device_put(tree, shardings)

    # ------------------------------------------------------------------ contract, per call
    def put(self, mb: MicroBatch, role: Role) -> dict:
        mesh = self.actor_mesh if role == "actor" else self.ref_mesh
        rows, n = mb.tokens_bt.shape[0], dp_size(mesh)
        if rows % n:
            raise ValueError(f"micro-batch has {rows} rows, not divisible by the {role} mesh's "
                             f"{n} data-parallel shards; pack with n_ranks={n}")
        arrays = mb.arrays()
        images = None
        if mb.images:
            arrays["positions_bt"], images = self.images_input(mb)
        batch = jax.device_put(arrays, batch_sharding(mesh))
        if images is not None:
            # Replicated: every data shard's rows index the features of the whole batch.
            batch["images"] = jax.device_put(images, NamedSharding(mesh, PartitionSpec()))
        return batch

    def images_input(self, mb: MicroBatch) -> tuple[np.ndarray, Any]:
        """([B, T, 3] M-RoPE positions of the packed rows, each sequence from 0, the vision
        tower's `ImageInput` with the patch rows padded to a power of two: one compiled shape
        per bucket)."""
        vision = self.model_cfg.vision
        if vision is None:
            raise ValueError(f"a micro-batch carries {len(mb.images)} images but model.vision "
                             "is null (a text-only policy); train a vision-language model")
        pixels = np.concatenate([np.asarray(p, np.float32) for p, _ in mb.images])
        grid = np.asarray([np.asarray(g).reshape(3) for _, g in mb.images], np.int64)
        pad_to = max(bucket_rows(pixels.shape[0]), vision.spatial_merge_size ** 2)
        positions = mrope_positions(mb.tokens_bt, grid, self.model_cfg, mb.segment_ids_bt)
        return positions.astype(np.int32), image_input(pixels, grid, vision, pad_to=pad_to)

    @property
    def uses_ref(self) -> bool:
        """Whether the loss needs Ref logprobs (a KL term)."""
        return self.spec.kl_coef != 0

    def ref_forward(self, batch: dict) -> jax.Array:
        """Ref logprobs of `batch`; zeros (no forward) when the loss has no KL term."""
        if not self.uses_ref:
            return jnp.zeros_like(batch["loss_mask_bt"])
        self._ensure("ref")
        # LoRA colocated: the Ref is the frozen base itself (no copy).
        ref = self.ref_params if self.ref_params is not None else self.frozen
        return self.k.ref_forward(ref, batch)

    def actor_forward(self, batch: dict) -> tuple[tuple[jax.Array, jax.Array], Any]:
        """((logprobs, entropies), vjp): the loss waits for the Ref logprobs (deferred)."""
        self._ensure("actor")
        return self.k.actor_forward(self.state["params"], batch, self.frozen)

    def actor_backward(self, vjp: Any, outs: tuple[jax.Array, jax.Array], ref_logprobs: jax.Array,
                       batch: dict, mb: MicroBatch) -> dict:
        """Cotangent from (Actor outputs, ref, behaviour, advantages, masks), `vjp`, accumulate."""
        self._ensure("actor")
        if ref_logprobs.sharding != self.sh.tokens:
            ref_logprobs = jax.device_put(ref_logprobs, self.sh.tokens)
        # The first micro-batch's gradient becomes the sum (None: no zero-filled copy).
        self._grads, metrics = self.k.backward(vjp, outs, ref_logprobs, batch,
                                               jnp.int32(self.version), self._grads)
        self._metrics.append(metrics)
        self._n_tokens += mb.n_action_tokens
        self._n_seqs += seqs_with_actions(mb)
        self._n_mbs += 1
        return metrics

    def apply(self) -> dict:
        """Normalises the accumulated gradient by the step's divisor and updates the Actor."""
        self._ensure("actor")
        if self._grads is None:
            raise RuntimeError("apply() with no accumulated micro-batch; submit work first")
        denom = normalizer(self._n_tokens, self._n_seqs, self.spec.loss_agg)
        grads, gnorm = self.k.scale_grads(self._grads, jnp.float32(denom))  # the sum is donated
        self._grads = None
        # A non-finite gradient skips the update (params and moments unchanged); the step
        # still counts, so checkpoint numbering follows the controller's steps.
        skipped = not bool(jnp.isfinite(gnorm))
        self.state = self.k.skip(self.state) if skipped else self.k.apply(self.state, grads)
        self.version += 1
        return {"grad_norm": gnorm, "skipped": skipped, "denom": denom}

    def swap(self, role: Role, where: Where) -> float:
        """Moves a model's state between device memory and pinned host memory; seconds taken."""
        if self.where[role] == where or role == "ref" and self.ref_params is None:
            return 0.0
        t0 = time.perf_counter()
        kind = "pinned_host" if where == "host" else "device"
        if role == "ref":
            self.ref_params = jax.device_put(self.ref_params, _memory(self.ref_param_sh, kind))
            jax.block_until_ready(self.ref_params)
        else:
            self.state = jax.device_put(self.state, _memory(self.sh.state, kind))
            if self._grads is not None:
                self._grads = jax.device_put(self._grads, _memory(self.sh.params, kind))
            jax.block_until_ready((self.state, self._grads))
        self.where[role] = where
        dt = time.perf_counter() - t0
        self._times["swap"] += dt
        self._swaps += 1
        return dt

    def _ensure(self, role: Role) -> None:
        if self.mode == "colocated" and self._last_role != role:
            # A phase change on shared devices: the paper's model alternation (VS counts these
            # even without offload; with offload each is a pinned_host round trip).
            self._alternations += 1
            self._last_role = role
        if self.mode == "colocated" and self.offload:
            other: Role = "ref" if role == "actor" else "actor"
            self.swap(other, "host")
        self.swap(role, "device")

    def logprobs(self, mb: MicroBatch) -> np.ndarray:
        """The current policy's per-token logprobs of `mb` on the host (evals, on-policy tests)."""
        self._ensure("actor")
        return np.asarray(self.k.logprobs(self.state["params"], self.put(mb, "actor"),
                                          self.frozen))

    def export_weights(self, shardings: Any = None) -> nnx.State:
        """The rollout engines' weights (`serving_graphdef`'s layout; optionally resharded for
        the rollout mesh): fresh buffers of the Actor params, per layer and, under bf16
        compute, with the decoder's matrices in bf16 (`models.policy.serving_params`). LoRA:
        the merged weights W + scale·A·B."""
        self._ensure("actor")
        if self.lora is not None:
            params = self.export_lora().full()
        else:
            params = _serving_fn(self.model_cfg)(self.state["params"])
        return params if shardings is None else jax.device_put(params, shardings)

    def export_lora(self) -> LoraExport:
        """LoRA: the adapters in the engines' layout (fresh copies) with the frozen base they
        apply to; a sync moves the adapters alone (`tiderl.runtime.parts`)."""
        self._ensure("actor")
        adapters = _serving_adapters_fn(self.model_cfg, self.lora)(self.state["params"])
        return LoraExport(adapters, self.frozen, self.lora.scale, self.model_cfg)
