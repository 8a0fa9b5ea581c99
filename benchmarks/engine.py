"""Decode throughput of the tiderl engine vs HF transformers, no-cache recompute, and a dense cache.

One tiny Qwen2 config (built locally with transformers, random weights, never downloaded) is
loaded into both stacks through `tiderl.models.hf.from_pretrained`, so the weights are identical.
For each batch size every contender decodes with `--context` tokens resident:
  engine      Engine.generate (paged KV, host bookkeeping, one device→host copy per step)
  paged       the engine's jitted paged decode step alone (same inputs every step)
  dense       the same model and sampler over a dense per-slot cache [B, L, K, Dh]
  nocache     full forward over the whole context every step (no KV cache)
  hf          transformers `generate` with its KV cache (torch CPU, greedy; credited with its
              best of sdpa/eager attention and 1/all threads at each batch size)
Contenders run interleaved within each repeat (load swings on a shared box hit all alike);
medians of per-step times; the last stdout line is one JSON object with the headline figures.

    python benchmarks/engine.py [--batches 1 8 32] [--context 512] [--steps 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl.models.hf import from_pretrained  # noqa: E402
from tiderl.serving.config import RolloutConfig  # noqa: E402
from tiderl.serving.engine import Engine  # noqa: E402
from tiderl.serving.kv import DenseKV  # noqa: E402
from tiderl.serving.sampling import sample, token_keys  # noqa: E402
from tiderl.serving.steps import make_step  # noqa: E402

QWEN2_TINY = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, use_sliding_window=False)


def build_models(seed=0):
    """HF models (sdpa and eager attention, same weights) and our Decoder loaded from them."""
    torch.manual_seed(seed)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2_TINY)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        ours = from_pretrained(d, dtype="float32")
        eager = transformers.Qwen2ForCausalLM.from_pretrained(d, attn_implementation="eager")
    graphdef, params = nnx.split(ours)
    return {"sdpa": hf, "eager": eager.eval()}, ours.cfg, graphdef, params


@functools.cache
def dense_step(graphdef, t):
    """Jitted step of the same model and sampler over a dense cache (cache donated)."""

    def step(params, cache, run_key, tokens_bt, start_b, n_new_b, task_ids_b, temp_b):
        model = nnx.merge(graphdef, params)
        positions_bt = start_b[:, None] + jnp.arange(t)
        cache = DenseKV(cache.k, cache.v, start_b, n_new_b)
        logits_btv, cache = model(tokens_bt, positions_bt, jnp.ones_like(tokens_bt), cache=cache)
        last = jnp.maximum(n_new_b - 1, 0)
        logits_bv = jnp.take_along_axis(logits_btv, last[:, None, None], axis=1)[:, 0]
        keys = token_keys(run_key, task_ids_b, start_b + n_new_b)
        tok, lp = sample(logits_bv.astype(jnp.float32), keys, temp_b)
        return cache, jnp.stack([tok, jax.lax.bitcast_convert_type(lp, jnp.int32)], 1)

    return jax.jit(step, donate_argnums=(1,))


@functools.cache
def nocache_step(graphdef):
    """Full recompute: forward over the whole (padded) context, sample at each row's end."""

    def step(params, run_key, tokens_bl, len_b, task_ids_b, temp_b):
        model = nnx.merge(graphdef, params)
        n = tokens_bl.shape[1]
        seg = (jnp.arange(n)[None] < len_b[:, None]).astype(jnp.int32)
        logits_blv, _ = model(tokens_bl, jnp.broadcast_to(jnp.arange(n), tokens_bl.shape), seg)
        logits_bv = jnp.take_along_axis(logits_blv, (len_b - 1)[:, None, None], axis=1)[:, 0]
        tok, lp = sample(logits_bv.astype(jnp.float32), token_keys(run_key, task_ids_b, len_b),
                         temp_b)
        return jnp.stack([tok, jax.lax.bitcast_convert_type(lp, jnp.int32)], 1)

    return jax.jit(step)


def _timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_batch(b, args, hf, cfg, graphdef, params, prompts):
    """Per-step times of every contender at batch b, interleaved repeat by repeat."""
    steps, ctx = args.steps, args.context
    rc = RolloutConfig(page_size=16, num_pages=b * (-(-(ctx + steps + 2) // 16)), max_slots=b,
                       max_context=ctx + steps + 2, max_action_tokens=steps + 1,
                       temperature=0.0, decode_buckets=(b,), prefill_buckets=(ctx,))
    eng = Engine(graphdef, params, cfg, rc, seed=0)
    temp_b = np.zeros(b, np.float32)
    task_b = np.arange(b, dtype=np.int32)
    runs = {}  # contender -> () -> list of step times

    # engine: prefill b tasks (untimed), then Engine.generate steps.
    state = eng.init_decode_state()
    hs = [eng.prefill(None, None, prompts[i], ctx, task_id=i) for i in range(b)]
    for h in hs:
        state = eng.insert(h, state)
    state, _ = eng.generate(None, state)

    def engine_run():
        for h in hs:  # restart from the same resident context (the pages are still there)
            del h.tokens[ctx + 2:]
            h.kv_length, h.decoding, h.stop_reason = ctx + 1, True, 0
        return _timed(lambda: eng.generate(None, state), steps - 2)
    runs["engine"] = engine_run

    # paged: the engine's own jitted decode step, fixed inputs, bookkeeping excluded.
    fn = make_step(graphdef, kind="decode", impl=eng.attention, interpret=eng.interpret,
                   top_k=0, top_p=1.0, keep_logits=False)
    table = eng.pages.table_array([h.slot for h in hs], b)
    start = np.full(b, ctx, np.int32)
    tok = np.asarray([[h.tokens[ctx]] for h in hs], np.int32)
    ones, delta_b = np.ones(b, np.int32), np.zeros(b, np.int32)  # text: no M-RoPE delta

    def paged():
        state.pools, packed, _ = fn(params, state.pools, eng.run_key, tok, start, ones, table,
                                    task_b, temp_b, delta_b)
        np.asarray(packed)
    runs["paged"] = lambda: _timed(paged, steps)

    # dense: same model and sampler over [B, L, K, Dh].
    L = rc.max_pages_per_slot * rc.page_size
    shape = (b, L, cfg.n_kv_heads, cfg.head_dim)
    cache = DenseKV(tuple(jnp.zeros(shape) for _ in range(cfg.n_layers)),
                    tuple(jnp.zeros(shape) for _ in range(cfg.n_layers)), None, None)
    cache, packed = dense_step(graphdef, ctx)(params, cache, eng.run_key, prompts[:b],
                                              np.zeros(b, np.int32), np.full(b, ctx, np.int32),
                                              task_b, temp_b)
    dense_tok = np.asarray(packed)[:, :1]
    holder = [cache]

    def dense():
        holder[0], packed = dense_step(graphdef, 1)(params, holder[0], eng.run_key, dense_tok,
                                                    start, ones, task_b, temp_b)
        np.asarray(packed)
    runs["dense"] = lambda: _timed(dense, steps)

    # nocache: recompute the whole context each step (padded to L so it compiles once).
    ctx_bl = np.zeros((b, L), np.int32)
    ctx_bl[:, :ctx] = prompts[:b]
    ctx_bl[:, ctx] = dense_tok[:, 0]
    nc = nocache_step(graphdef)
    len_b = np.full(b, ctx + 1, np.int32)
    runs["nocache"] = lambda: _timed(
        lambda: np.asarray(nc(params, eng.run_key, ctx_bl, len_b, task_b, temp_b)), 1)

    # hf: generate with its KV cache. A logits processor stamps the time of every step (it runs
    # once per generated token, right after the forward), so prefill is excluded exactly. HF is
    # credited with its best variant: sdpa or eager attention (on CPU sdpa is sometimes much
    # slower, e.g. ~0.47 s/step at B=16) and 1 or all torch threads (OpenMP barriers stall
    # when other processes take the cores, as on a shared box).
    ids = torch.as_tensor(prompts[:b], dtype=torch.long)
    mask = torch.ones_like(ids)
    stamps: list[float] = []
    hf_out = {}

    def stamp(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    def hf_run(model, threads):
        torch.set_num_threads(threads)
        stamps.clear()
        with torch.no_grad():
            hf_out["tokens"] = model.generate(
                ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                do_sample=False, pad_token_id=0,
                logits_processor=transformers.LogitsProcessorList([stamp]))
        return list(np.diff(stamps))

    for threads in sorted({1, os.cpu_count() or 1}):
        for impl, model in hf.items():
            runs[f"hf_{impl}_t{threads}"] = functools.partial(hf_run, model, threads)

    for run in runs.values():  # warm-up: compile, first-call allocations
        run()
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so load swings hit every contender alike
        for name, run in runs.items():
            times[name] += run()
    res = {f"{name}_step": statistics.median(t) for name, t in times.items()}
    res["hf_step"] = min(v for k, v in res.items() if k.startswith("hf_"))
    engine_tokens = [list(h.tokens[ctx:]) for h in hs]
    hf_tokens = hf_out["tokens"][:, ctx:].tolist()
    n = min(8, steps)
    agree = np.mean([e[:n] == h[:n] for e, h in zip(engine_tokens, hf_tokens, strict=True)])
    res["greedy_agree_first8"] = float(agree)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    hf, cfg, graphdef, params = build_models()
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (max(args.batches), args.context)).astype(np.int32)
    print(f"tiny Qwen2 {QWEN2_TINY}; context {args.context}, {args.steps} decode steps, "
          f"{args.repeats} repeats; jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"torch {torch.__version__}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    hdr = (f"{'batch':>5} {'engine tok/s':>13} {'paged tok/s':>12} {'dense tok/s':>12} "
           f"{'nocache tok/s':>14} {'hf tok/s':>10} {'eng/hf':>7} {'eng/nocache':>12} "
           f"{'paged/dense step':>17} {'greedy=hf':>9}")
    print(hdr)
    rows = {}
    for b in args.batches:
        r = bench_batch(b, args, hf, cfg, graphdef, params, prompts)
        rows[b] = r
        tps = {k: b / r[f"{k}_step"] for k in ("engine", "paged", "dense", "nocache", "hf")}
        r.update({f"{k}_tok_s": v for k, v in tps.items()})
        print(f"{b:>5} {tps['engine']:>13.0f} {tps['paged']:>12.0f} {tps['dense']:>12.0f} "
              f"{tps['nocache']:>14.1f} {tps['hf']:>10.0f} {tps['engine'] / tps['hf']:>7.2f} "
              f"{tps['engine'] / tps['nocache']:>12.1f} "
              f"{r['paged_step'] / r['dense_step']:>17.2f} {r['greedy_agree_first8']:>9.2f}",
              flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (other processes skew CPU timings)")
    big = max(args.batches)
    r = rows[big]
    print(json.dumps({
        "batch": big,
        "decode_speedup_vs_hf_b32": r["engine_tok_s"] / r["hf_tok_s"],
        "speedup_vs_nocache_b32": r["engine_tok_s"] / r["nocache_tok_s"],
        "paged_over_dense_step": r["paged_step"] / r["dense_step"],
        "engine_over_dense_step": r["engine_step"] / r["dense_step"],
        "per_batch": {str(b): {k: round(v, 6) for k, v in rows[b].items()} for b in rows},
    }))


if __name__ == "__main__":
    main()
