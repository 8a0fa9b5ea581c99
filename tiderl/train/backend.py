"""The trainer backend the controller calls: the RA2P executor over jitted Ref/Actor functions.

Contract: `ref_forward(batch)`, `actor_forward(batch)`, `actor_backward(vjp, logprobs,
ref_logprobs, batch)` (forms the GRPO cotangent and accumulates), `apply()`, `swap(role, where)`,
`export_weights()`. The step-level entry point streams micro-batches:

    backend.submit(mb)            # non-blocking; callable from the event loop
    metrics = backend.finish_step()          # or: await backend.finish_step_async()

Device work runs on one worker thread (never on the event loop): `submit` only enqueues the host
`MicroBatch`; the worker transfers, dispatches and, at `finish_step`, applies the update.

Modes:
- decoupled (Ref on its own mesh): per micro-batch, Ref forward on the Ref mesh, Actor forward on
  the Actor mesh, then the backward once the Ref logprobs are moved over (`jax.device_put`). JAX's
  async dispatch overlaps Ref forward i with Actor work of earlier micro-batches; nothing blocks
  until the step ends (unless `sync_timings`).
- colocated (one mesh): ready-batch aggregation — the worker takes every micro-batch queued so far
  (≤ max_aggregate), runs Ref over all k, then Actor over the k. With offload (trainer.offload
  'always', or 'auto' when the two models would fill a device), the idle model's state sits in
  `pinned_host` memory and each phase change moves both models. `aggregate=False` is the
  vanilla-streaming baseline (alternate per micro-batch: VS, or VSO with offload).

With LoRA (`trainer.lora_rank` > 0) the train state is the adapters' (`models/lora.py`), the
policy's weights are the frozen base `frozen` (never updated, never offloaded), the Ref is the
plain decoder on that base (no copy when colocated), and `export_weights_async` hands out a
`LoraExport` (adapters + base) so a sync can move the adapters alone.

With `trainer.kl_coef = 0` the loss has no KL term, so the Ref forward is skipped altogether
(a zero placeholder stands for its logprobs; no Ref phase, alternation or swap is counted), as
verl does without a KL loss.

`advise_mode(ready_times)` runs the RA2P cost model (train/ra2p.py) on measured phase times
(exponentially weighted per micro-batch; decoupled phases are timed by completion on a watcher
thread, `phase_clock.py`, so the pipeline is never serialised to measure it);
`set_ref_mesh(mesh | None)` switches mode between steps and `set_meshes(actor, ref)` also
changes the Actor's data-parallel width (ERS: a cell joins or leaves the trainer). The state
moves with `jax.device_put` (params and optimizer state are replicated over `data`, so a wider
mesh receives one replica's shards; a narrower one keeps a subset), and each (Actor, Ref) mesh
pair keeps its compiled kernels: returning to a mesh seen before compiles nothing. Metrics of `finish_step` carry per-phase times (wait, ref, actor_fwd,
actor_bwd, swap, apply), swaps (model moves) and alternations (Ref/Actor phase changes).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import queue
import threading
import time
from collections.abc import Sequence
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
from tiderl.train import ra2p
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import MicroBatch, bucket_rows
from tiderl.train.grpo import LossSpec, normalizer
from tiderl.train.phase_clock import PhaseClock
from tiderl.train.ref_actor import (
    batch_sharding,
    dp_size,
    init_train_state,
    make_kernels,
    make_optimizer,
    make_schedule,
    param_groups,
    schedule_count,
    train_shardings,
)

Role = Literal["actor", "ref"]
Where = Literal["device", "host"]
PHASES = ("wait", "ref", "actor_fwd", "actor_bwd", "swap", "apply")


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


def seqs_with_actions(mb: MicroBatch) -> int:
    """Sequences of `mb` with at least one action token (the seq_mean divisor)."""
    rows, cols = np.nonzero(mb.loss_mask_bt > 0)
    return len(set(zip(rows.tolist(), mb.segment_ids_bt[rows, cols].tolist(), strict=False)))


class TrainerBackend:
    """Actor train state, frozen Ref params, the RA2P executor and its worker thread."""

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
        self._reset_step()
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cost_ema: dict[str, float] = {}
        self._last_role: Role | None = None
        self._clock = PhaseClock()

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

    # ------------------------------------------------------------------ step-level executor
    def submit(self, mb: MicroBatch) -> None:
        """Queues a ready micro-batch; never blocks (device work runs on the worker thread)."""
        self.submit_ready([mb])

    def submit_ready(self, mbs: Sequence[MicroBatch]) -> None:
        """Queues micro-batches that became ready together (one aggregation group if colocated)."""
        self._start_worker()
        self._q.put(("mb", list(mbs), time.perf_counter()))

    def finish_step(self) -> dict:
        """Blocks until every submitted micro-batch is trained and the update applied."""
        return self._finish_future().result()

    async def finish_step_async(self) -> dict:
        """`finish_step` for the event loop: awaits the worker without blocking the loop."""
        return await asyncio.wrap_future(self._finish_future())

    def _finish_future(self) -> concurrent.futures.Future:
        self._start_worker()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("finish", fut, time.perf_counter()))
        return fut

    def call(self, fn: Any) -> concurrent.futures.Future:
        """Runs `fn()` on the trainer's worker thread, after the work queued before it.

        For device work the event loop must not do itself: weight export (a device copy, and
        a swap back from host memory when offloaded) and checkpoint saves (device→host)."""
        self._start_worker()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("call", (fn, fut), time.perf_counter()))
        return fut

    async def export_weights_async(self) -> nnx.State | LoraExport:
        """`export_weights()` on the worker thread, awaited without blocking the event loop;
        under LoRA `export_lora()` (the syncs move adapters; `serving_weights` merges)."""
        return await asyncio.wrap_future(self.call(
            self.export_weights if self.lora is None else self.export_lora))

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(("stop", None, 0.0))
            self._thread.join()
            self._thread = None

    def train_step(self, mbs: Sequence[MicroBatch]) -> dict:
        """One step over micro-batches already ready (synchronous convenience)."""
        self.submit_ready(mbs)
        return self.finish_step()

    def fused_step(self, mbs: Sequence[MicroBatch]) -> dict:
        """The plain reference step: per micro-batch, Ref forward then `jax.grad` of the fused
        loss (accumulated); then the same apply. Runs on the calling thread."""
        t0 = time.perf_counter()
        metrics = []
        for mb in mbs:
            ref = self.ref_forward(self.put(mb, "ref" if self.uses_ref else "actor"))
            self._ensure("actor")
            if self._grads is None:
                self._grads = self.k.zeros_like_grads(self.state["params"])
            self._grads, m = self.k.fused_accumulate(
                self.state["params"], self.put(mb, "actor"), jax.device_put(ref, self.sh.tokens),
                jnp.int32(self.version), self._grads, self.frozen)
            metrics.append(m)
            self._n_tokens += mb.n_action_tokens
            self._n_seqs += seqs_with_actions(mb)
        out = self.apply()
        jax.block_until_ready(self.state)
        sums = jax.device_get(jax.tree.map(lambda *x: sum(x), *metrics))
        swaps = self._swaps
        self._reset_step()
        return {"loss": float(sums["loss_sum"]) / out["denom"],
                "grad_norm": float(out["grad_norm"]), "version": self.version, "swaps": swaps,
                "step_time": time.perf_counter() - t0}

    def cost_model(self, m_actor: int = 1) -> ra2p.CostModel:
        """The RA2P cost model at the measured per-micro-batch phase times (EMA); the Ref phase
        costs nothing when the loss has no KL term (it does not run)."""
        c = self._cost_ema
        costs = ra2p.PhaseCosts(c.get("ref", 0.0) if self.uses_ref else 0.0,
                                c.get("actor_fwd", 0.0), c.get("actor_bwd", 0.0),
                                c.get("swap", 0.0), m_actor)
        return ra2p.CostModel(costs, slack=self.cfg.colocate_slack,
                              max_aggregate=self.cfg.max_aggregate)

    def advise_mode(self, ready_times: Sequence[float], m_actor: int = 1) -> ra2p.ModeChoice:
        """RA2P choice from the measured per-micro-batch phase times (EMA) and ready times."""
        return self.cost_model(m_actor).advise(ready_times)

    # ------------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self._grads = None
        self._metrics: list[dict] = []
        self._n_tokens = self._n_seqs = self._n_mbs = 0
        self._times = dict.fromkeys(PHASES, 0.0)
        self._swaps = 0
        self._alternations = 0
        self._step_t0: float | None = None

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

    def _start_worker(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiderl-trainer",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            t_idle = time.perf_counter()
            kind, payload, _ = self._q.get()
            if self._step_t0 is not None:
                self._times["wait"] += time.perf_counter() - t_idle
            if kind == "stop":
                return
            if kind != "mb":
                self._control(kind, payload)
                continue
            if self._step_t0 is None:
                self._step_t0 = time.perf_counter()
            group, pending = list(payload), None
            while len(group) < self._group_cap():
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt[0] != "mb":
                    pending = nxt  # answered after this group, keeping submission order
                    break
                group.extend(nxt[1])
            if self._error is None:  # after a failure, drop work until finish_step reports it
                try:
                    cap = self._group_cap()
                    for i in range(0, len(group), cap):
                        self._process(group[i:i + cap])
                except BaseException as e:  # noqa: BLE001 - surfaced by finish_step
                    self._error = e
            if pending is not None:
                if pending[0] == "stop":
                    return
                self._control(pending[0], pending[1])

    def _control(self, kind: str, payload: Any) -> None:
        if kind == "finish":
            self._answer(payload)
            return
        fn, fut = payload  # "call"
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the caller of call() gets it
            fut.set_exception(e)

    def _answer(self, fut: concurrent.futures.Future) -> None:
        try:
            if self._error is not None:
                raise self._error
            fut.set_result(self._finish())
        except BaseException as e:  # noqa: BLE001 - the caller of finish_step gets it
            self._error = None
            self._grads = None
            self._reset_step()
            fut.set_exception(e)

    def _group_cap(self) -> int:
        if self.mode == "colocated" and self.cfg.aggregate:
            return self.cfg.max_aggregate
        return 1

    def _timed(self, phase: str, fn, *args, block: bool):
        t0 = time.perf_counter()
        out = fn(*args)
        if block:
            jax.block_until_ready(out)
        self._times[phase] += time.perf_counter() - t0
        return out

    def _process(self, group: list[MicroBatch]) -> None:
        sync = self.cfg.sync_timings
        if self.mode == "decoupled":
            for mb in group:
                b_act = self.put(mb, "actor")
                b_ref = self.put(mb, "ref") if self.uses_ref else b_act
                ref = self._timed("ref", self.ref_forward, b_ref, block=sync)
                key = object()
                if self.uses_ref:
                    self._clock.track("ref", "ref", ref, key=key)
                lp, vjp = self._timed("actor_fwd", self.actor_forward, b_act, block=sync)
                self._clock.track("actor", "actor_fwd", lp)
                m = self._timed("actor_bwd", self.actor_backward, vjp, lp, ref, b_act, mb,
                                block=sync)
                # The backward's metrics come out of the same computation as its gradient
                # (which is donated into the next backward, so it cannot be waited on).
                self._clock.track("actor", "actor_bwd", m,
                                  after=key if self.uses_ref else None)
            return
        # Colocated: Ref over the whole ready group, then Actor over it. The phases share the
        # devices, so blocking at phase ends costs nothing and gives exact phase times.
        batches = [self.put(mb, "actor") for mb in group]  # one transfer serves both models
        t0 = time.perf_counter()
        refs = jax.block_until_ready([self.ref_forward(b) for b in batches])
        self._times["ref"] += time.perf_counter() - t0
        for mb, b, ref in zip(group, batches, refs, strict=True):
            lp, vjp = self._timed("actor_fwd", self.actor_forward, b, block=sync)
            self._timed("actor_bwd", self.actor_backward, vjp, lp, ref, b, mb, block=sync)
        t0 = time.perf_counter()
        jax.block_until_ready(self._grads)
        self._times["actor_bwd"] += time.perf_counter() - t0

    def _finish(self) -> dict:
        if self._n_mbs == 0:
            raise RuntimeError("finish_step() with no submitted micro-batch; submit at least one")
        t0 = time.perf_counter()
        # The rate this update is applied with: the schedule at the updates applied so far.
        lr = float(self._schedule(schedule_count(self.state["opt"])))
        out = self.apply()
        jax.block_until_ready(self.state)
        self._times["apply"] += time.perf_counter() - t0
        sums = jax.device_get(jax.tree.map(lambda *x: sum(x), *self._metrics))
        n_tok = max(self._n_tokens, 1)
        metrics = {
            "loss": float(sums["loss_sum"]) / out["denom"],
            "pg_loss": float(sums["pg_sum"]) / out["denom"],
            "kl": float(sums["kl_sum"]) / n_tok,
            "entropy": float(sums["entropy_sum"]) / n_tok,
            "clip_frac": float(sums["clipped_tokens"]) / n_tok,
            "stale_frac": float(sums["stale_tokens"]) / n_tok,
            "ratio_mean": float(sums["ratio_sum"]) / n_tok,
            "grad_norm": float(out["grad_norm"]),
            "lr": lr,
            "skipped": bool(out["skipped"]),
            "action_tokens": self._n_tokens,
            "sequences": self._n_seqs,
            "microbatches": self._n_mbs,
            "swaps": self._swaps,
            "alternations": self._alternations,
            "version": self.version,
            "mode": self.mode,
            "offload": self.offload,
            "step_time": time.perf_counter() - (self._step_t0 or t0),
        }
        metrics.update({f"time_{k}": v for k, v in self._times.items()})
        busy = self._clock.collect()
        # Decoupled phases were dispatched asynchronously: their device time is the watcher's
        # (colocated phases block at their ends, so their timed calls are their device time).
        phase = busy if self.mode == "decoupled" and not self.cfg.sync_timings else self._times
        for k in ("ref", "actor_fwd", "actor_bwd"):
            if k in phase or k != "ref":
                self._ema(k, phase.get(k, 0.0) / self._n_mbs)
        metrics.update({f"busy_{k}": v for k, v in busy.items()})
        if self._swaps:
            self._ema("swap", self._times["swap"] / self._swaps)
        self._reset_step()
        return metrics

    def _ema(self, key: str, value: float, alpha: float = 0.3) -> None:
        old = self._cost_ema.get(key)
        self._cost_ema[key] = value if old is None else (1 - alpha) * old + alpha * value

