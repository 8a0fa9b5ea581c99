"""A vision-language policy's image inputs on the host: the Qwen-VL image processor
(`patch_image`) against transformers' `Qwen2VLImageProcessorPil`, and an episode's chat
(`ImagePrompt` through `Transcript`, as the rollout's episode loop renders observations) against
`Qwen2_5_VLProcessor.apply_chat_template`'s ids. No JAX.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from tiderl.models.config import VisionConfig  # noqa: E402
from tiderl.models.vision_inputs import (  # noqa: E402
    ImageProcessing,
    ImagePrompt,
    patch_image,
    smart_resize,
)

PROC = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=4096)


def _pics(sizes, seed=0):
    import PIL.Image

    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in sizes]


@pytest.mark.parametrize("mean_std", [None, (0.5, 0.5)])
def test_patch_image_equals_transformers_processor(mean_std):
    """Images kept, shrunk (over max_pixels), grown (under min_pixels) and of odd sides:
    pixel values equal transformers' within 1e-6 and grids exactly; also with Qwen3-VL's
    mean/std (0.5)."""
    from transformers import Qwen2VLImageProcessorPil

    kw = {} if mean_std is None else dict(image_mean=[mean_std[0]] * 3,
                                          image_std=[mean_std[1]] * 3)
    ref = Qwen2VLImageProcessorPil(**PROC, **kw)
    processing = ImageProcessing(min_pixels=64, max_pixels=4096) if mean_std is None else \
        ImageProcessing(min_pixels=64, max_pixels=4096, mean=(0.5,) * 3, std=(0.5,) * 3)
    vision = VisionConfig(patch_size=4)
    for pic in _pics([(32, 48), (21, 37), (120, 90), (5, 9), (16, 16)]):
        want = ref(images=[pic], return_tensors="np")
        got = patch_image(pic, vision, processing)
        assert list(got.grid_thw) == want["image_grid_thw"][0].tolist()
        assert got.pixels.shape == want["pixel_values"].shape
        np.testing.assert_allclose(got.pixels, want["pixel_values"], atol=1e-6, rtol=0)


def test_smart_resize_refuses_extreme_aspect_ratios():
    with pytest.raises(ValueError, match="aspect ratio is over 200"):
        smart_resize(1, 300, 8, 64, 4096)


def test_processing_settings_from_a_preprocessor_config():
    p = ImageProcessing.from_preprocessor_config(
        {"size": {"shortest_edge": 65536, "longest_edge": 16777216},
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    assert (p.min_pixels, p.max_pixels, p.mean) == (65536, 16777216, (0.5, 0.5, 0.5))
    old = ImageProcessing.from_preprocessor_config({"min_pixels": 3136, "max_pixels": 12845056})
    assert (old.min_pixels, old.max_pixels) == (3136, 12845056)


def _vl_tokenizer(folder):
    """A tiny byte-level BPE with the Qwen-VL special tokens and chat template, trained here
    (transformers' tokenizer, and ours read from the saved folder)."""
    from test_envs_chat_templates import QWEN_SPLIT, _checkpoint
    from test_models_vlm import QWEN2_VL_TEMPLATE

    from tiderl.models.tokenizer import HFTokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    hf_tok = _checkpoint(folder, split=QWEN_SPLIT, specials=specials,
                         template=QWEN2_VL_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    return hf_tok, HFTokenizer(folder)


def test_an_episode_chat_with_images_equals_apply_chat_template(tmp_path):
    """The rollout's rendering of a two-turn episode with a screenshot in each observation
    (two in the second): `Transcript` with `ImagePrompt` (the placeholders lead the user
    text, each expanded to its image's token count) gives the token ids transformers'
    Qwen2.5-VL processor gives for the same conversation, and patches equal to its
    pixel_values."""
    from test_models_vlm import QWEN2_VL_TEMPLATE
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from tiderl.envs.templates import Transcript, chatml_template

    hf_tok, tok = _vl_tokenizer(tmp_path)
    proc = object.__new__(Qwen2_5_VLProcessor)  # as test_models_vlm: no torchvision here
    proc.image_processor = Qwen2VLImageProcessorPil(**PROC)
    proc.tokenizer, proc.video_processor, proc.chat_template = hf_tok, None, QWEN2_VL_TEMPLATE
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = hf_tok.convert_tokens_to_ids("<|image_pad|>")
    proc.video_token_id = hf_tok.convert_tokens_to_ids("<|video_pad|>")
    pics = _pics([(32, 48), (21, 37), (16, 16)])
    prompt = ImagePrompt(VisionConfig(patch_size=4, image_token_id=tok.token_to_id(
        "<|image_pad|>")), ImageProcessing(min_pixels=64, max_pixels=4096))
    system = "You are a helpful assistant."
    text, patched = prompt.observation("open fridge", pics[:1])
    tr = Transcript.start(chatml_template(tok), text, system=system,
                          expand=lambda ids: prompt.expand(patched, ids))
    action = tok.encode("take apple") + [tok.token_to_id("<|im_end|>")]
    tr.add_action(action)
    text2, patched2 = prompt.observation("Taken. Score: 10/10", pics[1:])
    tr.add_observation(text2, expand=lambda ids: prompt.expand(patched2, ids))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image", "image": pics[0]},
                                     {"type": "text", "text": "open fridge"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "take apple"}]},
        {"role": "user", "content": [{"type": "image", "image": pics[1]},
                                     {"type": "image", "image": pics[2]},
                                     {"type": "text", "text": "Taken. Score: 10/10"}]},
    ]
    ref = proc.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                   return_dict=True, return_tensors="np")
    assert tr.tokens == ref["input_ids"][0].tolist()
    assert tr.loss_mask.count(1) == len(action)
    ours = patched + patched2
    assert [list(p.grid_thw) for p in ours] == ref["image_grid_thw"].tolist()
    np.testing.assert_allclose(np.concatenate([p.pixels for p in ours]), ref["pixel_values"],
                               atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="grid_thw has 1 images but the ids hold 0"):
        prompt.expand(patched, tok.encode("no placeholder here"))


@pytest.mark.asyncio
async def test_the_episode_loop_hands_screenshots_to_the_engine_as_image_tokens(tmp_path):
    """The rollout's episode loop with an `ImagePrompt` on the gui suite (a real env server;
    a host-side engine sampling digits, which records what each prefill request carried):
    each observation's screenshot is patched, its placeholder expanded in the transcript and
    handed with the turn's tokens to the engine, in order; `Trajectory.images` holds exactly
    the images of the trajectory's placeholder runs, whose M-RoPE positions then follow."""
    from tiderl.envs.adapters.gui import GuiDesktop
    from tiderl.envs.client import EnvClient
    from tiderl.envs.config import EnvConfig
    from tiderl.envs.protocol import EndReason
    from tiderl.envs.server import EnvServer
    from tiderl.envs.tasks import TaskSource
    from tiderl.envs.templates import chatml_template
    from tiderl.models.rope_index import placeholder_count, sequence_positions
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager
    from tiderl.sim.fakes import SimEngine
    from tiderl.sim.virtual_engine import DigitActions

    _, tok = _vl_tokenizer(tmp_path)
    tmpl = chatml_template(tok)
    vision = VisionConfig(patch_size=4, image_token_id=tok.token_to_id("<|image_pad|>"))
    prompt = ImagePrompt(vision, ImageProcessing(min_pixels=64, max_pixels=4096))
    seen: dict[int, list] = {}

    class Recording(SimEngine):
        def prefill_many(self, params, requests):
            out = super().prefill_many(params, requests)
            for r, h in zip(requests, out, strict=True):
                seen.setdefault(h.task_id, []).extend(r.images or [])
            return out

    cfg = EnvConfig(suite="gui", options=("width=320", "height=200", "max_turns=2"), retries=0)
    engine = Recording(max_action_tokens=4, max_context=4096, actions=DigitActions(0, length=4),
                       stop_tokens=tuple(tmpl.stop_ids))
    rank = RolloutRank(0, engine)
    await rank.start()
    sched = make_scheduler("ctb", CTBConfig(), [1 << 16], max_context=4096)
    try:
        async with EnvServer(GuiDesktop, cfg).serve() as url, EnvClient(url, cfg) as env:
            mgr = RolloutManager([rank], sched, env, tmpl, max_turns=8, images=prompt)
            trajs = await mgr.run_group(TaskSource("gui", "train", groups=1,
                                                   group_size=2).element(0))
    finally:
        await rank.close()
    from tiderl.serving.rollout import numeric_id

    for t in trajs:
        assert t.end_reason == EndReason.done, (t.end_reason, t.error)
        assert len(t.images) == t.turns >= 1  # the first observation and each one after
        got = seen[numeric_id(t.task_id)]  # handed to the engine, in order
        assert len(got) == len(t.images) and all(a is b for a, b in zip(got, t.images))
        grids = [list(p.grid_thw) for p in t.images]
        assert grids == [[1, 12, 20]] * t.turns  # 320x200 fitted under 4096 pixels
        assert t.tokens.count(vision.image_token_id) == sum(placeholder_count(grids, 2))
        assert "[image 1:" not in tok.decode(t.tokens)
        pos = sequence_positions(t.tokens, grids, vision.image_token_id, 2)
        assert pos.shape == (len(t.tokens), 3)


def test_a_runs_image_prompt_reads_the_checkpoints_processor_and_the_pixel_bound(tmp_path):
    """`image_prompt_for(model)`: None for a text policy; the checkpoint folder's
    preprocessor_config.json (pixel bounds, mean, std), else Qwen2.5-VL's; model.
    image_max_pixels bounds the area either way; an unreadable file is one ConfigError naming
    it."""
    import dataclasses
    import json

    from tiderl.configlib import ConfigError
    from tiderl.models.config import ModelConfig
    from tiderl.models.vision_inputs import image_prompt_for

    vision = VisionConfig(patch_size=4, out_dim=32)
    text = ModelConfig(d_model=32, head_dim=8, mlp_dim=64, n_heads=4, n_kv_heads=2)
    assert image_prompt_for(text) is None
    model = dataclasses.replace(text, vision=vision)
    assert image_prompt_for(model).processing == ImageProcessing()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1024, "longest_edge": 9000}, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3}))
    ckpt = dataclasses.replace(model, checkpoint=str(tmp_path))
    got = image_prompt_for(ckpt).processing
    assert (got.min_pixels, got.max_pixels, got.mean) == (1024, 9000, (0.5, 0.5, 0.5))
    bounded = image_prompt_for(dataclasses.replace(ckpt, image_max_pixels=512)).processing
    assert (bounded.min_pixels, bounded.max_pixels, bounded.std) == (512, 512, (0.5, 0.5, 0.5))
    from PIL import Image

    big = Image.new("RGB", (320, 200))
    _, [patched] = image_prompt_for(dataclasses.replace(model, image_max_pixels=4096)
                                    ).observation("x", [big])
    assert int(np.prod(patched.grid_thw)) * 16 <= 4096  # 4x4-pixel patches under the bound
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor_config.json is not a readable"):
        image_prompt_for(ckpt)
