"""Trainer benchmark: deferred-KL step vs the fused `jax.grad` step, and the paper's Figure 14
in small (8 ready micro-batches: VS, VSO, CM, DM), side by side in one process.

    python benchmarks/trainer.py            # CPU: 8 fake devices; GPU: the visible devices

- deferred vs fused: the same micro-batches through `train_step` (Ref fwd, Actor fwd returning
  its vjp, cotangent backward) and through `fused_step` (Ref fwd, `jax.grad` of the fused loss),
  both with the same apply, on one device; medians over interleaved repeats.
- Figure 14: colocated vanilla alternation per micro-batch (VS), the same with offload to
  pinned_host (VSO), colocated ready-batch aggregation with offload (CM; CMk keeps both models
  resident), and decoupled with the Ref on its own devices (DM). Step time, swaps (model moves between device and host memory),
  alternations and per-phase times (from one extra run with blocking phase timings).

On CPU the fake devices share the machine's cores and "pinned_host" is ordinary RAM, so: swaps
are memcpy (not PCIe), the decoupled Ref gets no extra compute (its overlap shows only as hidden
dispatch), and absolute times mean nothing. What the numbers can show is the deferred path's
overhead over fused autodiff, and the count and cost of model moves each schedule incurs. The
last stdout line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--row-len", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 repeat (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.vocab, args.row_len, args.repeats = 64, 1, 256, 64, 1

    import jax

    # Only affects the CPU backend (must precede its start): 8 fake devices there.
    jax.config.update("jax_num_cpu_devices", 8)

    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import init_policy
    from tiderl.models.sharding import make_mesh
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.config import TrainerConfig
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    devs = jax.devices()
    if len(devs) < 2:
        sys.exit("needs ≥ 2 devices (Ref and Actor meshes); on CPU run with JAX_PLATFORMS=cpu")
    half = len(devs) // 2
    d = args.d_model
    mc = ModelConfig(vocab_size=args.vocab, d_model=d, n_layers=args.layers, n_heads=max(1, d // 64),
                     n_kv_heads=max(1, d // 128), head_dim=64 if d >= 64 else d, mlp_dim=4 * d,
                     max_seq_len=args.row_len)
    cfg = TrainerConfig(actor_devices=half, kl_coef=0.01, max_aggregate=16)
    policy = init_policy(mc, seed=0)
    n_params = sum(x.size for x in jax.tree.leaves(policy[1]))
    print(f"devices: {len(devs)} × {devs[0].platform}; model {n_params / 1e6:.2f}M params; "
          f"{args.microbatches} micro-batches of {half} ranks × 2 rows × {args.row_len} tokens")

    def make_mbs(n_ranks: int, seed: int):
        # Fill each rank's 2 rows: lengths between half and a full row.
        n = args.microbatches * n_ranks * 3
        trajs = synthetic_trajectories(n, vocab=args.vocab, min_len=args.row_len // 2,
                                       max_len=args.row_len, seed=seed)
        mbs, _ = microbatches(trajs, n_ranks=n_ranks, row_len=args.row_len, rows_per_rank=2,
                              order="colocated")
        return mbs[: args.microbatches]

    # ---- deferred vs fused, one device ------------------------------------------------------
    one = make_mesh(devs[:1])
    mbs1 = make_mbs(1, seed=1)
    be = TrainerBackend(cfg, mc, actor_mesh=one, policy=policy)
    be.train_step(mbs1)  # compile both paths
    be.fused_step(mbs1)
    t_def, t_fused = [], []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        be.train_step(mbs1)
        t_def.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        be.fused_step(mbs1)
        t_fused.append(time.perf_counter() - t0)
    be.close()
    med_def, med_fused = statistics.median(t_def), statistics.median(t_fused)
    print(f"\nstep over {len(mbs1)} micro-batches, 1 device (median of {len(t_def)}):")
    print(f"  fused jax.grad  {med_fused * 1e3:9.1f} ms   (min {min(t_fused) * 1e3:.1f})")
    print(f"  deferred (vjp)  {med_def * 1e3:9.1f} ms   (min {min(t_def) * 1e3:.1f})   "
          f"ratio {med_def / med_fused:.3f}")

    # ---- Figure 14 in small -----------------------------------------------------------------
    actor = make_mesh(devs[:half], data=half)
    ref = make_mesh(devs[half:2 * half], data=half)
    mbs = make_mbs(half, seed=2)
    modes = {
        "VS": (dict(aggregate=False, offload="never"), None),
        "VSO": (dict(aggregate=False, offload="always"), None),
        "CM": (dict(aggregate=True, offload="always"), None),
        "CMk": (dict(aggregate=True, offload="never"), None),
        "DM": ({}, ref),
    }
    rows, times = {}, {}
    backends = {name: TrainerBackend(dataclasses.replace(cfg, **kw), mc, actor_mesh=actor,
                                     ref_mesh=r, policy=policy)
                for name, (kw, r) in modes.items()}
    for name, b in backends.items():
        b.train_step(mbs)  # compile
        times[name] = []
    for _ in range(args.repeats):
        for name, b in backends.items():  # interleaved, so drift hits every mode alike
            t0 = time.perf_counter()
            m = b.train_step(mbs)
            times[name].append(time.perf_counter() - t0)
            rows[name] = m
    phases = {}
    for name, b in backends.items():
        b.cfg = dataclasses.replace(b.cfg, sync_timings=True)
        phases[name] = b.train_step(mbs)
        b.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # least disturbed by other load on the box
    print(f"\n{len(mbs)} ready micro-batches, {half}-device Actor (+ {half}-device Ref for DM); "
          f"median of {args.repeats} steps:")
    print(f"  {'mode':4} {'step ms':>9} {'vs VS':>6} {'min ms':>8} {'swaps':>6} {'alt':>4} "
          f"{'ref':>7} {'act_f':>7} {'act_b':>7} {'swap':>7} {'apply':>7}  "
          "(phase ms: one more step, blocking after each call)")
    for name in modes:
        p = phases[name]
        print(f"  {name:4} {med[name] * 1e3:9.1f} {med[name] / med['VS']:6.2f} "
              f"{best[name] * 1e3:8.1f} "
              f"{rows[name]['swaps']:6d} {rows[name]['alternations']:4d} "
              + " ".join(f"{p[f'time_{k}'] * 1e3:7.1f}"
                         for k in ("ref", "actor_fwd", "actor_bwd", "swap", "apply")))
    print("  swaps = model moves between device and pinned_host; alt = Ref/Actor phase changes;\n"
          "  CM aggregates with offload (compare with VSO), CMk aggregates keeping both models\n"
          "  resident (compare with VS)")
    out = {
        "deferred_over_fused_step": round(med_def / med_fused, 4),
        "cm_over_vs": round(med["CM"] / med["VS"], 4),
        "dm_over_vs": round(med["DM"] / med["VS"], 4),
        "vso_over_vs": round(med["VSO"] / med["VS"], 4),
        "cm_over_vso": round(med["CM"] / med["VSO"], 4),
        "cmk_over_vs": round(med["CMk"] / med["VS"], 4),
        "min_step_ratios_over_vs": {k: round(best[k] / best["VS"], 4) for k in modes},
        "swaps": {k: rows[k]["swaps"] for k in modes},
        "step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "swap_ms": {k: round(phases[k]["time_swap"] * 1e3, 2) for k in modes},
        "platform": devs[0].platform,
        "params_m": round(n_params / 1e6, 3),
        "microbatches": len(mbs),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
