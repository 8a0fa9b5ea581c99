"""The trainer's step-level executor, for the backend (`TrainerBackend.submit`): one worker
thread trains the micro-batches the controller streams in.

    backend.submit(mb)            # non-blocking; callable from the event loop
    metrics = backend.finish_step()          # or: await backend.finish_step_async()

Device work runs on one worker thread (never on the event loop): `submit` only enqueues the host
`MicroBatch`; the worker transfers, dispatches and, at `finish_step`, applies the update.
`call(fn)` runs other device work there, after the work queued before it (weight export,
checkpoint saves).

Modes:
- decoupled (Ref on its own mesh): per micro-batch, Ref forward on the Ref mesh, Actor forward on
  the Actor mesh, then the backward once the Ref logprobs are moved over (`jax.device_put`). JAX's
  async dispatch overlaps Ref forward i with Actor work of earlier micro-batches; nothing blocks
  until the step ends (unless `sync_timings`).
- colocated (one mesh): ready-batch aggregation — the worker takes every micro-batch queued so far
  (≤ max_aggregate), runs Ref over all k, then Actor over the k (with offload, each phase change
  moves both models: `TrainerBackend.swap`). `aggregate=False` is the vanilla-streaming
  baseline (alternate per micro-batch: VS, or VSO with offload).

`fused_step` is the plain reference step (`jax.grad` of the fused loss, on the calling thread).
Metrics of `finish_step` carry per-phase times (wait, ref, actor_fwd, actor_bwd, swap, apply),
swaps (model moves) and alternations (Ref/Actor phase changes). `advise_mode(ready_times)` runs
the RA2P cost model (train/ra2p.py) on measured phase times (exponentially weighted per
micro-batch; decoupled phases are timed by completion on a watcher thread, `phase_clock.py`, so
the pipeline is never serialised to measure it).

A mixin so `backend.py` stays about the train state, its meshes and the per-call contract; it
reads the backend's state (`cfg`, `mode`, `state`, `k`, `sh`, `frozen`, `version`, `lora`,
`uses_ref`, `_schedule`) and calls its contract (`put`, `ref_forward`, `actor_forward`,
`actor_backward`, `apply`, `_ensure`, `export_weights`, `export_lora`). The step's counters
(`_reset_step`) are shared: the contract adds to them as it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tiderl.models.policy import LoraExport
from tiderl.train import ra2p
from tiderl.train.dispatch import MicroBatch, seqs_with_actions
from tiderl.train.phase_clock import PhaseClock
from tiderl.train.ref_actor import schedule_count

PHASES = ("wait", "ref", "actor_fwd", "actor_bwd", "swap", "apply")


class StepExecutor:
    """The worker thread, its queue and the step it trains (see the module docstring)."""

    cfg: Any
    mode: str
    state: Any
    k: Any
    sh: Any
    frozen: Any
    version: int
    lora: Any
    uses_ref: bool
    _schedule: Any

    def _init_executor(self) -> None:
        """The worker's queue and the step's counters; no thread until the first submit."""
        self._reset_step()
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cost_ema: dict[str, float] = {}
        self._clock = PhaseClock()

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

