"""The sliding image window with the real engine: a tiny random Qwen2.5-VL-shaped policy (made
here) served by `Engine` behind a `RolloutRank`, the byte tokenizer and template, and a real gui
env server. Each task is cut once (window 3, keep 2) and continues from a fresh prefill of the
head + its two most recent screenshots; the behaviour logprob of every trained token, in the
segment and in the continuation, equals the trainer's recompute over that part alone (its own
tokens and images, M-RoPE positions from 0): each action is trained in the context it was
sampled in. Tolerance: 1e-4 (fp32 logprobs, the engine tests' bound).
"""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl.models.config import ModelConfig, VisionConfig
from tiderl.models.policy import init_policy
from tiderl.models.vlm import image_input, mrope_positions
from tiderl.train.grpo import token_logprobs

pytestmark = pytest.mark.slow  # compiles the engine's kernels (minutes on the shared box)

LOGPROB_TOL = 1e-4
FULL_LEN, FULL_PATCHES = 1024, 64


def _policy():
    from tiderl.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.special_ids
    vision = VisionConfig(depth=2, d_model=16, n_heads=2, mlp_dim=32, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, out_dim=32,
                          image_token_id=ids["<|image_pad|>"],
                          vision_start_token_id=ids["<|vision_start|>"], window_size=16,
                          fullatt_blocks=(1,))
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, mlp_dim=48, qkv_bias=True,
                      tie_embeddings=False, mrope_section=(1, 2, 1), vision=vision)
    graphdef, params = init_policy(cfg, seed=0)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: x + (0.15 * rng.standard_normal(x.shape)).astype(x.dtype),
                          params)
    return tok, cfg, graphdef, params


async def _play(tok, cfg, graphdef, params):
    from tiderl.envs.adapters.gui import GuiDesktop
    from tiderl.envs.client import EnvClient
    from tiderl.envs.config import EnvConfig
    from tiderl.envs.server import EnvServer
    from tiderl.envs.tasks import TaskSource
    from tiderl.envs.templates import byte_template
    from tiderl.models.vision_inputs import ImageProcessing, ImagePrompt
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.engine import Engine
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager

    tmpl = byte_template(tok)
    rcfg = RolloutConfig(page_size=8, num_pages=512, max_slots=2, max_context=FULL_LEN,
                         max_action_tokens=5, decode_buckets=(2,), prefill_buckets=(64,),
                         temperature=1.0)
    rank = RolloutRank(0, Engine(graphdef, params, cfg, rcfg, seed=3))
    await rank.start()
    sched = make_scheduler("ctb", CTBConfig(), [rcfg.num_pages * rcfg.page_size],
                           max_context=FULL_LEN)
    # One oracle turn: a 4-turn budget, so 4 screenshots (each 2 image tokens at <= 256 px).
    env_cfg = EnvConfig(suite="gui", options=("width=320", "height=200", "min_turns=1",
                                              "max_turns=1"), retries=0)
    prompt = ImagePrompt(cfg.vision, ImageProcessing(min_pixels=64, max_pixels=256))
    try:
        async with EnvServer(GuiDesktop, env_cfg).serve() as url, \
                EnvClient(url, env_cfg) as env:
            mgr = RolloutManager([rank], sched, env, tmpl, max_turns=8, system="Operate it.",
                                 images=prompt, image_window=3, image_keep=2)
            trajs = await mgr.run_group(TaskSource("gui", "train", groups=1,
                                                   group_size=2).element(0))
    finally:
        await rank.close()
    return trajs, mgr


def _recompute(cfg, graphdef, params, tokens, images):
    """The trainer's behaviour logprobs over one part alone (padded to one shape)."""
    tokens_bt = np.zeros((1, FULL_LEN), np.int32)
    tokens_bt[0, :len(tokens)] = tokens
    grid = np.asarray([im.grid_thw for im in images]).reshape(-1, 3)
    pos = mrope_positions(tokens_bt, grid, cfg)
    inp = image_input(np.concatenate([im.pixels for im in images]), grid, cfg.vision,
                      pad_to=FULL_PATCHES)

    @jax.jit
    def run(params, tokens, pos, images):
        logits = nnx.merge(graphdef, params)(tokens, pos, jnp.ones_like(tokens),
                                             images=images)[0]
        return token_logprobs(logits, tokens, 1.0)

    return np.asarray(run(params, tokens_bt, pos, inp))[0, :len(tokens)]


def test_cut_parts_keep_the_engines_logprobs_against_the_trainers_recompute():
    tok, cfg, graphdef, params = _policy()
    trajs, mgr = asyncio.run(_play(tok, cfg, graphdef, params))
    assert mgr.window.cuts == 2
    for t in trajs:
        assert t.ok and t.turns == 4, (t.end_reason, t.error)
        (seg,) = t.segments
        assert len(seg.images) == 3 and len(t.images) == 3  # images 1-3; images 2-4
        assert t.images[:2] == seg.images[1:] and all(
            a is b for a, b in zip(t.images[:2], seg.images[1:], strict=True))
        for part in (seg, t):
            on = np.asarray(part.loss_mask, bool)
            assert on.any()
            want = _recompute(cfg, graphdef, params, part.tokens, part.images)
            err = float(np.max(np.abs(np.asarray(part.logprobs)[on] - want[on])))
            print(f"{t.task_id} part of {len(part.tokens)} tokens, {len(part.images)} images: "
                  f"max |engine - trainer| logprob {err:.1e}")
            assert err <= LOGPROB_TOL
