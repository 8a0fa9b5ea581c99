"""One GPU's check of the tiderl GPU path: decode, prefill, training, offload and a short run.

    python benchmarks/gpu_check.py                  # one H100/H200: a few minutes
    python benchmarks/gpu_check.py --cpu-smoke      # the same code paths at toy sizes, CPU (CI)

Parts, in order (each in a subprocess of its own on the GPU, so a crash, OOM or hang in one is
reported and the others still run; in --cpu-smoke they run in this process):

a. decode, per shape (Qwen2.5-0.5B- and 1.5B-shaped random models, bf16 compute as a run
   serves them) at batch 1/32/128 with 1,024 tokens resident per row: `Engine.generate`
   tokens/s (host bookkeeping and one device→host copy per step included) and the jitted
   decode step alone (dispatched back to back), against the HBM roofline of the bytes one step
   must read (every weight once + each row's K/V); the Pallas decode kernel checked against
   the gather reference on the engine's own pool.
b. prefill, same engines: tokens/s of prefilling batch × 1,024 tokens, and its model FLOPs
   utilisation; then the host KV tier: those contexts evicted to `pinned_host` and restored
   (GB/s each way, the restore's time against the prefill's, restored logprobs checked).
c. train, per shape: `TrainerBackend.train_step` on packed rows (2 micro-batches × 2 rows ×
   4,096 tokens, Ref forward for the KL term, remat, chunked head, fp32 master weights with bf16
   compute): tokens/s and MFU (model FLOPs: 2N per token for the Ref, 6N for the Actor, plus
   causal attention within segments; remat's recomputation is not counted). Beside it each
   training attention kernel (xla, pallas, cudnn) forward+backward on the same packed rows,
   timed and checked against xla.
d. swap: the colocated trainer's offload — `TrainerBackend.swap` of the Actor state (params +
   AdamW moments) and of the Ref params to `pinned_host` and back, GB/s each way, the memory
   kinds and device bytes in use checked; a single large buffer gives the link's ceiling.
e. launch: `python -m tiderl.launch --config configs/gpu-1.yaml` with the 0.5B shape, 20 steps
   of the default task (rollout and training colocated on the one GPU); must finish, no NaN.

A part fails on an error, a timeout, a kernel mismatch beyond its tolerance, or a non-finite
number; performance targets are reported next to the figures, not as failures. Peaks come from
the device kind (H100 SXM/PCIe/NVL, H200, A100) or --peak-tflops / --hbm-gbps. Prints a table;
the last stdout line is one JSON object (`ok`, per-part status and the headline figures). Exit
status 0 when every part passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B / 1.5B (config.json of the released checkpoints), random weights.
    "0.5b": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                 head_dim=64, mlp_dim=4864, qkv_bias=True, tie_embeddings=True,
                 rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6),
    "1.5b": dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                 head_dim=128, mlp_dim=8960, qkv_bias=True, tie_embeddings=True,
                 rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6),
    # --cpu-smoke: the same structure (GQA, qkv bias, tied head), toy sizes.
    "toy": dict(vocab_size=512, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                mlp_dim=128, qkv_bias=True, tie_embeddings=True, rope_theta=1e6,
                max_seq_len=2048, norm_eps=1e-6),
}

# (substring of jax's device_kind, dense bf16 TFLOP/s, HBM GB/s); first match wins.
PEAKS = (("H200", 989.0, 4800.0), ("H100 NVL", 835.0, 3900.0), ("H100 PCIe", 756.0, 2000.0),
         ("H100", 989.0, 3350.0), ("A100", 312.0, 2039.0))

TOL_BF16 = 2e-2
"""Kernel vs reference, bf16 inputs: max |Δ| ≤ TOL_BF16 × max(1, max |reference|) (both round
the q·k and p·v inputs to bf16, at different points)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    platform: str
    batches: tuple[int, ...]
    context: int
    max_context: int
    decode_steps: int
    repeats: int
    row_len: int
    rows: int
    microbatches: int
    head_chunk: int
    launch_steps: int
    big_buffer_mib: int
    peak_tflops: float | None = None
    hbm_gbps: float | None = None


GPU = Settings(platform="gpu", batches=(1, 32, 128), context=1024, max_context=2048,
               decode_steps=32, repeats=3, row_len=4096, rows=2, microbatches=2,
               head_chunk=1024, launch_steps=20, big_buffer_mib=2048)
SMOKE = Settings(platform="cpu", batches=(2,), context=32, max_context=64, decode_steps=2,
                 repeats=1, row_len=64, rows=1, microbatches=2, head_chunk=32, launch_steps=2,
                 big_buffer_mib=8)


# ------------------------------------------------------------------------------ helpers
def _init(s: Settings, cache_dir: str):
    """Starts JAX the way `python -m tiderl.launch` does (tiderl/runtime/platforms.py)."""
    from tiderl.runtime.devices import ClusterConfig, init_jax

    if cache_dir:  # a rerun of the check skips compiling (read when the first compile starts)
        import jax

        jax.config.update("jax_compilation_cache_dir", cache_dir)
    cfg = ClusterConfig(platform=s.platform, fake_cpu_devices=1 if s.platform == "cpu" else 0)
    return init_jax(cfg)[0]


def _peaks(device, s: Settings) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, HBM bytes/s) of `device`, or None where unknown."""
    tf, bw = s.peak_tflops, s.hbm_gbps
    if device.platform == "gpu":
        for key, t, b in PEAKS:
            if key in device.device_kind:
                tf, bw = tf or t, bw or b
                break
    return (tf * 1e12 if tf else None), (bw * 1e9 if bw else None)


def _model_cfg(shape: str, **kw):
    from tiderl.models.config import ModelConfig

    return ModelConfig(**SHAPES[shape], param_dtype="float32", compute_dtype="bfloat16", **kw)


def _nbytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _matmul_params(mcfg) -> int:
    """Parameters that multiply every token (the embedding lookup does not, a tied head does)."""
    m = mcfg
    attn = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    mlp = 3 * m.d_model * m.mlp_dim
    return m.n_layers * (attn + mlp) + m.vocab_size * m.d_model


def _attn_flops_fwd(mcfg, seg_lengths) -> float:
    """Causal attention within segments, one forward: QKᵀ and PV over the lower triangle."""
    return sum(2.0 * n * n * mcfg.n_heads * mcfg.head_dim for n in seg_lengths) * mcfg.n_layers


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def _finite(*xs) -> bool:
    return all(x is not None and math.isfinite(float(x)) for x in xs)


def _median_time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _close(got, want) -> tuple[float, bool]:
    import numpy as np

    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = float(np.max(np.abs(got - want)))
    return err, bool(np.all(np.isfinite(got))) and err <= TOL_BF16 * max(1.0, float(
        np.max(np.abs(want))))


class Result:
    """What a part reports: table rows, metrics for the JSON line, failed checks."""

    def __init__(self, name: str):
        self.name, self.rows, self.metrics, self.failures = name, [], {}, []
        self.device = ""

    def row(self, what: str, value: str, note: str = "") -> None:
        self.rows.append([what, value, note])

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def to_json(self) -> dict:
        return {"part": self.name, "ok": not self.failures, "rows": self.rows,
                "metrics": self.metrics, "failures": self.failures, "device": self.device}


# ------------------------------------------------------------------------------ parts
def _decode_parity(eng, hs, rng):
    """The Pallas decode kernel and the gather reference on the engine's own layer-0 pool,
    with the page tables and lengths it holds for `hs`: (kernel, reference) outputs."""
    import functools

    import jax
    import jax.numpy as jnp

    from tiderl.serving.kv import append_mask, gather_attend, pallas_paged_decode

    m = eng.model_cfg
    table = jnp.asarray(eng.pages.table_array([h.slot for h in hs], len(hs)))
    lengths = jnp.asarray([h.kv_length for h in hs], jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(hs), m.n_heads, m.head_dim)), jnp.bfloat16)
    kp, vp = eng.state.pools.k[0], eng.state.pools.v[0]
    n_keys = table.shape[1] * eng.cfg.page_size

    def reference(q, kp, vp, t, n):
        return gather_attend(q[:, None], kp, vp, t, append_mask((n - 1)[:, None], n,
                                                                n_keys))[:, 0]

    kernel = functools.partial(pallas_paged_decode, interpret=eng.interpret)
    return (jax.jit(kernel)(q, kp, vp, table, lengths),
            jax.jit(reference)(q, kp, vp, table, lengths))


def part_decode(shape: str, s: Settings, cache_dir: str) -> Result:
    """(a) decode tokens/s vs the HBM roofline and kernel parity; (b) prefill tokens/s.

    One engine holds the largest batch's contexts (one prefill compilation); each batch size
    then decodes the first b of them (one decode compilation per bucket)."""
    device = _init(s, cache_dir)
    import jax
    import numpy as np

    from tiderl.models.policy import init_policy
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine, PrefillRequest
    from tiderl.serving.steps import make_step
    from tiderl.serving.weights import serving_weights

    res = Result(f"decode+prefill {shape}")
    res.device = device.device_kind
    flops_peak, bw_peak = _peaks(device, s)
    mcfg = _model_cfg(shape)
    graphdef, params = init_policy(mcfg, seed=0)
    params = serving_weights(params, mcfg)  # what a run's engines hold: bf16 matrices
    weight_bytes = _nbytes(params)
    if not mcfg.tie_embeddings:  # an untied embedding is only gathered, B rows a step
        weight_bytes -= _nbytes(params["embed_vd"])
    kv_per_token = 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * 2  # K+V, bf16
    n_mm = _matmul_params(mcfg)
    res.row("weights read per decode step", _gib(weight_bytes),
            f"{n_mm / 1e6:,.1f}M matmul params")
    rng = np.random.default_rng(0)
    ctx, steps, big = s.context, s.decode_steps, max(s.batches)
    pages_per_row = -(-(ctx + steps * len(s.batches) + 8) // 16)
    # max_context sets the page-table width the kernel splits (2,048 → 128 pages: 16 splits of
    # 8-page blocks); the rows hold ctx tokens.
    # The host KV tier holds every row's context (b'); it is off the decode path.
    rc = RolloutConfig(page_size=16, num_pages=big * pages_per_row + 1, max_slots=big,
                       max_context=s.max_context, max_action_tokens=s.max_context,
                       temperature=1.0, decode_buckets=tuple(sorted(s.batches)),
                       prefill_buckets=(ctx,), prefill_batch=big,
                       host_kv_pages=2 * big * pages_per_row)
    eng = Engine(graphdef, params, mcfg, rc, seed=0)
    state = eng.init_decode_state()
    prompts = [rng.integers(0, mcfg.vocab_size, ctx).tolist() for _ in range(big)]

    def prefill():
        hs = eng.prefill_many(None, [PrefillRequest(None, p, ctx, task_id=i)
                                     for i, p in enumerate(prompts)])
        jax.block_until_ready(eng.state.pools)
        return hs

    def prefill_and_free():
        for h in prefill():
            eng.free(h)

    prefill_and_free()  # compiles
    t_pre = _median_time(prefill_and_free, s.repeats)
    pre_tok_s = big * ctx / t_pre
    pre_flops = 2.0 * n_mm * big * ctx + _attn_flops_fwd(mcfg, [ctx] * big)
    pre_mfu = pre_flops / t_pre / flops_peak if flops_peak else None
    res.metrics.update(prefill_tok_s=pre_tok_s, prefill_mfu=pre_mfu)
    res.row(f"(b) prefill {big} × {ctx} tokens", f"{pre_tok_s:,.0f} tok/s",
            f"MFU {pre_mfu:.1%}" if pre_mfu is not None else "MFU: peak unknown")

    tier_figures(eng, prefill, t_pre, res, s)

    hs = prefill()
    fn = make_step(graphdef, kind="decode", impl=eng.attention, interpret=eng.interpret,
                   top_k=0, top_p=1.0, keep_logits=False)
    inserted = 0
    for b in sorted(s.batches):
        for h in hs[inserted:b]:
            state = eng.insert(h, state)
        inserted = b
        rows = hs[:b]
        # The bare step's inputs: each row's next token at its resident length.
        tok = np.asarray([[h.tokens[-1]] for h in rows], np.int32)
        start = np.asarray([h.kv_length for h in rows], np.int32)
        tbl = eng.pages.table_array([h.slot for h in rows], b)
        got, want = _decode_parity(eng, rows, rng)
        err, ok = _close(got, want)
        res.check(ok, f"Pallas decode vs gather reference at b={b}: max |Δ| {err:.2e}")
        res.metrics[f"decode_kernel_err_b{b}"] = err

        state, _ = eng.generate(None, state)  # compiles this bucket's decode step
        t_eng = _median_time(lambda state=state: eng.generate(None, state), steps)
        ones, task = np.ones(b, np.int32), np.arange(b, dtype=np.int32)
        temp, delta = np.ones(b, np.float32), np.zeros(b, np.int32)  # text: no M-RoPE delta

        def device_steps(tok=tok, start=start, tbl=tbl, ones=ones, task=task, temp=temp,
                         delta=delta):
            # Dispatched back to back, pools donated and fed forward: the device's own rate.
            pools, packed = eng.state.pools, None
            for _ in range(steps):
                pools, packed, _ = fn(eng.params, pools, eng.run_key, tok, start, ones, tbl,
                                      task, temp, delta)
            eng.state.pools = pools
            return np.asarray(packed)

        device_steps()
        t_dev = _median_time(device_steps, s.repeats) / steps
        lp = device_steps()[:, 1].view(np.float32)
        res.check(bool(np.all(np.isfinite(lp))), f"decode logprobs finite at b={b}")
        bytes_step = weight_bytes + int((start + 1).sum()) * kv_per_token
        roof = bytes_step / bw_peak if bw_peak else None
        res.metrics[f"decode_step_ms_b{b}"] = t_dev * 1e3
        res.metrics[f"decode_engine_ms_b{b}"] = t_eng * 1e3
        res.metrics[f"decode_tok_s_b{b}"] = b / t_dev
        res.metrics[f"decode_engine_tok_s_b{b}"] = b / t_eng
        res.metrics[f"decode_roofline_frac_b{b}"] = roof / t_dev if roof else None
        res.row(f"(a) decode step b={b}, ~{ctx} resident", f"{b / t_dev:,.0f} tok/s",
                f"{t_dev * 1e3:.2f} ms; roofline {roof * 1e3:.2f} ms ({_gib(bytes_step)}) → "
                f"{roof / t_dev:.0%}" if roof else
                f"{t_dev * 1e3:.2f} ms ({_gib(bytes_step)} read; HBM peak unknown)")
        res.row(f"(a) Engine.generate b={b}", f"{b / t_eng:,.0f} tok/s",
                f"{t_eng * 1e3:.2f} ms/step incl. host bookkeeping; kernel |Δ| {err:.1e}")
    res.metrics["attention"] = eng.attention
    return res


def tier_figures(eng, prefill, t_pre: float, res: Result, s: Settings) -> None:
    """(b') the host KV tier (`rollout.host_kv_pages`): every row's context evicted to pinned
    host memory (`Engine.evict`, waited for), then copied back by the rows' next prefill of
    one token each, against the prefill that computed those contexts (`t_pre`). The restored
    rows' next logprob is checked against the same rows kept resident."""
    import jax
    import numpy as np

    from tiderl.serving.engine import PrefillRequest

    def round_trip():
        hs = prefill()
        t0 = time.perf_counter()
        for h in hs:
            eng.evict(h)
        entries = [eng.host_kv.lookup(h, eng.version, h.tokens) for h in hs]
        jax.block_until_ready([e.kv for e in entries])
        t_out = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = eng.prefill_many(None, [PrefillRequest(h, [h.tokens[-1]], 1) for h in hs])
        jax.block_until_ready(eng.state.pools)
        t_in = time.perf_counter() - t0
        nbytes = sum(e.kv.nbytes for e in entries)
        kinds = {getattr(getattr(e.kv, "sharding", None), "memory_kind", None) for e in entries}
        lps = [h.logprobs[-1] for h in back]
        for h in back:
            eng.free(h)
        return t_out, t_in, nbytes, kinds, lps

    def resident():
        hs = prefill()
        back = eng.prefill_many(None, [PrefillRequest(h, [h.tokens[-1]], 1) for h in hs])
        lps = [h.logprobs[-1] for h in back]
        for h in back:
            eng.free(h)
        return lps

    want = resident()  # compiles the one-token prefill over a resident context
    round_trip()  # compiles the tier's copies
    runs = [round_trip() for _ in range(s.repeats)]
    t_out = statistics.median(r[0] for r in runs)
    t_in = statistics.median(r[1] for r in runs)
    nbytes, kinds, got = runs[-1][2], runs[-1][3], runs[-1][4]
    res.check(kinds == {"pinned_host"}, f"host KV tier entries in pinned_host memory: {kinds}")
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    res.check(err <= TOL_BF16, f"restored context's next logprob vs resident: |Δ| {err:.2e}")
    res.metrics.update(tier_out_gb_s=nbytes / t_out / 1e9, tier_in_gb_s=nbytes / t_in / 1e9,
                       tier_restore_over_prefill=t_in / t_pre, tier_restore_err=err)
    res.row("(b') host KV tier: evict to pinned_host", f"{nbytes / t_out / 1e9:.1f} GB/s",
            f"{_gib(nbytes)} in {t_out * 1e3:.1f} ms")
    res.row("(b') restore + a 1-token prefill", f"{nbytes / t_in / 1e9:.1f} GB/s",
            f"{t_in * 1e3:.1f} ms = {t_in / t_pre:.2f}× the prefill of those tokens; "
            f"logprob |Δ| {err:.1e}")


def _packed_microbatches(mcfg, s: Settings, n_ranks: int = 1):
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    n = s.microbatches * s.rows * 4
    trajs = synthetic_trajectories(n, vocab=mcfg.vocab_size, min_len=s.row_len // 4,
                                   max_len=s.row_len // 2, seed=1, behaviour_mean=-12.0)
    mbs, _ = microbatches(trajs, n_ranks=n_ranks, row_len=s.row_len, rows_per_rank=s.rows,
                          order="colocated")
    return mbs[: s.microbatches]


def _segment_lengths(mb) -> list[int]:
    import numpy as np

    out = []
    for row in mb.segment_ids_bt:
        ids, counts = np.unique(row[row > 0], return_counts=True)
        out += counts.tolist()
    return out


def part_train(shape: str, s: Settings, cache_dir: str) -> Result:
    """(c) trainer step tokens/s and MFU; training attention kernels side by side."""
    device = _init(s, cache_dir)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tiderl.models.attention import IMPLS, train_attention, unsupported
    from tiderl.models.sharding import make_mesh
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.config import TrainerConfig

    res = Result(f"train {shape}")
    res.device = device.device_kind
    flops_peak, _ = _peaks(device, s)
    mcfg = _model_cfg(shape)
    mbs = _packed_microbatches(mcfg, s)

    # Training attention kernels on these rows' segments: forward + backward, vs xla.
    seg = jnp.asarray(mbs[0].segment_ids_bt)
    rows = seg.shape[0]
    rng = np.random.default_rng(2)
    shp = (rows, s.row_len)
    q = jnp.asarray(rng.standard_normal((*shp, mcfg.n_heads, mcfg.head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((*shp, mcfg.n_kv_heads, mcfg.head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((*shp, mcfg.n_kv_heads, mcfg.head_dim)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    real = (seg > 0)[:, :, None, None]
    outs, times = {}, {}
    for impl in IMPLS:
        why = unsupported(impl, backend=device.platform, compute_dtype="bfloat16",
                          head_dim=mcfg.head_dim, seq_len=s.row_len)
        if why:
            res.row(f"(c) attention {impl}", "n/a", why)
            continue

        def fwd_bwd(q, k, v, impl=impl):
            def loss(q, k, v):
                out = train_attention(q, k, v, seg, impl)
                return jnp.sum(jnp.where(real, out * ct, 0).astype(jnp.float32)), out
            (_, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return out, g

        f = jax.jit(fwd_bwd)
        try:
            outs[impl] = jax.block_until_ready(f(q, k, v))
            times[impl] = _median_time(lambda f=f: jax.block_until_ready(f(q, k, v)),
                                       max(s.repeats, 3))
        except Exception as e:  # noqa: BLE001 - one kernel failing must not hide the others
            res.check(False, f"attention {impl}: {type(e).__name__}: {str(e)[:300]}")
            res.row(f"(c) attention {impl}", "failed", f"{type(e).__name__}")
    if "xla" in outs:
        mask = np.asarray(real)
        for impl, (out, g) in outs.items():
            ref_out, ref_g = outs["xla"]
            err_o, ok_o = _close(np.where(mask, out, 0), np.where(mask, ref_out, 0))
            errs = [_close(a, b) for a, b in zip(g, ref_g, strict=True)]
            ok = ok_o and all(o for _, o in errs)
            res.check(ok, f"attention {impl} vs xla: out {err_o:.2e}, grads "
                          f"{[f'{e:.2e}' for e, _ in errs]}")
            res.metrics[f"attention_{impl}_ms"] = times[impl] * 1e3
            res.row(f"(c) attention {impl} fwd+bwd {rows}×{s.row_len}",
                    f"{times[impl] * 1e3:.2f} ms",
                    f"{times['xla'] / times[impl]:.2f}× xla; |Δ| out {err_o:.1e} "
                    f"grads {max(e for e, _ in errs):.1e}")
    outs_ok = set(outs)
    del outs
    gc.collect()

    from tiderl.models.attention import resolve_impl

    chosen = resolve_impl("auto", backend=device.platform, compute_dtype="bfloat16",
                          head_dim=mcfg.head_dim, seq_len=s.row_len)
    # The step with the kernel `auto` picks; if that fails (a failure of this part), once more
    # with the next kernel that passed above, so the step is still measured.
    fallbacks = [i for i in ("pallas", "xla") if i != chosen and i in outs_ok]
    tcfg = TrainerConfig(lr=1e-6, kl_coef=0.001, head_chunk=s.head_chunk, remat=True,
                         row_len=s.row_len, rows_per_rank=s.rows, offload="never")
    mesh = make_mesh([device])
    for impl in [chosen, *fallbacks]:
        backend = None
        try:
            backend = TrainerBackend(tcfg, dataclasses.replace(mcfg, attention_impl=impl),
                                     actor_mesh=mesh, temperature=1.0, seed=0)
            m = backend.train_step(mbs)  # compiles
            res.check(_finite(m["loss"], m["grad_norm"]), f"first step loss {m['loss']} grad "
                                                          f"norm {m['grad_norm']} finite")
            times_s, losses = [], []
            for _ in range(s.repeats):
                t0 = time.perf_counter()
                m = backend.train_step(mbs)
                times_s.append(time.perf_counter() - t0)
                losses.append(m["loss"])
            res.check(_finite(*losses, m["grad_norm"]), f"losses {losses} finite")
            break
        except Exception as e:  # noqa: BLE001 - reported; measured with the next kernel
            res.check(False, f"train step with attention {impl}: {type(e).__name__}: "
                             f"{str(e)[:300]}")
            times_s = []
        finally:
            if backend is not None:
                backend.close()
            backend = None
            gc.collect()
    if not times_s:
        return res
    chosen = impl
    t_step = statistics.median(times_s)
    tokens = sum(int((mb.segment_ids_bt > 0).sum()) for mb in mbs)
    seg_lengths = [n for mb in mbs for n in _segment_lengths(mb)]
    n_mm = _matmul_params(mcfg)
    # Ref forward (KL term) + Actor forward and backward.
    flops = (2 + 6) * n_mm * tokens + (1 + 3) * _attn_flops_fwd(mcfg, seg_lengths)
    mfu = flops / t_step / flops_peak if flops_peak else None
    res.metrics.update(train_tok_s=tokens / t_step, train_mfu=mfu, train_step_s=t_step,
                       train_attention=chosen, train_loss=losses[-1])
    res.row(f"(c) train step ({len(mbs)}×{rows}×{s.row_len}, {tokens:,} real tokens)",
            f"{tokens / t_step:,.0f} tok/s",
            (f"MFU {mfu:.1%}" if mfu is not None else "MFU: peak unknown")
            + f"; {t_step:.2f} s/step; attention={chosen}")
    return res


def part_swap(shape: str, s: Settings, cache_dir: str) -> Result:
    """(d) offload of the idle model to pinned_host and back, GB/s."""
    device = _init(s, cache_dir)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tiderl.models.sharding import make_mesh
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.config import TrainerConfig

    res = Result(f"swap {shape}")
    res.device = device.device_kind
    mcfg = _model_cfg(shape)
    backend = TrainerBackend(TrainerConfig(kl_coef=0.001, offload="never"), mcfg,
                             actor_mesh=make_mesh([device]), seed=0)

    def in_use() -> int | None:
        st = device.memory_stats()
        return None if not st else int(st.get("bytes_in_use", 0))

    def kinds(tree) -> set[str]:
        return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}

    checksum = float(jnp.sum(jax.tree.leaves(backend.state["params"])[0].astype(jnp.float32)))
    for role, tree_of in (("actor", lambda: backend.state), ("ref", lambda: backend.ref_params)):
        nbytes = _nbytes(tree_of())
        out_t, in_t = [], []
        for _ in range(s.repeats):
            before = in_use()
            out_t.append(backend.swap(role, "host"))
            res.check(kinds(tree_of()) == {"pinned_host"}, f"{role} state in pinned_host after "
                                                           f"swap, got {kinds(tree_of())}")
            after = in_use()
            if before is not None and after is not None:
                # Real traffic: the state left device memory (a copy would free nothing).
                freed = before - after
                res.metrics[f"swap_{role}_freed_gib"] = freed / 2**30
                res.check(freed >= 0.5 * nbytes, f"{role} swap out freed {freed / 2**30:.2f} "
                                                 f"GiB of device memory, state is "
                                                 f"{nbytes / 2**30:.2f} GiB")
            in_t.append(backend.swap(role, "device"))
            res.check(kinds(tree_of()) == {"device"}, f"{role} back in device memory")
        out_gbs = nbytes / statistics.median(out_t) / 1e9
        in_gbs = nbytes / statistics.median(in_t) / 1e9
        res.metrics[f"swap_{role}_to_host_gbs"] = out_gbs
        res.metrics[f"swap_{role}_to_device_gbs"] = in_gbs
        res.row(f"(d) swap {role} ({_gib(nbytes)}, {len(jax.tree.leaves(tree_of()))} arrays)",
                f"{out_gbs:.2f} / {in_gbs:.2f} GB/s", "to pinned_host / back")
    again = float(jnp.sum(jax.tree.leaves(backend.state["params"])[0].astype(jnp.float32)))
    res.check(again == checksum, "params unchanged by the round trips")
    backend.close()

    # One large buffer: the link's ceiling for comparison.
    n = s.big_buffer_mib * 2**20 // 4
    x = jax.device_put(jnp.ones(n, jnp.float32), device)
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    jax.block_until_ready(jax.device_put(x, host))
    t_out = _median_time(lambda: jax.block_until_ready(jax.device_put(x, host)), s.repeats)
    h = jax.block_until_ready(jax.device_put(x, host))
    t_in = _median_time(lambda: jax.block_until_ready(jax.device_put(h, dev)), s.repeats)
    res.metrics.update(buffer_to_host_gbs=x.nbytes / t_out / 1e9,
                       buffer_to_device_gbs=x.nbytes / t_in / 1e9)
    res.row(f"(d) one {s.big_buffer_mib} MiB buffer", f"{x.nbytes / t_out / 1e9:.2f} / "
            f"{x.nbytes / t_in / 1e9:.2f} GB/s", "the link's ceiling, for comparison")
    res.check(bool(np.asarray(jax.device_put(h, dev)[:4]).sum() == 4), "buffer round trip")
    return res


def launch_args(s: Settings, run_dir: str) -> list[str]:
    """`python -m tiderl.launch` arguments of part (e)."""
    shape = "0.5b" if s.platform == "gpu" else "toy"
    model = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
             for k, v in SHAPES[shape].items()]
    common = ["--config", str(ROOT / "configs" / "gpu-1.yaml"), *model, f"run_dir={run_dir}",
              f"controller.steps={s.launch_steps}", "controller.eval_every=0",
              # GPU: one checkpoint at the end (orbax, device→host); the CPU smoke skips it
              # (tests cover checkpoints) to stay quick.
              f"controller.checkpoint_every={s.launch_steps if s.platform == 'gpu' else 0}",
              "controller.console=false",
              "controller.groups_per_step=4", "controller.groups_per_microbatch=2",
              "env.group_size=4", "env.max_turns=4",
              # A random policy rarely answers validly: every group would score alike and be
              # dropped; keep them (zero advantage) so each step trains.
              "trainer.zero_var_groups=keep", "controller.min_ok_per_group=1",
              "rollout.max_action_tokens=8",
              # One decode bucket, two prefill lengths, one row bucket: few compilations.
              "trainer.rows_per_rank=1"]
    if s.platform == "gpu":
        return [*common, "rollout.max_context=512", "trainer.row_len=1024",
                "rollout.decode_buckets=[64]", "rollout.prefill_buckets=[128, 512]",
                "rollout.max_slots=64", "rollout.prefill_batch=64", "rollout.num_pages=1024"]
    return [*common, "cluster.platform=cpu", "cluster.fake_cpu_devices=1",
            "rollout.max_context=128", "trainer.row_len=128", "trainer.head_chunk=64",
            "rollout.decode_buckets=[16]", "rollout.prefill_buckets=[64, 128]",
            "rollout.max_slots=16", "rollout.num_pages=160", "rollout.prefill_batch=16"]


def part_launch(shape: str, s: Settings, cache_dir: str, timeout: float = 600) -> Result:
    """(e) a short run of `python -m tiderl.launch` on the one device, colocated."""
    res = Result(f"launch {shape}")
    with tempfile.TemporaryDirectory() as tmp:
        args = launch_args(s, f"{tmp}/run")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "tiderl.launch", *args], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        res.check(r.returncode == 0, f"launch exit status {r.returncode}: "
                                     f"{(r.stderr or r.stdout)[-1500:]}")
        summary_path = Path(tmp) / "run" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        steps = summary.get("steps", 0)
        res.check(steps == s.launch_steps, f"ran {steps} of {s.launch_steps} steps "
                                           f"(ended: {summary.get('ended')})")
        metrics_path = Path(tmp) / "run" / "metrics.jsonl"
        recs = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] \
            if metrics_path.exists() else []
        losses = [r_.get("loss") for r_ in recs if r_.get("kind") == "step"]
        nonfinite = [x for x in losses if not _finite(x)]
        res.check(bool(losses) and not nonfinite, f"{len(nonfinite)} non-finite of "
                                                  f"{len(losses)} step losses")
        res.check(not summary.get("nonfinite_skipped"), f"{summary.get('nonfinite_skipped')} "
                                                         "updates skipped as non-finite")
    res.metrics.update(launch_steps=steps, launch_wall_s=wall,
                       launch_goodput=summary.get("goodput"))
    res.row(f"(e) launch gpu-1.yaml, {shape} shape", f"{steps}/{s.launch_steps} steps",
            f"{wall:.0f} s wall; goodput {summary.get('goodput')}; ended: "
            f"{summary.get('ended')}")
    return res


PARTS = {"decode": part_decode, "train": part_train, "swap": part_swap, "launch": part_launch}


# ------------------------------------------------------------------------------ harness
def run_child(args: argparse.Namespace) -> None:
    s = _settings(args)
    try:
        res = PARTS[args.child](args.shape, s, args.cache_dir).to_json()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which carries on
        res = {"part": f"{args.child} {args.shape}", "ok": False, "rows": [], "metrics": {},
               "failures": [f"{type(e).__name__}: {e}"[:2000]],
               "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(res, default=str), flush=True)


def run_isolated(part: str, shape: str, args: argparse.Namespace, timeout: float) -> dict:
    """One part in a fresh process (a crash, abort or OOM there is this part's failure)."""
    cmd = [sys.executable, __file__, "--child", part, "--shape", shape,
           "--cache-dir", args.cache_dir]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    for flag in ("peak_tflops", "hbm_gbps"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    # A session of its own: on a timeout the whole group goes (part (e) starts a launch
    # process of its own, which must not outlive the part holding the GPU).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return {"part": f"{part} {shape}", "ok": False, "rows": [], "metrics": {},
                "failures": [f"timed out after {timeout:.0f} s; stderr tail: "
                             f"{(stderr or '')[-1500:]}"]}
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    for line in reversed(r.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {"part": f"{part} {shape}", "ok": False, "rows": [], "metrics": {},
            "failures": [f"exit status {r.returncode}, no result; stderr tail: "
                         f"{r.stderr[-1500:]}"]}


def run_inline(part: str, shape: str, args: argparse.Namespace) -> dict:
    try:
        return PARTS[part](shape, _settings(args), args.cache_dir).to_json()
    except Exception as e:  # noqa: BLE001 - this part failed; the others still run
        return {"part": f"{part} {shape}", "ok": False, "rows": [], "metrics": {},
                "failures": [f"{type(e).__name__}: {e}"[:2000]],
                "traceback": traceback.format_exc()[-4000:]}


def _settings(args: argparse.Namespace) -> Settings:
    s = SMOKE if args.cpu_smoke else GPU
    return dataclasses.replace(s, peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_gbps)


def print_table(results: list[dict], file=sys.stdout) -> None:
    rows = [(r["part"], *row) for r in results for row in r["rows"]]
    w = [max([len(str(x[i])) for x in rows] + [8]) for i in range(3)]
    print(f"{'part':<{w[0]}}  {'measure':<{w[1]}}  {'value':>{w[2]}}  note", file=file)
    for part, what, value, note in rows:
        print(f"{part:<{w[0]}}  {what:<{w[1]}}  {value:>{w[2]}}  {note}", file=file)
    for r in results:
        status = "skipped" if r.get("skipped") else "ok" if r["ok"] else "FAILED"
        print(f"[{status}] {r['part']} ({r.get('wall_s', 0):.0f} s)", file=file)
        for f in r.get("failures", []):
            print(f"    - {f}", file=file)
        if not r["ok"] and r.get("traceback"):
            print("    " + r["traceback"].strip().replace("\n", "\n    ")[-2000:], file=file)
    file.flush()


def headline(results: list[dict], s: Settings) -> dict:
    out: dict[str, Any] = {
        "ok": all(r["ok"] for r in results),
        "passed": [r["part"] for r in results if r["ok"]],
        "failed": [r["part"] for r in results if not r["ok"] and not r.get("skipped")],
        "skipped": [r["part"] for r in results if r.get("skipped")],
        "device": next((r["device"] for r in results if r.get("device")), ""),
        "parts": {r["part"]: {"ok": r["ok"], "wall_s": r.get("wall_s"),
                              "failures": r.get("failures", [])} for r in results}}
    for r in results:
        key = r["part"].replace(" ", ":")
        for k, v in r["metrics"].items():
            out[f"{key}:{k}"] = v
    big = "1.5b" if s.platform == "gpu" else "toy"
    frac = out.get(f"decode+prefill:{big}:decode_roofline_frac_b32")
    out["target_decode_b32_1.5b_roofline>=0.6"] = None if frac is None else frac >= 0.6
    return out


def plan_jobs(parts: list[str], shapes: list[str], smoke: bool) -> list[tuple[str, str]]:
    """The order parts run in: the largest shape's decode and training first, then the swap
    and the short run on the smaller shape, then the remaining shapes — so that a budget that
    runs out cuts the least telling parts."""
    small = shapes[-1] if smoke else ("0.5b" if "0.5b" in shapes else shapes[-1])
    first, rest = shapes[0], shapes[1:]
    jobs = [(p, first) for p in ("decode", "train") if p in parts]
    jobs += [(p, small) for p in ("swap", "launch") if p in parts]
    jobs += [(p, shape) for shape in rest for p in ("decode", "train") if p in parts]
    return jobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="toy sizes on the CPU, parts in this process (what CI runs)")
    ap.add_argument("--parts", default="decode,train,swap,launch",
                    help="comma-separated subset of decode,train,swap,launch")
    ap.add_argument("--shapes", default=None, help="comma-separated (default 1.5b,0.5b; "
                                                   "toy with --cpu-smoke)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each part in its own process (default: on, off with --cpu-smoke)")
    ap.add_argument("--part-timeout", type=float, default=300.0,
                    help="seconds one part may take (isolated parts are killed after it)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting parts after this many seconds and cut the last one "
                         "short at it, so the table and JSON line always print (default 540 "
                         "on a GPU, none with --cpu-smoke)")
    ap.add_argument("--cache-dir", default=None,
                    help="persistent XLA compilation cache, so a rerun skips compiling "
                         "(default /tmp/tiderl-gpu-check-xla; off with --cpu-smoke)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=None)
    ap.add_argument("--child", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="toy", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.cache_dir is None:
        args.cache_dir = "" if args.cpu_smoke else "/tmp/tiderl-gpu-check-xla"
    if args.budget_s is None:
        args.budget_s = 0.0 if args.cpu_smoke else 540.0
    if args.child:
        run_child(args)
        return 0
    s = _settings(args)
    shapes = (args.shapes or ("toy" if args.cpu_smoke else "1.5b,0.5b")).split(",")
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; use {', '.join(SHAPES)}")
    isolate = (not args.cpu_smoke) if args.isolate is None else args.isolate
    t_start = time.perf_counter()
    results = []
    for part, shape in plan_jobs(args.parts.split(","), shapes, args.cpu_smoke):
        left = args.budget_s - (time.perf_counter() - t_start) if args.budget_s else math.inf
        if left < 30:
            results.append({"part": f"{part} {shape}", "ok": False, "skipped": True, "rows": [],
                            "metrics": {}, "failures": [f"not run: --budget-s {args.budget_s:.0f}"
                                                        " spent"]})
            continue
        t0 = time.perf_counter()
        print(f"... {part} {shape}", file=sys.stderr, flush=True)
        r = (run_isolated(part, shape, args, min(args.part_timeout, left)) if isolate
             else run_inline(part, shape, args))
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        print_table([r], file=sys.stderr)  # as it goes: a killed run still shows its parts
    print_table(results)
    out = headline(results, s)
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
