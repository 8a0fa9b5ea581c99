"""Peak host memory of a Qwen2.5-0.5B-shaped policy on CPU: one rollout turn and one train step.

A random-initialised `Decoder` with Qwen2.5-0.5B's shape (vocab 151,936, d_model 896, 24 layers,
14/2 heads, head_dim 64, mlp 4,864, qkv bias, tied embeddings: 494M parameters) on one CPU
device. Each variant runs in a fresh subprocess (ru_maxrss never decreases), one at a time:

1. init: params (jitted init) and the AdamW state (`tx.init`), the train state the step donates;
2. rollout: an `Engine` on serving weights made from the params as launch makes them
   (`models.policy.serving_params`: per layer, matrices in the compute dtype) with a small KV
   pool; prefill of a 48-token prompt and 8 decode steps; engine and serving weights are then
   dropped;
3. train: one GRPO step of 4 × 1,024 tokens through the trainer's jitted kernels
   (`ref_actor.make_kernels`): the Actor forward returning its vjp, the deferred backward into a
   gradient sum, scale_grads + AdamW apply (sum and state donated). kl_coef = 0 as in the
   embedded default, so no Ref forward and no Ref params (`TrainerBackend` keeps no Ref copy
   then either).

Variants: `scan-*` stack the layers (model.scan_layers) with the rematerialising scan and
128-token chunks (trainer.token_chunk; `*-a32-*` 32); `*-g6-*` keep only every 6th layer input
(trainer.remat_group=6: 4 + 6 saved inputs instead of 24; `*-g4-*` every 4th: 6 + 4);
`unrolled-*` remat each block of an unrolled stack; `*-unchunked-*` use the whole-batch head
(trainer.head_chunk=0), the others 256-token chunks. Each child starts as launch does with
trainer.remat on the CPU: XLA's memory-ordered scheduler, glibc's mmap threshold fixed and the
heap trimmed after every compilation (`--malloc threshold` leaves out the trim, `--malloc
default` both, for comparison).

Reported per variant: bytes of params + optimizer state, the peak RSS sampled within each
phase, and peak / (params + optimizer). A watchdog ends a child whose RSS passes
--rss-limit-gb (the box is shared); such a variant is reported with a lower bound of its peak:
the larger of its RSS when ended and XLA's compile-only count of its backward (train state,
vjp residuals, gradient, temporaries; `--analyze`), and a chunked/unchunked ratio taken
against that bound is an upper bound (`unchunked_peak_is_lower_bound`).

    python benchmarks/memory.py                       # the default variant set
    python benchmarks/memory.py --variants scan-fp32,unrolled-fp32
    python benchmarks/memory.py --layers 2 --tokens 256   # a quick smoke run
    python benchmarks/memory.py --analyze --variants scan-fp32   # compile-only sizes

The last line is one JSON object with `peak_over_state` (the first variant's) and
`chunked_over_unchunked_peak` (first chunked vs first unchunked variant, when both ran or the
unchunked one has its bound).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = {
    # name: trainer/model settings. `scan`: model.scan_layers; `attn`: trainer.token_chunk;
    # `group`: trainer.remat_group (1 when absent).
    "scan-g4-a32-fp32": dict(head_chunk=256, remat=True, scan=True, attn=32,
                             compute="float32", group=4),
    "scan-g4-a32-unchunked-fp32": dict(head_chunk=0, remat=True, scan=True, attn=32,
                                       compute="float32", group=4),
    "scan-g6-fp32": dict(head_chunk=256, remat=True, scan=True, attn=128, compute="float32",
                         group=6),
    "scan-fp32": dict(head_chunk=256, remat=True, scan=True, attn=128, compute="float32"),
    "scan-g6-unchunked-fp32": dict(head_chunk=0, remat=True, scan=True, attn=128,
                                   compute="float32", group=6),
    "scan-unchunked-fp32": dict(head_chunk=0, remat=True, scan=True, attn=128,
                                compute="float32"),
    "scan-bf16c": dict(head_chunk=256, remat=True, scan=True, attn=128, compute="bfloat16"),
    # Before scanned layers and chunked attention: an unrolled stack of remat'd blocks.
    "unrolled-fp32": dict(head_chunk=256, remat=True, scan=False, attn=0, compute="float32"),
    "unrolled-bf16c": dict(head_chunk=256, remat=True, scan=False, attn=0, compute="bfloat16"),
}
DEFAULT = "scan-g4-a32-fp32,scan-g4-a32-unchunked-fp32,scan-g6-fp32"


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


_PHASE = {"name": "start", "peaks": {}}


def _watchdog(limit: int) -> None:
    """Ends the child past `limit` bytes of RSS; records each phase's sampled peak RSS."""

    def run():
        while True:
            rss = _rss_now()
            peaks = _PHASE["peaks"]
            peaks[_PHASE["name"]] = max(peaks.get(_PHASE["name"], 0), rss)
            if rss > limit:
                print(json.dumps({"over_limit": True, "rss": rss, "phase": _PHASE["name"]}),
                      flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=run, daemon=True).start()


def _phase(name: str) -> None:
    peaks = _PHASE["peaks"]
    peaks[_PHASE["name"]] = max(peaks.get(_PHASE["name"], 0), _rss_now())
    _PHASE["name"] = name


def _configs(name: str, layers: int):
    from tiderl.models.config import ModelConfig
    from tiderl.train.config import TrainerConfig

    v = VARIANTS[name]
    mcfg = ModelConfig(vocab_size=151936, d_model=896, n_layers=layers, n_heads=14,
                       n_kv_heads=2, head_dim=64, mlp_dim=4864, qkv_bias=True,
                       tie_embeddings=True, rope_theta=1e6, max_seq_len=32768,
                       param_dtype="float32", compute_dtype=v["compute"],
                       scan_layers=v["scan"])
    tcfg = TrainerConfig(kl_coef=0.0, entropy_coef=0.03, entropy_max=2.3,
                         head_chunk=v["head_chunk"], remat=v["remat"],
                         token_chunk=v["attn"], remat_group=v.get("group", 1), lr=1e-6)
    return v, mcfg, tcfg


def _batch(rows: int, t: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(1)
    seg = np.ones((rows, t), np.int32)
    seg[:, t // 2:] = 2  # two packed sequences per row
    pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(rows, 0)
    mask = np.zeros((rows, t), np.float32)
    mask[:, t // 4: t // 2] = mask[:, 3 * t // 4:] = 1.0
    return {
        "tokens_bt": rng.integers(0, vocab, (rows, t)).astype(np.int32),
        "positions_bt": pos.astype(np.int32), "segment_ids_bt": seg,
        "loss_mask_bt": mask,
        "behaviour_logprobs_bt": np.full((rows, t), -11.9, np.float32) * mask,
        "advantages_bt": rng.standard_normal((rows, t)).astype(np.float32) * mask,
        "versions_bt": np.zeros((rows, t), np.int32),
    }


def child(args: argparse.Namespace) -> None:
    _watchdog(int(args.rss_limit_gb * 2**30))
    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.malloc != "default":  # as launch does with trainer.remat on the CPU (tiderl.runtime.devices)
        from tiderl.runtime.platforms import cpu_low_memory_malloc

        cpu_low_memory_malloc(trim=args.malloc == "tuned")
    from tiderl.models.policy import abstract_policy, init_policy, serving_config, serving_params
    from tiderl.models.sharding import make_mesh
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine
    from tiderl.train.grpo import LossSpec
    from tiderl.train.ref_actor import make_kernels, make_optimizer, train_shardings

    v, mcfg, tcfg = _configs(args.child, args.layers)
    out: dict = {"variant": args.child, **v, "layers": args.layers, "tokens": args.tokens}
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    mesh = make_mesh(jax.devices()[:1], data=1)
    jax.block_until_ready(jnp.ones(8) + 1)  # the backend is up: the process's own footprint
    out["rss_process"] = _rss_now()
    t0 = time.perf_counter()

    # --- init: params and the AdamW state, the train state the step donates -----------------
    _phase("init")
    graphdef, params = init_policy(mcfg, seed=0, mesh=mesh)
    tx = make_optimizer(tcfg)
    sh = train_shardings(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                        tx, mesh)
    opt = jax.jit(tx.init, out_shardings=sh.state["opt"])(params)
    state = {"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)}
    del params, opt
    jax.block_until_ready(state)
    out["n_params"] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    out["params_bytes"] = nbytes(state["params"])
    out["state_bytes"] = nbytes(state["params"]) + nbytes(state["opt"])
    out["rss_after_init"] = _rss_now()

    # --- rollout turn: an engine on serving weights (per layer, compute dtype), as launch
    # feeds its engines (`TrainerBackend.export_weights`); dropped before training ------------
    _phase("rollout")
    rcfg = RolloutConfig(page_size=16, num_pages=32, max_slots=2, max_context=256,
                         max_action_tokens=8, decode_buckets=(1, 2), prefill_buckets=(64,))
    weights = jax.jit(lambda p: serving_params(p, mcfg))(state["params"])
    out["serving_bytes"] = nbytes(weights)
    eng = Engine(abstract_policy(serving_config(mcfg))[0], weights, mcfg, rcfg, seed=0)
    dstate = eng.init_decode_state()
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, mcfg.vocab_size, 48)]
    p = eng.prefill(weights, None, prompt, len(prompt), task_id=1)
    dstate = eng.insert(p, dstate)
    while p.decoding:
        dstate, _ = eng.generate(None, dstate)
    out["action_tokens"] = len(p.action_tokens)
    del eng, dstate, p, weights
    gc.collect()  # the engine holds reference cycles: dropped means collected
    out["t_rollout"] = time.perf_counter() - t0

    # --- one train step: 4 rows × `tokens` through the trainer's kernels ---------------------
    _phase("actor_fwd")
    batch = jax.device_put(_batch(4, args.tokens, mcfg.vocab_size), sh.batch)
    k = make_kernels(graphdef, tx, LossSpec.from_config(tcfg), 1.0, sh,
                     head_chunk=tcfg.head_chunk, remat=tcfg.remat,
                     token_chunk=tcfg.token_chunk, remat_group=tcfg.remat_group)
    t1 = time.perf_counter()
    outs, vjp = jax.block_until_ready(k.actor_forward(state["params"], batch))
    out["residual_bytes"] = nbytes(vjp.residuals)
    _phase("backward")
    grads, metrics = jax.block_until_ready(k.backward(  # None: the step's first micro-batch
        vjp, outs, jnp.zeros_like(batch["loss_mask_bt"]), batch, jnp.int32(0), None))
    del vjp, outs
    out["grads_bytes"] = nbytes(grads)
    _phase("apply")
    grads, gnorm = k.scale_grads(grads, jnp.float32(max(float(batch["loss_mask_bt"].sum()), 1)))
    state = jax.block_until_ready(k.apply(state, grads))
    del grads
    _phase("end")
    out["t_train"] = time.perf_counter() - t1
    out["grad_norm"] = float(gnorm)
    out["loss_sum"] = float(metrics["loss_sum"])
    out["phase_peaks"] = {k_: v_ for k_, v_ in _PHASE["peaks"].items() if k_ != "end"}
    out["peak"] = max(_maxrss(), *out["phase_peaks"].values())
    out["peak_over_state"] = out["peak"] / out["state_bytes"]
    print(json.dumps(out), flush=True)


def analyze(args: argparse.Namespace) -> None:
    """Compile-only: XLA's own sizes (arguments, outputs, temporaries) of each train kernel at
    the real shape, per variant, without running anything (no memory needed for the data)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tiderl.models.policy import policy_class
    from tiderl.models.sharding import make_mesh
    from tiderl.train.grpo import LossSpec
    from tiderl.train.ref_actor import make_kernels, make_optimizer, train_shardings

    gib, sds = 2**30, jax.ShapeDtypeStruct
    for name in args.variants.split(","):
        _, mcfg, tcfg = _configs(name, args.layers)
        graphdef, ap = nnx.split(nnx.eval_shape(
            lambda mcfg=mcfg: policy_class(mcfg)(mcfg, rngs=nnx.Rngs(0))))
        ap = jax.tree.map(lambda x: sds(x.shape, x.dtype), ap)
        mesh = make_mesh(jax.devices()[:1], data=1)
        tx = make_optimizer(tcfg)
        sh = train_shardings(ap, tx, mesh)
        k = make_kernels(graphdef, tx, LossSpec.from_config(tcfg), 1.0, sh,
                         head_chunk=tcfg.head_chunk, remat=tcfg.remat,
                         token_chunk=tcfg.token_chunk, remat_group=tcfg.remat_group)
        rows, t = 4, args.tokens
        ints = {"tokens_bt", "positions_bt", "segment_ids_bt", "versions_bt"}
        batch = {key: sds((rows, t), jnp.int32 if key in ints else jnp.float32)
                 for key in ("tokens_bt", "positions_bt", "segment_ids_bt", "loss_mask_bt",
                             "behaviour_logprobs_bt", "advantages_bt", "versions_bt")}
        outs, vjp = jax.eval_shape(k.actor_forward, ap, batch)
        state = jax.eval_shape(lambda p: {"params": p, "opt": tx.init(p),  # noqa: B023
                                          "step": jnp.zeros((), jnp.int32)}, ap)
        lowered = {
            "backward": k.backward.lower(vjp, outs, sds((rows, t), jnp.float32), batch,
                                         sds((), jnp.int32), None),
            "scale": k.scale_grads.lower(ap, sds((), jnp.float32)),
            "apply": k.apply.lower(state, ap),
        }
        nb = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
        res = nb(vjp.residuals)
        print(f"{name}: vjp residuals (params excluded) {res / gib:.2f} GiB", flush=True)
        for kname, low in lowered.items():
            m = low.compile().memory_analysis()
            print(f"  {kname:9} args {m.argument_size_in_bytes / gib:6.2f}  out "
                  f"{m.output_size_in_bytes / gib:6.2f}  aliased {m.alias_size_in_bytes / gib:6.2f}"
                  f"  temp {m.temp_size_in_bytes / gib:6.2f} GiB", flush=True)
            if kname == "backward":
                # What XLA counts live during the backward: the train state, the residuals,
                # the gradient and its temporaries (no process, compiler or allocator bytes).
                bwd = nb(state) + res + m.output_size_in_bytes + m.temp_size_in_bytes
        print(json.dumps({"variant": name, "xla_backward_bytes": bwd,
                          "state_bytes": nb(state["params"]) + nb(state["opt"])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=DEFAULT,
                    help=f"comma-separated, from: {', '.join(VARIANTS)}")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per row (4 rows)")
    ap.add_argument("--rss-limit-gb", type=float, default=18.0)
    ap.add_argument("--analyze", action="store_true",
                    help="compile only: XLA's temp/argument sizes of the train kernels")
    ap.add_argument("--concurrent-scheduler", action="store_true",
                    help="keep XLA:CPU's default concurrency-ordered scheduler (launch turns it "
                         "off with trainer.remat; --analyze follows XLA_FLAGS as set)")
    ap.add_argument("--malloc", choices=("tuned", "threshold", "default"), default="tuned",
                    help="tuned: as launch does with trainer.remat on the CPU "
                         "(tiderl.runtime.platforms.cpu_low_memory_malloc: glibc's mmap threshold fixed "
                         "and malloc_trim after every compilation); threshold: the fixed "
                         "threshold alone; default: glibc's own dynamic threshold")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.analyze:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tiderl
        analyze(args)
        return
    if args.child:
        child(args)
        return
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tiderl.runtime.devices import CPU_LOW_MEMORY_FLAG

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)  # one real CPU device, no fake devices
    if not args.concurrent_scheduler:  # as launch does with trainer.remat (tiderl.runtime.devices)
        env["XLA_FLAGS"] = CPU_LOW_MEMORY_FLAG
    results = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            sys.exit(f"--variants: unknown {name!r}; pick from {', '.join(VARIANTS)}")
        cmd = [sys.executable, __file__, "--child", name, "--layers", str(args.layers),
               "--tokens", str(args.tokens), "--rss-limit-gb", str(args.rss_limit_gb),
               "--malloc", args.malloc]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {}
        if proc.returncode or "peak" not in res:
            res = {"variant": name, "failed": proc.returncode, **res,
                   "stderr": proc.stderr.strip().splitlines()[-3:]}
        if res.get("over_limit"):
            # Its peak is not measured; XLA's own count (compile only) bounds it from below.
            an = subprocess.run([sys.executable, __file__, "--analyze", "--variants", name,
                                 "--layers", str(args.layers), "--tokens", str(args.tokens)],
                                env=env, capture_output=True, text=True)
            est = [json.loads(ln) for ln in an.stdout.splitlines() if ln.startswith("{")]
            res["peak_at_least"] = max([res["rss"]] + [e["xla_backward_bytes"] for e in est])
        results.append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
    gib = 2**30
    phases = ("init", "rollout", "actor_fwd", "backward", "apply")
    print(f"{'variant':20} {'state':>6} {'process':>7} " + " ".join(f"{p:>9}" for p in phases)
          + f" {'peak':>6} {'peak/state':>10} {'t_train s':>9}   (GiB; phase columns: "
          "peak RSS sampled within each phase)")
    for r in results:
        if "peak" not in r:
            why = (f"over --rss-limit-gb in phase {r.get('phase')}; peak at least "
                   f"{r['peak_at_least'] / gib:.2f} GiB (the larger of the RSS when ended and "
                   "XLA's compile-only count of the backward)" if r.get("over_limit") else r)
            print(f"{r['variant']:20} failed: {why}")
            continue
        pk = r["phase_peaks"]
        print(f"{r['variant']:20} {r['state_bytes'] / gib:6.2f} {r['rss_process'] / gib:7.2f} "
              + " ".join(f"{pk.get(p, 0) / gib:9.2f}" for p in phases)
              + f" {r['peak'] / gib:6.2f} {r['peak_over_state']:10.3f} {r['t_train']:9.1f}")
    for r in results:
        if "peak" in r:
            print(f"  {r['variant']}: params {r['params_bytes'] / gib:.2f}, optimizer "
                  f"{(r['state_bytes'] - r['params_bytes']) / gib:.2f}, gradient "
                  f"{r['grads_bytes'] / gib:.2f}, vjp residuals {r['residual_bytes'] / gib:.2f}, "
                  f"serving weights {r['serving_bytes'] / gib:.2f} GiB")
    ok = [r for r in results if "peak" in r]
    chunked = next((r for r in ok if r["head_chunk"]), None)
    # An unchunked variant over the limit counts with its lower bound: the ratio is then an
    # upper bound (`unchunked_peak_is_lower_bound`).
    unchunked = next((r for r in results if not VARIANTS[r["variant"]]["head_chunk"]
                      and ("peak" in r or "peak_at_least" in r)), None)
    un_peak = unchunked and unchunked.get("peak", unchunked.get("peak_at_least"))
    summary = {
        "peak_over_state": ok[0]["peak_over_state"] if ok and ok[0] is results[0] else None,
        "chunked_over_unchunked_peak": (chunked["peak"] / un_peak
                                        if chunked and unchunked else None),
        "unchunked_peak_is_lower_bound": bool(unchunked and "peak" not in unchunked),
        "variants": {r["variant"]: round(r["peak_over_state"], 3) if "peak" in r else None
                     for r in results},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
