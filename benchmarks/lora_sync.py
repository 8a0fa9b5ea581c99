"""Bytes a weight sync moves per update, LoRA (`trainer.lora_rank`) vs full fine-tuning.

1. Measured on the embedded default model (`ModelConfig()`: vocab 272, d 64, 2 layers, 4/2
   heads of 16, mlp 128, tied; fp32): a real `TrainerBackend` on one CPU device, one train step,
   then the site's sync (`tiderl.runtime.parts.WeightPlacer`) to two rollout devices, once with
   whole weights (`export_weights()`) and once with the adapters (`export_lora()`, after the
   base was put on the ranks by a first sync). Bytes are the sync's own count (`sync_bytes`, as
   metrics.jsonl has it, for the two ranks); seconds are the median of --repeats syncs each
   (warmed up untimed; LoRA's include the merge on the rank's device). CPU "devices" share one
   host's memory, so the seconds say little about a real interconnect; the bytes are exact.
2. Computed from shapes (`jax.eval_shape`, no weights) for SmolLM2-135M's shape (vocab 49,152,
   d 576, 30 layers, 9/3 heads of 64, mlp 1,536, tied): whole serving weights in fp32 and bf16
   (the engines serve the compute dtype) vs the adapters (fp32) at ranks 4, 16 and 64, all seven
   projections targeted (the default).

    python benchmarks/lora_sync.py [--rank 4] [--repeats 5]

The last line is one JSON object: `tiny_full_bytes`, `tiny_lora_bytes`, `tiny_ratio`,
`tiny_full_s`, `tiny_lora_s`, `smollm2_full_fp32_bytes`, `smollm2_full_bf16_bytes`,
`smollm2_lora_r{4,16,64}_bytes`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _tiny(rank: int, repeats: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    from tiderl.models.config import ModelConfig
    from tiderl.models.sharding import make_mesh
    from tiderl.runtime.parts import WeightPlacer
    from tiderl.train.backend import TrainerBackend
    from tiderl.train.config import TrainerConfig
    from tiderl.train.dispatch import microbatches
    from tiderl.train.synthetic import synthetic_trajectories

    cfg = ModelConfig()
    devs = jax.devices()
    be = TrainerBackend(TrainerConfig(lora_rank=rank, lora_alpha=2.0 * rank), cfg,
                        actor_mesh=make_mesh(devs[:1]))
    trajs = synthetic_trajectories(8, vocab=cfg.vocab_size, min_len=6, max_len=30, seed=0,
                                   versions=(0,))
    be.train_step(microbatches(trajs, n_ranks=1, row_len=64, rows_per_rank=2)[0])
    dests = [make_mesh(devs[2:3]), make_mesh(devs[3:4])]
    out = {}
    for kind, export in (("full", be.export_weights), ("lora", be.export_lora)):
        place = WeightPlacer(cfg, be.serving_abstract, dests)
        jax.block_until_ready(place(export())[0])  # warm-up (LoRA: puts the base once)
        times, moved = [], None
        for _ in range(repeats):
            exported = jax.block_until_ready(export())
            t0 = time.perf_counter()
            trees, stats = place(exported)
            jax.block_until_ready(trees)
            times.append(time.perf_counter() - t0)
            moved = stats.metrics()["sync_bytes"]
        out[f"tiny_{kind}_bytes"] = int(moved)
        out[f"tiny_{kind}_s"] = statistics.median(times)
    out["tiny_ratio"] = out["tiny_full_bytes"] / out["tiny_lora_bytes"]
    return out


def _smollm2() -> dict:
    from tiderl.models.config import ModelConfig
    from tiderl.models.lora import LoraSpec
    from tiderl.models.policy import abstract_lora, abstract_policy
    from tiderl.runtime.weightsync import tree_bytes

    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, mlp_dim=1536, tie_embeddings=True, scan_layers=True)
    import jax
    import numpy as np

    leaves = jax.tree.leaves(abstract_policy(smol)[1])
    # The engines serve matrices in the compute dtype; 1-D scales stay fp32 (serving/weights.py).
    bf16 = sum(int(np.prod(x.shape)) * (2 if x.ndim >= 2 else 4) for x in leaves)
    out = {"smollm2_full_fp32_bytes": tree_bytes(leaves), "smollm2_full_bf16_bytes": bf16}
    for r in (4, 16, 64):
        out[f"smollm2_lora_r{r}_bytes"] = tree_bytes(abstract_lora(smol, LoraSpec(r, 2.0 * r)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    res = {**_tiny(args.rank, args.repeats), **_smollm2()}
    for k, v in res.items():
        print(f"{k:28s} {v:,.6g}" if isinstance(v, float) else f"{k:28s} {v:,}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
