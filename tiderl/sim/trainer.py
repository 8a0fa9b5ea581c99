"""SimTrainer: the trainer-backend contract on the loop's clock, priced by a cost model. No JAX.

It schedules micro-batches the way the real executor (`tiderl.train.backend.TrainerBackend`)
does and charges each phase's cost from `tiderl.sim.costs`:

- colocated (Ref on the Actor's devices): the worker takes every micro-batch queued so far (at
  most `max_aggregate`; one at a time without `aggregate`, the vanilla streaming baseline), runs
  the Ref over them, then the Actor's forward and backward. A phase change is an alternation
  (a context switch, plus with `offload=True` the idle model's state out to host memory and
  the needed one in, each a `swap`), exactly as `_ensure` counts them there. `offload="auto"`
  offloads only what the memory model says must move: nothing when Ref and Actor fit one
  device together, else the bytes they are over HBM by, at each alternation
  (`SimCostModel.colocation_swap`, from `tiderl.sim.memory`).
- decoupled (`ref_gpus > 0`): the Ref runs on its own devices in arrival order, overlapping the
  Actor; an Actor backward waits for its micro-batch's Ref logprobs (the loss is formed in the
  backward, so the forward never waits).
- `colocated_rollout` (the `sync` baseline, VeRL's hybrid engine): at the start of each step the
  engine sleeps and training state comes in, after the update it goes back — each switch
  costing the bytes `SimCostModel.hybrid_switch` derives (engine weights to host memory, KV
  freed, the Actor state and Ref moved only when they do not fit beside the engine).

The cost of a micro-batch is that of its busiest data-parallel rank (`SimMicroBatch.ranks`,
planned by the production `tiderl.train.dispatch.plan_microbatches`). Step metrics carry the
same keys as the real backend's (`time_ref`, `time_swap`, `swaps`, `alternations`, ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from tiderl.sim.costs import SimCostModel
from tiderl.train.dispatch import lpt_assign, plan_microbatches

PHASES = ("wait", "ref", "actor_fwd", "actor_bwd", "swap", "apply", "ref_wait", "switch")
"""`switch`: the hybrid engine's rollout/train switches (also counted in `swap`)."""


@dataclasses.dataclass(frozen=True)
class SimMicroBatch:
    """A planned micro-batch without its arrays: sequence lengths per data-parallel rank."""

    ranks: tuple[tuple[int, ...], ...]
    n_action_tokens: int
    n_seqs: int
    images: tuple[int, ...] = ()
    """Image tokens per rank (their features are recomputed by the vision tower)."""

    @property
    def tokens(self) -> int:
        return sum(map(sum, self.ranks))


class SimMicroBatcher:
    """The controller's `make_microbatches` hook: the real planner, no packing; what does not
    fill a micro-batch waits for the next call (as `tiderl.runtime.parts.MicroBatcher`)."""

    def __init__(self, *, n_ranks: int, rank_budget: int, order: str = "colocated",
                 balance: str = "lpt", image_token: int | None = None):
        self.n_ranks, self.rank_budget = n_ranks, rank_budget
        self.order, self.balance = order, balance
        self.image_token = image_token
        """The simulated image token: each rank's count of it goes with its micro-batch."""
        self.waiting: list[Any] = []

    def __call__(self, seqs: Sequence[Any], final: bool) -> list[SimMicroBatch]:
        todo = self.waiting + list(seqs)
        lengths = [len(s.tokens) for s in todo]
        plan, rest = plan_microbatches(lengths, n_ranks=self.n_ranks,
                                       rank_budget=self.rank_budget, order=self.order,
                                       balance=self.balance, final=final)
        self.waiting = [todo[i] for i in rest]
        out = []
        for mb in plan.mbs:
            idx = [i for rank in mb for i in rank]
            images = () if self.image_token is None else tuple(
                sum(int((todo[i].tokens == self.image_token).sum()) for i in rank)
                for rank in mb)
            out.append(SimMicroBatch(
                ranks=tuple(tuple(lengths[i] for i in rank) for rank in mb),
                n_action_tokens=sum(int(todo[i].action_mask.sum()) for i in idx),
                n_seqs=len(idx), images=images))
        return out


class SimTrainer:
    """The trainer port of the controller (`submit`, `finish_step_async`, `export_weights_async`,
    `version`) on virtual time."""

    def __init__(self, costs: SimCostModel, *, actor_gpus: int, ref_gpus: int = 0,
                 aggregate: bool = True, max_aggregate: int = 16,
                 offload: bool | str = False, colocated_rollout: bool = False,
                 uses_ref: bool = True, row_len: int | None = None, host: Any = None,
                 tokens_per_gpu: int = 16384, rollout_gpus_per_rank: int = 1):
        if offload not in (True, False, "auto"):
            raise ValueError(f"SimTrainer offload={offload!r}: use True, False or 'auto'")
        self.costs = costs
        self.actor_gpus, self.ref_gpus = actor_gpus, ref_gpus
        self.aggregate, self.max_aggregate = aggregate, max_aggregate
        self.offload_policy = offload
        """True: the idle model always goes to host memory; False: never; "auto": what does
        not fit (the memory model)."""
        self.tokens_per_gpu, self.rollout_gpus_per_rank = tokens_per_gpu, rollout_gpus_per_rank
        self.offload, self.colocated_rollout = offload is True, colocated_rollout
        self.uses_ref, self.row_len = uses_ref, row_len
        self.host = host
        """A `tiderl.sim.host.SharedHost` when the trainer shares its host with rollout."""
        self.version = 0
        self.steps: list[dict] = []
        self.role_changes = 0
        self._queue: list[tuple[SimMicroBatch, float]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._finish: asyncio.Future[dict] | None = None
        self.where = {"actor": "device", "ref": "device"}
        self._last_role: str | None = None
        self._ref_free = 0.0
        self._last_mb: SimMicroBatch | None = None
        self._reset_step()

    @property
    def mode(self) -> str:
        return "decoupled" if self.ref_gpus else "colocated"

    def _reset_step(self) -> None:
        self._times = dict.fromkeys(PHASES, 0.0)
        self._swaps = self._alternations = self._n_mbs = self._tokens = self._seqs = 0
        self._step_t0: float | None = None

    # -- the port ------------------------------------------------------------------------------
    def submit(self, mb: SimMicroBatch) -> None:
        self._last_mb = mb
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run(), name="sim-trainer")
        now = loop.time()
        if self.ref_gpus and self.uses_ref:
            # The Ref's own devices take micro-batches in arrival order (async dispatch runs
            # them as soon as they are submitted, however far the Actor is behind).
            lens = [s for rank in mb.ranks for s in rank]
            ranks, _ = lpt_assign(lens, self.ref_gpus)
            start = max(now, self._ref_free)
            # Image tokens re-spread over the Ref's ranks evenly (their features are recomputed).
            images = (-(-sum(mb.images) // self.ref_gpus),) * self.ref_gpus if mb.images else ()
            self._ref_free = start + self.costs.ref_forward(
                [[lens[i] for i in r] for r in ranks], row_len=self.row_len, images=images)
            self._times["ref"] += self._ref_free - start
            self._queue.append((mb, self._ref_free))
        else:
            self._queue.append((mb, now))
        self._wake.set()

    async def finish_step_async(self) -> dict:
        if self._worker is None:
            raise RuntimeError("finish_step() with no submitted micro-batch; submit at least one")
        if self._worker.done():  # the executor failed: its error, not a wait forever
            self._worker.result()
        self._finish = asyncio.get_running_loop().create_future()
        self._wake.set()
        return await self._finish

    async def export_weights_async(self) -> int:
        return self.version

    async def change_roles(self, *, actor_gpus: int, ref_gpus: int) -> float:
        """Between steps: a new Actor/Ref split (ERS). The ranks that change role load their new
        model's weights over PCIe (concurrently: the cost of one); returns the seconds taken."""
        moved = abs(actor_gpus - self.actor_gpus) + abs(ref_gpus - self.ref_gpus)
        self.actor_gpus, self.ref_gpus = actor_gpus, ref_gpus
        self._last_role = None
        if not moved:
            return 0.0
        self.role_changes += 1
        dt = self.costs.role_change()
        await asyncio.sleep(dt)
        return dt

    def cost_model(self, m_actor: int) -> Any:
        """RA2P's cost model (`tiderl.train.ra2p.CostModel`) for an Actor of `m_actor` devices,
        priced on the last micro-batch seen — what the real trainer measures per phase; the
        controller takes the break-even RAS and the mode advice from it (ERS)."""
        from tiderl.train import ra2p

        lens = [s for rank in (self._last_mb.ranks if self._last_mb else ()) for s in rank]
        if not lens:
            lens = [1]
        m = max(1, m_actor)
        ranks, _ = lpt_assign(lens, m)
        per_rank = [[lens[i] for i in r] for r in ranks]
        c, rl = self.costs, self.row_len
        t_swap = c.swap("ref", m) if self.offload else c.context_switch() + (
            c.colocation_swap(m, self.tokens_per_gpu) if self.offload_policy == "auto" else 0.0)
        costs = ra2p.PhaseCosts(t_ref=c.ref_forward(per_rank, row_len=rl) if self.uses_ref else 0.0,
                           t_act_f=c.actor_forward(per_rank, row_len=rl),
                           t_act_b=c.actor_backward(per_rank, row_len=rl), t_swap=t_swap,
                           m_actor=m)
        return ra2p.CostModel(costs, max_aggregate=self.max_aggregate if self.aggregate else 1)

    def advise_mode(self, ready_times: Sequence[float], m_actor: int) -> Any:
        return self.cost_model(m_actor).advise(ready_times)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    # -- the executor --------------------------------------------------------------------------
    async def _sleep(self, phase: str, seconds: float) -> None:
        if self.host is None:
            self._times[phase] += seconds
            await asyncio.sleep(seconds)
            return
        t0 = self.now()
        self.host.mark()
        await self.host.elastic(seconds)
        if seconds > 0:
            await self.host.lock_wait()  # its worker thread takes the interpreter lock back
        self._times[phase] += self.now() - t0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _swap(self, role: str, where: str) -> None:
        if self.where[role] == where:
            return
        self.where[role] = where
        self._swaps += 1
        await self._sleep("swap", self.costs.swap(role, self.actor_gpus))

    async def _hybrid_switch(self, way: str) -> None:
        """One of the hybrid engine's switches between rollout and training (VeRL)."""
        dt = self.costs.hybrid_switch(self.actor_gpus, self.rollout_gpus_per_rank,
                                      self.tokens_per_gpu)[way]
        self._swaps += 1
        self._times["switch"] += dt
        await self._sleep("swap", dt)

    async def _ensure(self, role: str) -> None:
        if self.mode == "colocated" and self._last_role != role:
            self._alternations += 1
            self._last_role = role
            dt = self.costs.context_switch()
            if self.offload_policy == "auto":  # the bytes that do not fit move each time
                over = self.costs.colocation_swap(self.actor_gpus, self.tokens_per_gpu)
                self._swaps += over > 0
                dt += over
            if dt:
                await self._sleep("swap", dt)
        if self.mode == "colocated" and self.offload:
            await self._swap("ref" if role == "actor" else "actor", "host")
        await self._swap(role, "device")

    async def _run(self) -> None:
        """The executor loop; an error in it fails the pending `finish_step_async` (instead of
        leaving the controller waiting forever)."""
        try:
            await self._loop()
        except Exception as e:
            if self._finish is None:
                self._finish = asyncio.get_running_loop().create_future()
            if not self._finish.done():
                self._finish.set_exception(e)
            raise

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                if self._finish is not None and self._step_t0 is not None:
                    await self._apply()
                    continue
                t_idle = self.now()
                self._wake.clear()
                await self._wake.wait()
                if self._step_t0 is not None:
                    self._times["wait"] += self.now() - t_idle
                continue
            if self._step_t0 is None:
                self._step_t0 = self.now()
                if self.colocated_rollout:  # the engine sleeps, training state comes in
                    await self._hybrid_switch("to_train")
            cap = self.max_aggregate if (self.mode == "colocated" and self.aggregate) else 1
            group, self._queue = self._queue[:cap], self._queue[cap:]
            await self._process(group)

    async def _process(self, group: list[tuple[SimMicroBatch, float]]) -> None:
        c, rl = self.costs, self.row_len
        if self.mode == "decoupled":
            for mb, ref_done in group:
                await self._ensure("actor")
                await self._sleep("actor_fwd", c.actor_forward(mb.ranks, row_len=rl,
                                                               images=mb.images))
                if ref_done > self.now():  # the deferred loss waits for its Ref logprobs
                    await self._sleep("ref_wait", ref_done - self.now())
                await self._sleep("actor_bwd", c.actor_backward(mb.ranks, row_len=rl,
                                                                images=mb.images))
                self._count(mb)
            return
        if self.uses_ref:
            await self._ensure("ref")
            await self._sleep("ref", sum(c.ref_forward(mb.ranks, row_len=rl, images=mb.images)
                                         for mb, _ in group))
        await self._ensure("actor")
        for mb, _ in group:
            await self._sleep("actor_fwd", c.actor_forward(mb.ranks, row_len=rl,
                                                           images=mb.images))
            await self._sleep("actor_bwd", c.actor_backward(mb.ranks, row_len=rl,
                                                            images=mb.images))
            self._count(mb)

    def _count(self, mb: SimMicroBatch) -> None:
        self._n_mbs += 1
        self._tokens += mb.n_action_tokens
        self._seqs += mb.n_seqs

    async def _apply(self) -> None:
        assert self._finish is not None and self._step_t0 is not None
        await self._ensure("actor")
        await self._sleep("apply", self.costs.apply(self.actor_gpus))
        self.version += 1
        if self.colocated_rollout:  # the rollout engines get the devices back
            await self._hybrid_switch("to_rollout")
        m = {"loss": 0.0, "grad_norm": 0.0, "microbatches": self._n_mbs,
             "action_tokens": self._tokens, "sequences": self._seqs, "swaps": self._swaps,
             "alternations": self._alternations, "version": self.version, "mode": self.mode,
             "offload": self.offload, "step_time": self.now() - self._step_t0,
             **{f"time_{k}": v for k, v in self._times.items()}}
        self.steps.append(m)
        fut, self._finish = self._finish, None
        self._reset_step()
        if not fut.done():
            fut.set_result(m)
