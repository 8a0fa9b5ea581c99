"""Can a VLM config see the gui suite's answer at all? A supervised probe, no RL.

    python benchmarks/vlm_probe.py [--config configs/vlm-gui.yaml] [--updates 300]
                                   [--text full|task|question] [--set KEY=VALUE ...]

The run config's policy (from scratch, its seed) learns by cross-entropy to answer a
screenshot of the config's gui options (one icon: `icons=1`, `actions=cell`) with the
oracle's cell digit, at the last token of the observation (the image placeholders, then
`--text`: the observation's whole text, only its first line "Task: open X.", or one "?"), 32
fresh tasks an update, with
the run's optimizer (trainer.lr and its schedule, AdamW, the clip, the tower frozen or at
trainer.vision_lr_scale). After updates 1, 5 and every 50: greedy accuracy on 256 other
seeds, and the cosine between the tower's icon-cell and empty-cell features. It separates
"RL has not found the signal yet" from "this model cannot represent it": the comments of
configs/vlm-gui.yaml cite it (M-RoPE layout, frozen tower). `--set` takes the run config's
dotted overrides, e.g. `--set model.train_vision=true`, `--set model.mrope_interleaved=false
model.rope_theta=10000`. The last line is one JSON object: both by update.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl.config import load_config  # noqa: E402
from tiderl.envs.adapters.gui import GuiDesktop  # noqa: E402
from tiderl.models.policy import policy_class  # noqa: E402
from tiderl.models.rope_index import mrope_positions  # noqa: E402
from tiderl.models.tokenizer import ByteTokenizer  # noqa: E402
from tiderl.models.vision import image_input  # noqa: E402
from tiderl.models.vision_inputs import image_prompt_for  # noqa: E402
from tiderl.train.ref_actor import make_optimizer, param_groups  # noqa: E402

HELD_OUT = 10 ** 9  # held-out seeds start here; training seeds are drawn below it


def batches(cfg, text: str):
    prompt, tok = image_prompt_for(cfg.model), ByteTokenizer()
    env = GuiDesktop(cfg.env.option_dict())
    if env.actions != "cell" or env.icons != 1:
        raise SystemExit("the probe's label is the cell of the only icon: use env.options with "
                         "actions=cell and icons=1")
    digits = np.asarray(tok.encode("0123456789"))

    def batch(seeds):
        rows = []
        for seed in seeds:
            obs = env.reset({"seed": int(seed)})
            said = {"full": obs.text, "task": obs.text.split("\n")[0], "question": "?"}[text]
            shown, patched = prompt.observation(said, obs.images)
            rows.append((prompt.expand(patched, tok.encode(shown)), patched[0],
                         int(env.oracle_action())))
        width = max(len(ids) for ids, _, _ in rows)
        toks = np.zeros((len(rows), width), np.int32)
        segs, last = np.zeros_like(toks), np.asarray([len(ids) - 1 for ids, _, _ in rows])
        for b, (ids, _, _) in enumerate(rows):
            toks[b, :len(ids)], segs[b, :len(ids)] = ids, 1
        grid = np.asarray([p.grid_thw for _, p, _ in rows]).reshape(-1, 3)
        pixels = np.concatenate([p.pixels for _, p, _ in rows])
        pos = mrope_positions(toks, grid, cfg.model, segs).astype(np.int32)
        cells = np.asarray([c for _, _, c in rows])
        return (toks, pos, segs, image_input(pixels, grid, cfg.model.vision), last,
                digits[cells], cells)

    return batch, digits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/vlm-gui.yaml")
    ap.add_argument("--updates", type=int, default=300)
    ap.add_argument("--text", choices=("full", "task", "question"), default="full")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    batch, digits = batches(cfg, args.text)
    model = policy_class(cfg.model)(cfg.model, rngs=nnx.Rngs(params=cfg.seed))
    # The run's optimizer (clip, AdamW, schedule; the tower frozen or at its own rate).
    tx = make_optimizer(cfg.trainer, *param_groups(cfg.model, cfg.trainer))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def answer_logits(m, toks, pos, segs, images, last):
        logits, _ = m(toks, pos, segs, images=images)
        return logits[jnp.arange(toks.shape[0]), last]

    @nnx.jit
    def update(m, o, toks, pos, segs, images, last, y):
        def loss(m):
            lg = answer_logits(m, toks, pos, segs, images, last)
            return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()

        value, grads = nnx.value_and_grad(loss)(m)
        o.update(m, grads)
        return value

    predict = nnx.jit(answer_logits)
    test = batch(range(HELD_OUT, HELD_OUT + 256))
    cells = GuiDesktop(cfg.env.option_dict()).grid
    rng, t0 = np.random.default_rng(cfg.seed), time.perf_counter()
    acc, cos = {}, {}
    for i in range(args.updates + 1):
        if i % 50 == 0 or i in (1, 5, args.updates):
            lg = np.asarray(predict(model, *test[:5]))[:, digits]
            acc[i] = float(np.mean(lg.argmax(-1) == test[6]))
            cos[i] = icon_cosine(model, test, cells)
            print(f"update {i}: held-out accuracy {acc[i]:.3f}, icon/empty feature cosine "
                  f"{cos[i]} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if i < args.updates:
            update(model, opt, *batch(rng.integers(0, HELD_OUT, 32))[:6])
    print(json.dumps({"config": args.config, "set": args.set, "text": args.text,
                      "accuracy_by_update": acc, "icon_empty_cosine_by_update": cos}))


def icon_cosine(model, test, cells: tuple[int, int]) -> float | None:
    """Mean cosine between the tower's feature of the icon's cell and those of the empty cells
    (near 1: the tower no longer tells them apart); None unless every screenshot is read as one
    image token per cell (row-major, as the cells are numbered)."""
    feats = np.asarray(model.image_features(test[3])[0])
    n, per = len(test[6]), cells[0] * cells[1]
    if feats.shape[0] != n * per:
        return None
    unit = feats / np.linalg.norm(feats, axis=-1, keepdims=True)
    unit = unit.reshape(n, per, -1)
    sims = [np.delete(unit[b] @ unit[b, c - 1], c - 1).mean() for b, c in enumerate(test[6])]
    return round(float(np.mean(sims)), 4)


if __name__ == "__main__":
    main()
