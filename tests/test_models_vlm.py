"""Vision-language policies (Qwen2.5-VL, Qwen3-VL): parity with transformers on tiny random
checkpoints made here, HF import → export round trip, M-RoPE positions, a frozen tower.

Images: two random RGB images of different sizes (32×48 and 21×37 pixels) through transformers'
`Qwen2VLImageProcessorPil` built locally with explicit arguments (patch 4, temporal patch 2,
merge 2), so `pixel_values`/`image_grid_thw` are exactly what the processor hands a model
(grids 1×8×12 and 1×6×10: 24 and 15 image tokens). Tolerance: max |Δlogits| ≤ 1e-4 in fp32
against transformers' torch CPU forward (whole-model fp32 tolerance, as for the text families;
measured about 3e-6 on logits of scale 3). Two language and two vision layers; the tests that
compile gradients, meshes or a second layout are marked slow (about a minute each on the
shared 2-core box).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiderl.models.hf import from_pretrained, load_hf_config, save_pretrained  # noqa: E402
from tiderl.models.policy import abstract_policy, init_policy  # noqa: E402
from tiderl.models.vlm import image_input, mrope_positions, placeholder_count  # noqa: E402

TOL = 1e-4
IMAGE, VIDEO, START, END = 290, 291, 292, 293
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.1)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
              initializer_range=0.1)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
              vision_end_token_id=END)


def qwen25_config():
    # window 16 px = 2 merged tokens per side: the 4×6 and 3×5 merged grids split into 2×3
    # windows (partial ones at the 3×5 image's edges); block 1 attends over the whole image.
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(**TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                      mrope_section=[2, 3, 3])),
        vision_config=dict(**VISION, window_size=16, fullatt_block_indexes=[1]),
        tie_word_embeddings=False, **TOKENS)


def qwen3_config():
    return transformers.Qwen3VLConfig(
        text_config=dict(**TEXT, head_dim=16, rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3],
            mrope_interleaved=True)),
        vision_config=dict(**VISION, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                           hidden_act="gelu_pytorch_tanh"),
        tie_word_embeddings=False, **TOKENS)


FAMILIES = {"qwen2_5_vl": (qwen25_config, "Qwen2_5_VLForConditionalGeneration"),
            "qwen3_vl": (qwen3_config, "Qwen3VLForConditionalGeneration")}


def make_hf(family, path, seed=0):
    torch.manual_seed(seed)
    conf_fn, cls = FAMILIES[family]
    model = getattr(transformers, cls)(conf_fn())
    # Random biases, norm scales and position tables too, so every mapping is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
            elif "pos_embed" in name or "patch_embed" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def processed_images(sizes=((32, 48), (21, 37)), seed=0):
    """pixel_values and image_grid_thw as the Qwen2-VL image processor produces them."""
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    min_pixels=8 * 8, max_pixels=64 * 64)
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = proc(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def chat_tokens(grid, texts, rng):
    """Text runs with each image's placeholders (between vision start/end) after run k."""
    counts = placeholder_count(grid, 2)
    ids = []
    for k, n in enumerate(texts):
        ids += rng.integers(0, 280, n).tolist()
        if k < len(counts):
            ids += [START] + [IMAGE] * counts[k] + [END]
    return np.asarray(ids)


def hf_logits(model, tokens_bt, pixels, grid):
    ids = torch.tensor(tokens_bt)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                    pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                    mm_token_type_ids=(ids == IMAGE).int())
    return out.logits.numpy()


_JITTED = {}


def forward(model, tokens_bt, pos, segs, images, cache=None):
    """The model's call, jitted once per model (eager NNX on a loaded CPU is slow)."""
    key = id(model)
    if key not in _JITTED:
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state, tokens, pos, segs, images, cache):
            return nnx.merge(graphdef, state)(tokens, pos, segs, cache=cache, images=images)

        _JITTED[key] = (run, state, model)  # the model kept alive: its id stays unique
    run, state, _ = _JITTED[key]
    return run(state, jnp.asarray(tokens_bt), jnp.asarray(pos), jnp.asarray(segs), images, cache)


def our_logits(model, cfg, tokens_bt, pixels, grid):
    images = image_input(pixels, grid, cfg.vision)
    pos = mrope_positions(tokens_bt, grid, cfg)
    return np.asarray(forward(model, tokens_bt, pos, np.ones(tokens_bt.shape, np.int32),
                              images)[0])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param, path)
    return request.param, path, hf, from_pretrained(path, dtype="float32")


def test_multi_image_chat_logits_match_transformers(family):
    name, path, hf, ours = family
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    diff = np.abs(our_logits(ours, ours.cfg, tokens, pixels, grid)
                  - hf_logits(hf, tokens, pixels, grid)).max()
    assert diff <= TOL, (name, diff)


def test_batch_of_one_image_rows_of_two_sizes_matches_transformers(family):
    name, path, hf, ours = family
    pixels, grid = processed_images()
    rng = np.random.default_rng(2)
    # 24 and 15 image tokens: text runs chosen so both rows are 40 tokens long.
    rows = [chat_tokens(grid[:1], [6, 8], rng), chat_tokens(grid[1:], [12, 11], rng)]
    tokens = np.stack(rows)
    diff = np.abs(our_logits(ours, ours.cfg, tokens, pixels, grid)
                  - hf_logits(hf, tokens, pixels, grid)).max()
    assert diff <= TOL, (name, diff)


def test_text_only_call_matches_transformers(family):
    name, path, hf, ours = family
    tokens = np.random.default_rng(3).integers(0, 280, (2, 13))
    with torch.no_grad():
        expect = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    pos = np.broadcast_to(np.arange(13), (2, 13))
    logits, _ = forward(ours, tokens, pos, np.ones((2, 13), np.int32), None)
    assert np.abs(np.asarray(logits) - expect).max() <= TOL


def test_mrope_positions_equal_get_rope_index(family):
    name, path, hf, ours = family
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    ids = torch.tensor(tokens)
    expect, _ = hf.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                        image_grid_thw=torch.tensor(grid))
    got = mrope_positions(tokens, grid, ours.cfg)
    np.testing.assert_array_equal(got, expect.numpy().transpose(1, 2, 0))


def test_import_export_round_trip(family, tmp_path):
    name, path, hf, ours = family
    out = save_pretrained(ours, tmp_path / "out", base_config=json.loads(
        (path / "config.json").read_text()))
    from safetensors.numpy import load_file

    src, dst = load_file(str(path / "model.safetensors")), load_file(str(out /
                                                                         "model.safetensors"))
    assert sorted(src) == sorted(dst)
    for k in src:
        np.testing.assert_array_equal(src[k], dst[k], err_msg=k)
    assert load_hf_config(out) == load_hf_config(path).__class__(
        **{**load_hf_config(path).__dict__, "checkpoint": str(out)})
    # transformers loads the export and computes the same logits.
    again = getattr(transformers, FAMILIES[name][1]).from_pretrained(out).eval()
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [3, 2, 2], np.random.default_rng(4))[None]
    np.testing.assert_array_equal(hf_logits(again, tokens, pixels, grid),
                                  hf_logits(hf, tokens, pixels, grid))


@pytest.mark.slow
def test_frozen_tower_gets_no_gradient(family):
    name, path, hf, ours = family
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    images = image_input(pixels, grid, ours.cfg.vision)
    pos = jnp.asarray(mrope_positions(tokens, grid, ours.cfg))
    params = nnx.state(ours, nnx.Param)

    def sums(train_vision):
        cfg = dataclasses.replace(ours.cfg, train_vision=train_vision)
        graphdef, _ = abstract_policy(cfg)

        def loss(p):
            logits, _ = nnx.merge(graphdef, p)(jnp.asarray(tokens), pos,
                                               jnp.ones(tokens.shape, jnp.int32), images=images)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

        g = jax.jit(jax.grad(loss))(params)
        return (sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(g["visual"])),
                sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(g["layers"])))

    trained, frozen = sums(True), sums(False)
    assert trained[0] > 0 and frozen[0] == 0.0
    assert frozen[1] == pytest.approx(trained[1], rel=1e-6)


def test_bad_image_inputs_name_the_problem(family):
    name, path, hf, ours = family
    pixels, grid = processed_images()
    cfg = ours.cfg
    with pytest.raises(ValueError, match="patch rows but grid_thw"):
        image_input(pixels[:-4], grid, cfg.vision)
    with pytest.raises(ValueError, match=r"expected \[patches, 96\]"):
        image_input(pixels[:, :-1], grid, cfg.vision)
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    with pytest.raises(ValueError, match="more image placeholder runs"):
        mrope_positions(tokens, grid[:1], cfg)
    with pytest.raises(ValueError, match="placeholder run at token 6"):
        mrope_positions(tokens[:, :10], grid, cfg)  # the first image's run cut short
    with pytest.raises(ValueError, match="more image"):
        mrope_positions(tokens[:, :5], grid, cfg)
    short = np.concatenate([tokens[:, :20], tokens[:, 21:]], axis=1)  # one placeholder fewer
    with pytest.raises(ValueError, match="placeholder run at token"):
        mrope_positions(short, grid, cfg)


def test_config_errors():
    from tiderl.configlib import ConfigError
    from tiderl.models.config import ModelConfig, VisionConfig

    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig(head_dim=16, mrope_section=(2, 3, 4))
    with pytest.raises(ConfigError, match="out_dim"):
        ModelConfig(d_model=64, vision=VisionConfig(out_dim=32))
    with pytest.raises(ConfigError, match="fullatt_blocks"):
        VisionConfig(depth=2, fullatt_blocks=(2,))
    with pytest.raises(ConfigError, match="scan_layers"):
        ModelConfig(d_model=64, scan_layers=True, vision=VisionConfig(deepstack_blocks=(0,)))


@pytest.mark.slow
def test_scanned_layers_layout_computes_the_same_and_exports_the_same(tmp_path):
    """model.scan_layers on Qwen2.5-VL: stacked language layers, the tower as it is; the same
    logits (exactly, here) and a byte-equal export."""
    from safetensors.numpy import load_file

    hf = make_hf("qwen2_5_vl", tmp_path / "src")
    ours = from_pretrained(tmp_path / "src")
    scanned = from_pretrained(tmp_path / "src", scan_layers=True)
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    diff = np.abs(our_logits(scanned, scanned.cfg, tokens, pixels, grid)
                  - our_logits(ours, ours.cfg, tokens, pixels, grid)).max()
    assert diff <= 1e-6
    assert np.abs(our_logits(ours, ours.cfg, tokens, pixels, grid)
                  - hf_logits(hf, tokens, pixels, grid)).max() <= TOL
    src = load_file(str(tmp_path / "src" / "model.safetensors"))
    out = load_file(str(save_pretrained(scanned, tmp_path / "out") / "model.safetensors"))
    assert sorted(src) == sorted(out)
    assert all(np.array_equal(src[k], out[k]) for k in src)


@pytest.mark.slow
def test_fresh_vlm_builds_from_config_and_runs_text_only():
    from tiderl.models.config import ModelConfig, VisionConfig

    cfg = ModelConfig(vocab_size=300, d_model=64, head_dim=16, mrope_section=(2, 3, 3),
                      vision=VisionConfig(out_dim=64, patch_size=4, image_token_id=IMAGE))
    model = nnx.merge(*init_policy(cfg))
    logits, _ = forward(model, np.zeros((1, 4), np.int32), np.zeros((1, 4), np.int32),
                        np.ones((1, 4), np.int32), None)
    assert logits.shape == (1, 4, 300)


QWEN2_VL_TEMPLATE = (  # the Qwen2-VL / Qwen2.5-VL chat template (tokenizer_config.json)
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_multi_image_chat_ids_equal_the_processors_apply_chat_template(tmp_path):
    """A tiny byte-level BPE with the Qwen-VL special tokens, trained here; the reference is
    transformers' Qwen2_5_VLProcessor.apply_chat_template (its own rendering, tokenizing and
    placeholder expansion). The processor is assembled without its constructor, whose class
    check wants a video processor, which needs torchvision (not installed); images only."""
    import PIL.Image
    from test_envs_chat_templates import QWEN_SPLIT, _checkpoint
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from tiderl.envs.chat_templates import compile_chat_template
    from tiderl.models.config import VisionConfig
    from tiderl.models.tokenizer import HFTokenizer
    from tiderl.models.vlm import expand_image_placeholders

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    hf_tok = _checkpoint(tmp_path, split=QWEN_SPLIT, specials=specials,
                         template=QWEN2_VL_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    proc = object.__new__(Qwen2_5_VLProcessor)
    proc.image_processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2,
                                                    merge_size=2, min_pixels=64, max_pixels=4096)
    proc.tokenizer, proc.video_processor, proc.chat_template = hf_tok, None, QWEN2_VL_TEMPLATE
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = hf_tok.convert_tokens_to_ids("<|image_pad|>")
    proc.video_token_id = hf_tok.convert_tokens_to_ids("<|video_pad|>")
    rng = np.random.default_rng(0)
    pics = [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((32, 48), (21, 37), (16, 16))]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": pics[0]},
                                     {"type": "text", "text": "open fridge"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "take apple"}]},
        {"role": "user", "content": [{"type": "text", "text": "Taken. Score: 10/10"},
                                     {"type": "image", "image": pics[1]},
                                     {"type": "image", "image": pics[2]}]},
    ]
    ref = proc.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                   return_dict=True, return_tensors="np")
    ours_tok = HFTokenizer(tmp_path)
    text = compile_chat_template(QWEN2_VL_TEMPLATE).render(messages=messages,
                                                             add_generation_prompt=True)
    vision = VisionConfig(patch_size=4, image_token_id=ours_tok.token_to_id("<|image_pad|>"))
    ids = expand_image_placeholders(ours_tok.encode(text), ref["image_grid_thw"], vision)
    assert ids == ref["input_ids"][0].tolist()
    assert ids.count(vision.image_token_id) == 24 + 15 + 4
    with pytest.raises(ValueError, match=r"grid_thw has 3 images but the ids hold \d"):
        expand_image_placeholders(ours_tok.encode(text)[:-20], ref["image_grid_thw"], vision)


@pytest.mark.slow
def test_packed_row_under_jit_equals_separate_forwards(family):
    """Two image conversations packed in one row (segment ids 1, 2; positions restart per
    segment) give each the logits it gets alone, under jit; tolerance 1e-5 (fp32, same
    arithmetic up to reduction order)."""
    name, path, hf, ours = family
    pixels, grid = processed_images()
    rng = np.random.default_rng(5)
    a, b = chat_tokens(grid[:1], [4, 3], rng), chat_tokens(grid[1:], [2, 5], rng)
    tokens = np.concatenate([a, b])[None]
    segs = np.concatenate([np.full(len(a), 1), np.full(len(b), 2)])[None]
    packed = forward(ours, tokens, mrope_positions(tokens, grid, ours.cfg, segs), segs,
                     image_input(pixels, grid, ours.cfg.vision,
                                 pad_to=pixels.shape[0] + 8))[0]
    split = int(grid[0].prod())
    for (lo, hi), px, g in (((0, len(a)), pixels[:split], grid[:1]),
                            ((len(a), tokens.shape[1]), pixels[split:], grid[1:])):
        alone = our_logits(ours, ours.cfg, tokens[:, lo:hi], px, g)
        assert np.abs(np.asarray(packed[:, lo:hi]) - alone).max() <= 1e-5


@pytest.mark.slow
def test_lora_adapts_the_language_model_of_a_vlm(family):
    """trainer.lora_rank on a VLM: adapters on the language model's projections only; the
    fresh adapters (B = 0) leave the logits as the base's, non-zero ones change them."""
    from tiderl.models.lora import LoraSpec
    from tiderl.models.policy import lora_policy

    name, path, hf, ours = family
    graphdef, adapters, _ = lora_policy(ours.cfg, LoraSpec(4, 8.0))
    paths = [p for p, _ in nnx.to_flat_state(adapters)]
    assert paths and all(p[0] == "layers" for p in paths)
    base = nnx.state(ours, nnx.Param)
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    images = image_input(pixels, grid, ours.cfg.vision)
    pos = jnp.asarray(mrope_positions(tokens, grid, ours.cfg))

    @jax.jit
    def logits(adapters):
        model = nnx.merge(graphdef, adapters, base)
        return model(jnp.asarray(tokens), pos, jnp.ones(tokens.shape, jnp.int32),
                     images=images)[0]

    def run(adapters):
        return np.asarray(logits(adapters))

    expect = our_logits(ours, ours.cfg, tokens, pixels, grid)
    assert np.abs(run(adapters) - expect).max() <= 1e-5
    bumped = jax.tree.map(lambda x: x + 0.05, adapters)
    assert np.abs(run(bumped) - expect).max() > 1e-3


@pytest.mark.slow
def test_sharded_import_matches_and_the_config_round_trips_through_yaml_data(family):
    """from_pretrained(mesh=fsdp 2 × model 2) places every tensor (vision tower included) in
    its sharding and computes the same logits (≤ 1e-5 of the single-device ones); the
    ModelConfig of a VLM checkpoint survives to_dict/from_dict (what a run's config.yaml
    holds)."""
    from tiderl.configlib import from_dict, to_dict
    from tiderl.models.config import ModelConfig
    from tiderl.models.sharding import make_mesh

    name, path, hf, ours = family
    assert from_dict(ModelConfig, to_dict(ours.cfg)) == ours.cfg
    mesh = make_mesh(jax.devices()[:4], fsdp=2, model=2)
    sharded = from_pretrained(path, dtype="float32", mesh=mesh)
    qkv = sharded.visual.blocks[0].qkv.w_io[...]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", "model")
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(1))[None]
    diff = np.abs(our_logits(sharded, sharded.cfg, tokens, pixels, grid)
                  - our_logits(ours, ours.cfg, tokens, pixels, grid)).max()
    assert diff <= 1e-5


@pytest.mark.slow
def test_cached_decode_after_an_image_prefill_equals_the_full_forward(family):
    """The serving path: a prompt with two images prefilled into the engine's paged KV
    (`PagedKV`, the reference kernel), then 4 text tokens decoded one at a time at M-RoPE
    positions continuing the prompt's (max + 1 on all three axes); each step's logits equal
    the full forward's at that token within 1e-5 (fp32)."""
    from tiderl.serving.kv import PagedKV, init_pools

    name, path, hf, ours = family
    cfg = ours.cfg
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [5, 7, 4], np.random.default_rng(6))[None]
    prompt, new = tokens.shape[1] - 4, 4
    pos = mrope_positions(tokens, grid, cfg)
    full = our_logits(ours, cfg, tokens, pixels, grid)
    page, pages = 8, -(-tokens.shape[1] // 8)
    pools = init_pools(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       num_pages=pages, page_size=page, dtype=jnp.float32)
    table = jnp.arange(pages, dtype=jnp.int32)[None]

    def cache_at(start, n):
        return PagedKV(pools, table, jnp.asarray([start], jnp.int32), jnp.asarray([n], jnp.int32))

    images = image_input(pixels, grid, cfg.vision)
    logits, cache = forward(ours, tokens[:, :prompt], pos[:, :prompt],
                            np.ones((1, prompt), np.int32), images, cache_at(0, prompt))
    assert np.abs(np.asarray(logits) - full[:, :prompt]).max() <= 1e-5
    next_pos = pos[0, :prompt].max() + 1
    for i in range(new):
        pools = cache.pools
        t = prompt + i
        np.testing.assert_array_equal(pos[0, t], [next_pos + i] * 3)  # text after the prompt
        logits, cache = forward(ours, tokens[:, t:t + 1], pos[:, t:t + 1],
                                np.ones((1, 1), np.int32), None, cache_at(t, 1))
        assert np.abs(np.asarray(logits)[:, 0] - full[:, t]).max() <= 1e-5, i


def test_query_chunked_vision_attention_equals_dense(family):
    """The tower with attention 8 and 32 queries at a time (padding rows too), reading all
    keys or only the band of keys within the longest image of each chunk, gives the dense
    tower's features within 2e-6 (fp32: chunks sum in another order)."""
    name, path, hf, ours = family
    pixels, grid = processed_images(sizes=((21, 37), (16, 16), (21, 37), (16, 24), (21, 37)))
    images = image_input(pixels, grid, ours.cfg.vision, pad_to=pixels.shape[0] + 4)
    band = images.band_l.shape[0]
    assert band >= int((np.asarray(grid)[:, 1] * np.asarray(grid)[:, 2]).max())
    assert 8 + 2 * band < pixels.shape[0]  # the banded path runs at chunk 8
    run = jax.jit(lambda im, chunk: ours.visual(im, attn_chunk=chunk), static_argnums=1)
    dense, deep_dense = run(images, 0)
    n = pixels.shape[0] // 4  # the real rows' merged features
    for chunk in (8, 32):
        for inp in (images, images._replace(band_l=None)):
            chunked, deep_chunked = run(inp, chunk)
            assert np.abs(np.asarray(dense - chunked)[:n]).max() <= 2e-6, (chunk, inp.band_l)
            for a, b in zip(deep_dense, deep_chunked, strict=True):
                assert np.abs(np.asarray(a - b)[:n]).max() <= 2e-6


def test_the_older_flat_qwen2_5_vl_config_loads_and_exports(tmp_path):
    """Qwen2.5-VL checkpoints on the Hub keep the text keys at the top of config.json with
    rope_scaling {type: mrope, mrope_section}; they load as the nested form does, and an export
    on top of one is nested and loads in transformers with the same logits."""
    src = tmp_path / "src"
    hf = make_hf("qwen2_5_vl", src)
    nested = json.loads((src / "config.json").read_text())
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**nested, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (src / "config.json").write_text(json.dumps(flat))
    ours = from_pretrained(src)
    assert ours.cfg.mrope_section == (2, 3, 3) and ours.cfg.rope_theta == rope["rope_theta"]
    out = save_pretrained(ours, tmp_path / "out", base_config=flat)
    written = json.loads((out / "config.json").read_text())
    assert "rope_scaling" not in written and "num_attention_heads" not in written
    again = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    pixels, grid = processed_images()
    tokens = chat_tokens(grid, [3, 2, 2], np.random.default_rng(4))[None]
    np.testing.assert_array_equal(hf_logits(again, tokens, pixels, grid),
                                  hf_logits(hf, tokens, pixels, grid))
