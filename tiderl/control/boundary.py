"""Readiness-aware control at the sync boundary, for the controller. No JAX.

After each update and before the weight sync (`Controller._boundary`): the buffer's boundary
signals, the RA2P break-even and the cost model's advice for the next step go to the planner
(`tiderl.control.ers`); a plan that changes roles is carried out by `RoleSwitch`
(`tiderl.control.roles`); then the weights reach every live rollout rank, and the next step's
fetch target is set (adaptive data retention). A mixin so the loop in `controller.py` stays
about the loop; it reads the controller's state (`cfg`, `buffer`, `trainer`, `manager`,
`planner`, `roles`, `hooks`).
"""

from __future__ import annotations

from typing import Any

from tiderl.control.buffer import Readiness
from tiderl.control.plans import Signals
from tiderl.train.ra2p import predicted_ready_times


class ReadinessAware:
    """The boundary's signals, plan, role change and retention (see the module docstring)."""

    cfg: Any
    buffer: Any
    trainer: Any
    manager: Any
    planner: Any
    eval_groups: Any
    roles: Any
    hooks: Any
    step: int
    version: int
    rwt: float
    _step_time: float
    _fetch: int
    _t_group: float | None
    _advice: Any
    _compiles_at: dict
    _t_boundary: float | None = None
    """When the last boundary ended (RWT accrues from there)."""

    def now(self) -> float:
        raise NotImplementedError  # the controller's clock (Controller.now)

    def _compile_stats(self) -> dict:
        return dict(self.hooks.compile_stats()) if self.hooks.compile_stats else {}

    def _uses_ref(self) -> bool:
        return bool(getattr(self.trainer, "uses_ref", True))

    def _n_microbatches(self) -> int:
        return max(1, -(-self.cfg.groups_per_step // self.cfg.groups_per_microbatch))

    def _signals(self, out: dict) -> Signals:
        """The buffer's boundary signals, the RA2P break-even and the cost model's advice for
        the next step (its ready times predicted from RAS now and the live TPRM)."""
        c, e = self.cfg, self.cfg.elastic
        m_actor = max(1, self.roles.cells.count("trainer"))
        n_mb = self._n_microbatches()
        model = getattr(self.trainer, "cost_model", None)
        model = model(m_actor) if model is not None else None
        tprm = self.buffer.tprm_ema
        be = model.break_even(n_mb, tprm) if model is not None else n_mb + 1
        r: Readiness = self.buffer.boundary(
            out["readiness"], self.now(), step_time=out["step_time"],
            step_time_mean=self._step_time, twt=out["twt"], rwt=self.rwt,
            batch_ideal=c.groups_per_step, tau=e.tau, wait_frac=e.wait_frac,
            break_even_ras=be, uses_ref=self._uses_ref(),
            rwt_span=self.now() - self._t_boundary if self._t_boundary is not None else None)
        advise = getattr(self.trainer, "advise_mode", None)
        self._advice = advise(predicted_ready_times(n_mb, r.ras_next, tprm), m_actor) \
            if advise is not None else None
        # The trainer's consumption capacity at its current width: groups per second of its
        # own compute (the step less the time it waited for data).
        compute = out["step_time"] - out["twt"]
        train_rate = len(out["taken"]) / compute if compute > 0 and out["taken"] else float(
            "nan")
        pace = float("inf")
        if model is not None and model.costs.t_ref > 0:
            pace = (model.costs.t_act_f + model.costs.t_act_b) / model.costs.t_ref
        return self._to_signals(r, eval_next=bool(c.eval_every and self.eval_groups
                                                  and self.step % c.eval_every == 0
                                                  and self.step < c.steps),
                                train_rate=train_rate, ref_pace=pace,
                                rollout_busy=self._rollout_busy(out))

    @staticmethod
    def _rollout_busy(out: dict) -> float:
        """The rollout engines' busy share over this step (nan: unknown)."""
        busy = out["rollout_stats"].get("engine_busy")
        return float(busy) if busy is not None else float("nan")

    def _to_signals(self, r: Readiness, *, eval_next: bool, cold_start: bool = False,
                    train_rate: float = float("nan"), ref_pace: float = float("inf"),
                    rollout_busy: float = float("nan")) -> Signals:
        a = self._advice
        return Signals.from_readiness(
            r, step=self.step, cold_start=cold_start, eval_next=eval_next,
            uses_ref=self._uses_ref(), train_rate=train_rate, ref_pace=ref_pace,
            rollout_busy=rollout_busy,
            ra2p_mode=a.mode if a is not None else self.roles.ref_mode, pinned=self._pinned())

    def _pinned(self) -> frozenset[int]:
        """Cells whose rollout rank failed: never moved (their device is suspect)."""
        k = self.roles.ranks_per_cell
        return frozenset(r // k for r in self.manager.sched.dead
                         if r < len(self.manager.ranks) and self.manager.ranks[r] is not None
                         and self.manager.ranks[r].failed is not None)

    async def _cold_start(self) -> None:
        """Before any rollout: the planner may allocate rollout preemptively (empty buffer)."""
        c = self.cfg
        sig = self._to_signals(Readiness(), eval_next=bool(c.eval_every and self.eval_groups),
                               cold_start=True)
        plan = self.planner.plan(sig, self.roles.cells)
        if self.roles.differs(plan):
            weights = await self.trainer.export_weights_async()
            await self.roles.apply(plan, step=self.step, version=self.version, weights=weights)
        self._t_boundary = self.now()

    async def _boundary(self, out: dict) -> float:
        """Signals → plan → role change → weight sync (to every live rank, new ones included);
        returns the seconds it took."""
        t0 = self.now()
        # The rollout's figures over the step, before the plan changes which ranks roll out
        # (the step record reports these too: ranks that join hold none of the step's work).
        out["rollout_stats"] = self.manager.stats()
        self.roles.finish_pending()
        signals = self._signals(out)
        plan = self.planner.plan(signals, self.roles.cells)
        weights = await self.trainer.export_weights_async()
        change = await self.roles.apply(plan, step=self.step, version=self.version,
                                        weights=weights)
        synced = await self.hooks.sync_weights(weights, self.version)
        out["sync"] = synced if isinstance(synced, dict) else {}  # the sync's own numbers
        self._t_boundary = self.now()
        self._retain(out["readiness"], out)
        out["plan"], out["change"] = plan, change
        out["change_s"] = change["change_s"] if change else 0.0
        return self.now() - t0

    def _retain(self, r: Readiness, out: dict) -> None:
        """Adaptive data retention: while rollout cannot sustain the trainer's consumption
        (trainable groups per second below what the trainer trains per second of its own
        compute, as after a rollout scale-down), the next step fetches toward B_min — what is
        ready beyond B_min less one micro-batch left as a reservoir, so the step after starts
        with data instead of waiting. Off when B_min = B_ideal."""
        c = self.cfg
        b_min = c.min_groups_per_step or c.groups_per_step
        compute = max(out["step_time"] - out["twt"], 1e-6) / max(1, len(out["taken"]))
        self._t_group = compute if self._t_group is None else 0.7 * self._t_group + 0.3 * compute
        sustains = not r.gen_rate == r.gen_rate or r.gen_rate * self._t_group >= 1.0
        self._fetch = c.groups_per_step if b_min >= c.groups_per_step or sustains else max(
            b_min, min(c.groups_per_step, r.volume_next - c.groups_per_microbatch))

    def _roles_record(self, out: dict) -> dict:
        """Roles, the RA2P choice and the plan of this boundary, for the step record."""
        cells, a, plan = self.roles.cells, self._advice, out.get("plan")
        now = self._compile_stats()
        delta = {f"{k}_step": v - self._compiles_at.get(k, 0) for k, v in now.items()}
        self._compiles_at = now
        return {
            "rollout_cells": cells.count("rollout"), "trainer_cells": cells.count("trainer"),
            "ref_cells": cells.count("ref"), "ref_mode": self.roles.ref_mode,
            "rollout_ranks": sum(r is not None and r.live for r in self.manager.ranks),
            "trainer_ranks": cells.count("trainer"),
            "ra2p_advice": a.mode if a is not None else None,
            "c_dec": a.c_dec if a is not None else None,
            "c_col": a.c_col if a is not None else None,
            "ra2p_reason": a.reason if a is not None else None,
            "plan_rule": plan.rule if plan is not None else None,
            "plan_reason": plan.reason if plan is not None else None,
            "plan_effect": getattr(plan, "effect", None) or None,
            "role_change_s": out.get("change_s", 0.0), "fetch_next": self._fetch, **delta}
