"""Planners that read no readiness. No JAX.

- `KeepSplit` keeps the cells where they are (every fixed-ratio baseline, and ERS off); with
  `ra2p_live` the RA2P mode still follows the cost model's advice.
- `ScriptedPlanner` (`controller.elastic.script`) replaces the readiness rules by a fixed
  sequence of role maps, one per named boundary, for tests and for replaying a trace;
  `script_steps` parses that script (`ERSConfig` checks it with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.configlib import ConfigError
from tiderl.control.plans import (
    ROLES,
    CellMap,
    ScalingPlan,
    Signals,
    moves_between,
    ref_mode_of,
)


class KeepSplit:
    """Keeps the cells where they are (every fixed-ratio baseline, and ERS off). With
    `ra2p_live`, the RA2P mode follows the cost model's advice (held `patience` boundaries)
    on the cells as they are: a reserved Ref cell serves when decoupled and idles otherwise."""

    def __init__(self, *, ra2p_live: bool = False, patience: int = 2,
                 ref_mode: str | None = None):
        self.ra2p_live = ra2p_live
        self.patience = patience
        self.ref_mode = ref_mode
        self._streak = 0
        self._settle = True  # the run's first boundary (compilation) and one after a switch

    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        have_ref = cells.count("ref") > 0
        mode = self.ref_mode or ("decoupled" if have_ref else "colocated")
        if not self.ra2p_live or not have_ref:
            return ScalingPlan(cells, ref_mode=mode)
        want = signals.ra2p_mode if signals.uses_ref else "colocated"
        if signals.cold_start or self._settle:
            self._settle = signals.cold_start
            self._streak = 0
            return ScalingPlan(cells, ref_mode=mode)
        self._streak = self._streak + 1 if want != mode else 0
        if self._streak >= self.patience:
            self.ref_mode, self._streak, self._settle = want, 0, True
            return ScalingPlan(cells, ref_mode=want, rule="ra2p",
                               reason=f"RA2P: {want} (cost model advice held {self.patience} "
                                      "boundaries); cells unchanged (ERS off)")
        return ScalingPlan(cells, ref_mode=mode)


def script_steps(script: Sequence[str]) -> dict[int, tuple[str, ...]]:
    """`controller.elastic.script` parsed: boundary step → the roles of every cell."""
    out: dict[int, tuple[str, ...]] = {}
    for entry in script:
        step, sep, roles = str(entry).partition(":")
        cells = tuple(r.strip() for r in roles.split(",") if r.strip())
        if not sep or not step.strip().isdigit() or not cells or any(r not in ROLES
                                                                     for r in cells):
            raise ConfigError(f"config key 'controller.elastic.script' entry {entry!r} is not "
                              "'STEP:ROLE,ROLE,...' with roles from " + "/".join(ROLES) +
                              " (e.g. '2:rollout,trainer,trainer,trainer')")
        if "trainer" not in cells:
            raise ConfigError(f"config key 'controller.elastic.script' entry {entry!r} leaves "
                              "no trainer cell; keep at least one")
        if int(step) in out:
            raise ConfigError(f"config key 'controller.elastic.script' names step {step} twice")
        out[int(step)] = cells
    return out


class ScriptedPlanner:
    """Takes the roles `controller.elastic.script` names at its steps, and keeps them
    otherwise (no cold start, no bounds, no hysteresis): a reproducible role sequence."""

    def __init__(self, script: Sequence[str]):
        self.steps = script_steps(script)

    def check(self, cells: CellMap, *, ref_ok: bool = True) -> None:
        """A ConfigError unless every scripted map has one role per cell of `cells` (and,
        `ref_ok` False, no Ref cell)."""
        for step, roles in self.steps.items():
            if len(roles) != len(cells.roles):
                raise ConfigError(
                    f"config key 'controller.elastic.script' step {step} names {len(roles)} "
                    f"cells; this run has {len(cells.roles)} ({','.join(cells.roles)})")
            if not ref_ok and "ref" in roles:
                raise ConfigError(
                    f"config key 'controller.elastic.script' step {step} makes a Ref cell; "
                    "a decoupled Ref is not supported on several processes (use rollout and "
                    "trainer only)")

    def plan(self, signals: Signals, cells: CellMap) -> ScalingPlan:
        roles = self.steps.get(signals.step) if not signals.cold_start else None
        if roles is None or len(roles) != len(cells.roles):
            return ScalingPlan(cells, ref_mode=ref_mode_of(cells))
        after = CellMap(roles)
        return ScalingPlan(after, moves_between(cells, after), rule="scripted",
                           reason=f"scripted (controller.elastic.script, step "
                                  f"{signals.step})", ref_mode=ref_mode_of(after))
