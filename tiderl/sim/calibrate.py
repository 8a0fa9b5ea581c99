"""`python -m tiderl.sim.calibrate`: micro-benchmarks of the real engine and trainer on this
machine, fitted into the `cpu-fitted` profile.

The job calibrated is the one `python -m tiderl.sim.validate` runs (the embedded default model
and rollout/trainer settings, see `VALIDATION_OVERRIDES`). Measured (`tiderl.sim.microbench`)
on a grid of shapes, each point a median over repeats after a warm-up (the machine is shared, so
single timings are noisy; the spread of the repeats is reported as the noise):

- engine `prefill_many` over (rows, new tokens, cached prefix) and `generate` over (rows,
  context): the rank's own calls, with their bucketing and padding;
- trainer Ref forward, Actor forward, Actor backward over micro-batch sizes, and the update;
- a weight sync (export, copy to the rollout device, `update_weights`);
- the host work of an environment call, in situ: the event loop's CPU seconds per call of the
  rollout manager, scheduler and rank playing groups with the env over HTTP, less the same
  groups with the adapter called in-process (`tiderl.sim.hostcost`; one call timed alone, the
  old measure, costs less and is kept in the notes). `--host-only` measures just this one
  (no JAX), and the same calls with the env served by a process of its own (the client's
  share on the loop, `env_client`, and the server process's CPU, `env_server`), and updates
  the profile in place.

The machine's speed drifts from one minute to the next on a shared VM, so the speed probe
(`tiderl.sim.speed.SpeedProbe`, one fixed Ref forward) is timed right after every engine and
trainer sample, each sample is put at the probe's median speed before the fit
(`at_one_speed`), and that median is kept (`notes.speed_probe`): the validator scales the
profile to the speed its real runs were made at.

Each operation's `c0 + max(work_flops / r_flops, work_hbm / r_hbm)` is fitted by least squares
on relative error, with the work computed by `tiderl.sim.costs` exactly as the simulator
computes it (so the fit also absorbs what the work formulas miss). The per-operation MAPE and
noise are printed and stored in the profile's notes; the last stdout line is one JSON object.

This module imports JAX inside `main` only (the package stays JAX-free).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.sim.costs import PROFILES, OpCost, Profile, SimCostModel, model_shape, profile_from_dict
from tiderl.sim.hostcost import env_call_note, env_served_note, host_only, write_profile
from tiderl.sim.microbench import (
    contention,
    engine_samples,
    env_times,
    sample_samples,
    sync_times,
    trainer_samples,
)
from tiderl.sim.speed import SpeedProbe

PROBE_LOCAL_CALLS = 5
"""Calls of the speed probe after each sample (about 60 ms on a 2-core VM)."""

VALIDATION_OVERRIDES = [
    "controller.groups_per_step=4", "controller.groups_per_microbatch=1",
    "controller.eval_every=0", "controller.console=false", "controller.checkpoint_every=0",
    # The paper's pipeline has a Ref phase (a KL term); the embedded default has none.
    "trainer.kl_coef=0.001",
    # A heavy-tailed environment (Pareto, scale 20 ms, alpha 1.5, capped at 5 s).
    "env.latency.dist=pareto", "env.latency.scale_s=0.02", "env.latency.alpha=1.5",
    "env.latency.cap_s=5.0",
    # Seed order, which the JAX-free twin replays without grain's shuffle.
    "env.shuffle=false",
]


# -- fitting ----------------------------------------------------------------------------------
def predict(theta: Sequence[float], works: Sequence[dict[str, float]]) -> float:
    c0, rf, rh = theta
    return sum(c0 + max(w.get("flops", 0.0) / rf, w.get("hbm", 0.0) / rh) for w in works)


def fit_op(samples: Sequence[tuple[Sequence[dict[str, float]], float]]) -> tuple[OpCost, float]:
    """Fits `c0 + max(flops/r_f, hbm/r_h)` (summed over a call's rounds) to (works, seconds);
    returns the cost and its MAPE over the samples."""
    from scipy.optimize import least_squares

    ys = [y for _, y in samples]
    nrounds = [len(w) for w, _ in samples]
    c0_init = min(y / n for y, n in zip(ys, nrounds, strict=True)) * 0.5
    fl = [sum(x.get("flops", 0.0) for x in w) for w, _ in samples]
    hb = [sum(x.get("hbm", 0.0) for x in w) for w, _ in samples]
    rf0 = max(fl) / max(max(ys) - c0_init, 1e-9)
    rh0 = max(hb) / max(max(ys) - c0_init, 1e-9)

    def resid(log_theta):
        th = [math.exp(v) for v in log_theta]
        return [(predict(th, w) - y) / y for w, y in samples]

    best = None
    for scale in (0.3, 1.0, 3.0):  # a few starts: the max() makes the loss piecewise
        x0 = [math.log(max(c0_init, 1e-7)), math.log(rf0 * scale), math.log(rh0 * scale)]
        r = least_squares(resid, x0, loss="soft_l1", f_scale=0.2)
        if best is None or r.cost < best.cost:
            best = r
    c0, rf, rh = (math.exp(v) for v in best.x)
    mape = statistics.fmean(abs(e) for e in resid(best.x))
    return OpCost(c0, (("flops", rf), ("hbm", rh))), mape


def fit_rows(samples: Sequence[tuple[int, float]], bytes_per_row: float
             ) -> tuple[OpCost, float]:
    """`c0 + rows * bytes_per_row / rate` fitted by least squares to (rows, seconds); the
    rate is an `hbm` rate (bytes a row reads per second). Returns the cost and its MAPE."""
    xs = [float(n) for n, _ in samples]
    ys = [y for _, y in samples]
    slope, c0 = statistics.linear_regression(xs, ys)
    slope, c0 = max(slope, 1e-9), max(c0, 0.0)
    cost = OpCost(c0, (("hbm", bytes_per_row / slope),))
    mape = statistics.fmean(abs(c0 + slope * x - y) / y for x, y in zip(xs, ys, strict=True)
                            if y > 0)
    return cost, mape


def fit_constant(ys: Sequence[float]) -> tuple[OpCost, float]:
    c0 = statistics.median(ys)
    return OpCost(c0), statistics.fmean(abs(y - c0) / y for y in ys)


def calibrate(*, repeats: int, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measures and fits; returns (the profile as a dict, a report)."""
    import jax

    from tiderl.config import load_config
    from tiderl.runtime.build import build

    cfg = load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-calibrate"])
    devices, plan, meshes, graphdef, params = build(cfg)
    r = cfg.rollout
    engine_rules = {"padded": True, "prefill_buckets": list(r.prefill_buckets),
                    "decode_buckets": list(r.decode_buckets), "max_context": r.max_context,
                    "decode_steps_per_call": 1}
    tiny = model_shape("tiny")
    if (tiny.d_model, tiny.n_layers, tiny.vocab) != (cfg.model.d_model, cfg.model.n_layers,
                                                     cfg.model.vocab_size):
        raise RuntimeError("the 'tiny' sim model no longer matches the embedded default model; "
                           "update tiderl/sim/costs.py MODELS['tiny']")
    # Work formulas only need the engine rules; rates are what we fit.
    shell = Profile("shell", "fitted", {"prefill": OpCost(), "decode": OpCost()}, None,
                    profile_from_dict({"kind": "fitted", "engine": engine_rules}).engine, {})
    costs = SimCostModel(shell, tiny)
    t0 = time.perf_counter()
    probe = SpeedProbe(cfg)  # the machine's speed beside every sample (tiderl.sim.speed)

    def local() -> float:
        return probe(calls=PROBE_LOCAL_CALLS)

    eng = engine_samples(cfg, graphdef, params, devices[plan.rollout[0][0]], costs, repeats,
                         quick, probe=local)
    tr = trainer_samples(cfg, graphdef, params, meshes, costs, repeats, quick, probe=local)
    probe_s = at_one_speed(eng, tr)
    probe.close()
    sync = sync_times(tr["backend"], devices[plan.rollout[0][0]], cfg, graphdef, params,
                      repeats)
    host = contention(cfg, graphdef, params, devices[plan.rollout[0][0]], tr["backend"],
                      repeats)
    tr["backend"].close()
    alone = env_times(cfg, repeats)
    extra = engine_host(cfg, graphdef, params, devices[plan.rollout[0][0]], repeats)
    ops: dict[str, dict[str, float]] = {}
    report: dict[str, Any] = {"mape": {}, "noise": {}, "samples": {}}
    for group in (eng, tr):
        for name, samples in group["samples"].items():
            cost, mape = fit_op([(w, y) for w, y, _ in samples])
            ops[name] = {"c0": cost.c0, **dict(cost.rates)}
            report["mape"][name] = mape
            report["noise"][name] = statistics.median(group["noise"][name])
            report["samples"][name] = [{**meta, "seconds": y,
                                        "fit": predict((cost.c0, cost.rate("flops"),
                                                        cost.rate("hbm")), w)}
                                       for w, y, meta in samples]
    for name, ys in (("apply", tr["apply"]), ("weight_sync", sync)):
        cost, mape = fit_constant(ys)
        ops[name] = {"c0": cost.c0}
        report["mape"][name] = mape
        q = sorted(ys)
        report["noise"][name] = (q[(3 * len(q)) // 4] - q[len(q) // 4]) / cost.c0
    env = env_call_note(cfg, ops, engine_rules, groups=8 if quick else 16,
                        repeats=min(repeats, 3))
    env["alone_ms"] = round(statistics.median(alone) * 1e3, 4)
    ops["env_call"] = {"c0": env["seconds"]}
    served = env_served_note(cfg, ops, engine_rules, groups=8 if quick else 16,
                             repeats=min(repeats, 3))
    ops["env_client"], ops["env_server"] = ({"c0": served["client_s"]},
                                            {"c0": served["server_s"]})
    ops["sample"] = extra["sample"]
    # No offload on the CPU (host memory is the device memory) and no separate Ref devices.
    ops.update({"swap": {"c0": 0.0}, "role_change": {"c0": 0.0}, "context_switch": {"c0": 0.0}})
    profile = {
        "name": "cpu-fitted", "kind": "fitted",
        "engine": engine_rules, "ops": ops,
        "host": {"capacity": host["capacity"]},
        "notes": {
            "fitted_by": "python -m tiderl.sim.calibrate" + (" --quick" if quick else ""),
            "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": repeats,
            "jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].platform}",
            "seconds": round(time.perf_counter() - t0, 1),
            "mape": {k: round(v, 4) for k, v in report["mape"].items()},
            "noise_iqr_over_median": {k: round(v, 4) for k, v in report["noise"].items()},
            "slowdown_trainer_beside_rollout": round(host["slowdown_trainer"], 3),
            "slowdown_rollout_beside_trainer": round(host["slowdown_rollout"], 3),
            "env_call": env,
            "env_served": served,
            "sample": extra["sample_note"],
            "speed_probe": speed_note(probe_s),
        },
    }
    return profile, report


def engine_host(cfg: Any, graphdef: Any, params: Any, device: Any, repeats: int
                ) -> dict[str, Any]:
    """The engine's siblings sampled from a sibling's logits (`ops.sample`), fitted. (Its
    other host-side cost, the wait for the interpreter lock in the job, needs the real job:
    `python -m tiderl.sim.validate --measure-lock-wait`.)"""
    samples = sample_samples(cfg, graphdef, params, device, repeats)
    cost, mape = fit_rows(samples, cfg.model.vocab_size * 4.0)
    return {"sample": {"c0": cost.c0, **dict(cost.rates)},
            "sample_note": {"mape": round(mape, 4),
                            "ms_by_siblings": {n: round(y * 1e3, 4) for n, y in samples}}}


def at_one_speed(*groups: dict[str, Any]) -> list[float]:
    """Puts the engine's and the trainer's samples at one speed of the machine: each sample's
    seconds times the median probe over its own probe (`meta["probe_s"]`, timed right after
    it), so a sample taken while the machine ran slow (a shared VM drifts by tens of percent
    within minutes) counts at the speed of the rest. Returns the probes."""
    probes = [meta["probe_s"] for g in groups for samples in g["samples"].values()
              for _, _, meta in samples if meta.get("probe_s")]
    if not probes:
        return []
    ref = statistics.median(probes)
    for g in groups:
        for name, samples in g["samples"].items():
            g["samples"][name] = [(w, y * ref / meta["probe_s"], meta)
                                  if meta.get("probe_s") else (w, y, meta)
                                  for w, y, meta in samples]
    return probes


def speed_note(probes: Sequence[float]) -> dict[str, Any]:
    """`notes.speed_probe`: the probe's median over the calibration's samples, the speed the
    fitted costs are at and the validator scales the profile from."""
    q = sorted(probes)
    return {"seconds": statistics.median(q), "samples": len(q),
            "p10_ms": round(q[len(q) // 10] * 1e3, 3),
            "p90_ms": round(q[(9 * len(q)) // 10] * 1e3, 3),
            "measured_by": f"tiderl.sim.speed.SpeedProbe: median of {PROBE_LOCAL_CALLS} Ref "
                           "forwards of one fixed 16x128 micro-batch, right after each engine "
                           "and trainer sample; each sample is fitted at this median speed"}


def keep_lock_wait(path: Path, profile: dict[str, Any]) -> None:
    """A refit keeps the profile's measured lock wait (`host.lock_wait_s`, from the real job:
    `python -m tiderl.sim.validate --measure-lock-wait`), which no micro-benchmark gives."""
    import yaml

    if not path.is_file():
        return
    old = yaml.safe_load(path.read_text()) or {}
    if (w := (old.get("host") or {}).get("lock_wait_s")) is not None:
        profile["host"]["lock_wait_s"] = w
        profile["notes"]["lock_wait"] = (old.get("notes") or {}).get("lock_wait")


def engine_host_only(path: Path, *, repeats: int) -> dict[str, Any]:
    """Re-measures the siblings' sampling (`engine_host`) and rewrites it in place; the other
    fits are kept."""
    import yaml

    from tiderl.config import load_config
    from tiderl.runtime.build import build

    cfg = load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-calibrate"])
    devices, plan, _, graphdef, params = build(cfg)
    extra = engine_host(cfg, graphdef, params, devices[plan.rollout[0][0]], repeats)
    d = yaml.safe_load(path.read_text())
    d["ops"]["sample"] = extra["sample"]
    d.setdefault("notes", {})["sample"] = extra["sample_note"]
    write_profile(path, d)
    return extra


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiderl.sim.calibrate", description=__doc__
                                .split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="a small grid, 3 repeats")
    p.add_argument("--out", default=str(PROFILES / "cpu-fitted.yaml"))
    p.add_argument("--engine-host-only", action="store_true",
                   help="re-measure only the siblings' sampling from kept logits (ops.sample) "
                        "and update --out in place")
    p.add_argument("--host-only", action="store_true",
                   help="re-measure only the host costs (the env call in-process and served, "
                        "no JAX) and update --out in place")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 3
    if args.host_only:
        from tiderl.config import load_config

        cfg = load_config(None, VALIDATION_OVERRIDES + ["run_dir=/tmp/tiderl-calibrate"])
        env = host_only(Path(args.out), cfg, groups=8 if args.quick else 16,
                        repeats=min(args.repeats, 5))
        served = env["served"]
        print(f"env call: {env['seconds'] * 1e3:.3f} ms of event-loop CPU per call in situ "
              f"(spread {env['spread']:.0%}); served by a process of its own: the client "
              f"{served['client_s'] * 1e3:.3f} ms on the loop, the server "
              f"{served['server_s'] * 1e3:.3f} ms; wrote {args.out}")
        print(json.dumps({"profile": args.out, "env_call_s": env["seconds"],
                          "env_client_s": served["client_s"],
                          "env_server_s": served["server_s"],
                          "spread": env["spread"]}))
        return 0

    if args.engine_host_only:
        extra = engine_host_only(Path(args.out), repeats=args.repeats)
        print(f"siblings' sampling {extra['sample_note']['ms_by_siblings']} ms; wrote {args.out}")
        print(json.dumps({"profile": args.out, "sample": extra["sample"]}))
        return 0

    profile, report = calibrate(repeats=args.repeats, quick=args.quick)
    print(f"{'operation':16s} {'samples':>7s} {'MAPE':>7s} {'noise':>7s}   c0 (ms)   "
          "flops/s      bytes/s")
    for name, spec in profile["ops"].items():
        if name not in report["mape"]:
            continue
        n = len(report["samples"].get(name, [])) or "-"
        print(f"{name:16s} {n!s:>7s} {report['mape'][name]:7.1%} {report['noise'][name]:7.1%}"
              f"   {spec['c0'] * 1e3:7.3f}   {spec.get('flops', 0):10.3g}   "
              f"{spec.get('hbm', 0):10.3g}")
    keep_lock_wait(Path(args.out), profile)
    write_profile(Path(args.out), profile)
    n = profile["notes"]
    print(f"shared host: trainer work {n['slowdown_trainer_beside_rollout']:.2f}x slower beside "
          f"rollout (engine + env loop), engine work {n['slowdown_rollout_beside_trainer']:.2f}x"
          f" slower beside the trainer: {profile['host']['capacity']:.2f} effective cores")
    samples = Path(args.out).with_suffix(".samples.json")
    samples.write_text(json.dumps(report["samples"], indent=1))
    print(f"wrote {args.out} (measurements and fits: {samples})")
    print(json.dumps({"profile": args.out, "host": profile["host"],
                      "mape": {k: round(v, 4) for k, v in report["mape"].items()},
                      "noise": {k: round(v, 4) for k, v in report["noise"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
