"""The rollout engine serving a vision-language policy (Qwen2.5-VL and Qwen3-VL shapes, tiny
random weights made here): the vision tower in prefill, image tokens in the paged KV, M-RoPE
positions per task through decode, eviction + recompute, weight flushes, migration between
engines and sibling forks.

References: the policy's full forward over the whole context with all its images (the training
path: `mrope_positions`, `image_input`), and the trainer's logprob (`token_logprobs`, the
engine's temperature). Tolerances (fp32): logits 1e-5 (the brief's, tighter than the 1e-4 whole-
model default; measured about 1e-6), logprobs 1e-4.
Images are random patch rows of grids 1×8×12, 1×6×10 and 1×4×4 (24, 15 and 4 image tokens);
prefill chunks of at most 32 tokens, so chunks cut image runs and several tasks share calls.
"""

import asyncio
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl.models.config import ModelConfig, VisionConfig
from tiderl.models.policy import init_policy
from tiderl.models.vlm import image_input, mrope_positions, placeholder_count
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine
from tiderl.models.vision_inputs import PatchedImage
from tiderl.serving.pages import PrefillRequest
from tiderl.serving.rank import RolloutRank
from tiderl.train.grpo import token_logprobs

# Each test compiles a dozen kernels per family (about 2-7 min a test on the shared 2-core box).
pytestmark = pytest.mark.slow

IMAGE, START, END = 290, 292, 293
LOGITS_TOL, LOGPROB_TOL = 1e-5, 1e-4
VISION = dict(depth=2, d_model=16, n_heads=2, mlp_dim=32, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_dim=32, image_token_id=IMAGE, vision_start_token_id=START)
FAMILIES = {
    "qwen2_5_vl": dict(window_size=16, fullatt_blocks=(1,)),
    "qwen3_vl": dict(kind="qwen3_vl", act="gelu_tanh", num_position_embeddings=16,
                     deepstack_blocks=(0, 1)),
}
# One batch bucket and one chunk length: few compiled shapes on a shared 2-core box.
ROLLOUT = dict(page_size=8, num_pages=160, max_slots=4, max_context=256, max_action_tokens=5,
               decode_buckets=(4,), prefill_buckets=(32,), temperature=0.0)
FULL_LEN, FULL_PATCHES = 256, 1024
GRIDS = [(1, 8, 12), (1, 6, 10), (1, 4, 4)]
PATCH = 3 * 2 * 4 * 4


def model_config(family):
    return ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=48, qkv_bias=True, tie_embeddings=False,
                       mrope_section=(1, 2, 1), mrope_interleaved=family == "qwen3_vl",
                       vision=VisionConfig(**VISION, **FAMILIES[family]))


@functools.cache
def _model(family):
    cfg = model_config(family)
    graphdef, params = init_policy(cfg, seed=0)
    rng = np.random.default_rng(1)
    # Larger, bias-carrying weights: a peaked model whose logits depend on every input.
    params = jax.tree.map(lambda x: x + (0.15 * rng.standard_normal(x.shape)).astype(x.dtype),
                          params)
    return cfg, graphdef, params


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


def image(k, seed=0):
    g = GRIDS[k]
    rng = np.random.default_rng(100 * seed + k)
    return PatchedImage(rng.standard_normal((int(np.prod(g)), PATCH)).astype(np.float32), g)


def text(n, rng):
    return rng.integers(0, 280, n).tolist()


def with_images(parts):
    """Token ids and images of a message: ints are text runs, PatchedImages image runs."""
    ids, images = [], []
    for p in parts:
        if isinstance(p, PatchedImage):
            ids += [START] + [IMAGE] * placeholder_count([p.grid_thw], 2)[0] + [END]
            images.append(p)
        else:
            ids += p
    return ids, images


def engine(family, **kw):
    cfg, graphdef, params = _model(family)
    eng = Engine(graphdef, params, cfg, RolloutConfig(**{**ROLLOUT, **kw}), seed=3,
                 keep_logits=True)
    return eng, eng.init_decode_state()


_FULL = {}


def full_logits(family, tokens, images):
    """The training path's forward over the whole context (all images), fp32 logits [T, V]."""
    cfg, graphdef, params = _model(family)
    if family not in _FULL:
        @jax.jit
        def run(params, tokens, pos, images):
            model = nnx.merge(graphdef, params)
            return model(tokens, pos, jnp.ones_like(tokens), images=images)[0]
        _FULL[family] = run
    # Padded to one length and one patch count, so it compiles once: the forward is causal
    # (text after the context changes nothing before it) and padding patches attend only
    # to themselves.
    tokens_bt = np.zeros((1, FULL_LEN), np.int32)
    tokens_bt[0, :len(tokens)] = tokens
    grid = np.asarray([im.grid_thw for im in images]).reshape(-1, 3)
    pos = mrope_positions(tokens_bt, grid, cfg)
    inp = image_input(np.concatenate([im.pixels for im in images]), grid, cfg.vision,
                      pad_to=FULL_PATCHES)
    return np.asarray(_FULL[family](params, tokens_bt, pos, inp)[0, :len(tokens)])


def trainer_logprobs(family, tokens, images):
    """The trainer's behaviour-logprob recompute (temperature 1: greedy's logprob)."""
    logits = full_logits(family, tokens, images)[None]
    return np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray([tokens]), 1.0))[0]


def decode(eng, state, handles):
    while any(h.decoding for h in handles):
        state, _ = eng.generate(None, state)
    return state


def logged(eng, task_id):
    return [(pos, lg) for tid, pos, lg in eng.logits_log if tid == task_id]


def test_cached_decode_with_images_equals_the_full_forward(family):
    """Three tasks in shared prefill calls (two with images, one text only), two turns, an
    image in the second turn's observation: every sampled token's logits (prefill and decode)
    equal the full forward's at that position within 1e-5."""
    rng = np.random.default_rng(0)
    eng, state = engine(family)
    prompts = [with_images([text(5, rng), image(0), text(7, rng), image(1), text(3, rng)]),
               with_images([text(9, rng), image(2), text(4, rng)]),
               with_images([text(11, rng)])]
    hs = eng.prefill_many(None, [PrefillRequest(None, ids, len(ids), task_id=10 + i,
                                                images=ims)
                                 for i, (ids, ims) in enumerate(prompts)])
    for h in hs:
        state = eng.insert(h, state)
    state = decode(eng, state, hs)
    obs = [with_images([text(4, rng), image(2, seed=1), text(2, rng)]),
           with_images([text(6, rng)]), with_images([image(1, seed=2), text(3, rng)])]
    eng.prefill_many(None, [PrefillRequest(h, ids, len(ids), images=ims)
                            for h, (ids, ims) in zip(hs, obs, strict=True)])
    for h in hs:
        state = eng.insert(h, state)
    decode(eng, state, hs)
    assert eng.counters.images_encoded == 3 + 2
    for h, (ids, ims), (ids2, ims2) in zip(hs, prompts, obs, strict=True):
        assert [s.start for s in h.images] == [
            i for i in range(len(h.tokens)) if h.tokens[i] == IMAGE
            and (i == 0 or h.tokens[i - 1] != IMAGE)]
        full = full_logits(family, h.tokens, ims + ims2)
        rows = logged(eng, h.task_id)
        assert len(rows) == len(h.tokens) - len(ids) - len(ids2)
        worst = max(np.abs(lg - full[pos - 1]).max() for pos, lg in rows)
        assert worst <= LOGITS_TOL, worst
        # Decode positions continued from the rope delta (text after images moved past them).
        assert h.rope_delta == sum(max(g[1], g[2]) // 2 - g[0] * g[1] * g[2] // 4
                                   for g in (s.grid_thw for s in h.images))
    # Every kernel compiled once per shape; the encoder once per (patch bucket, attention
    # band): one bucket here, a band per power of two of the largest image in a call.
    assert set(eng.trace_counts.values()) == {1}, eng.trace_counts
    assert {k[:2] for k in eng.trace_counts if k[0] == "encode"} == {("encode", 256)}


def migrated(h):
    """The handle as a rank hands it to another (`RolloutRank._snapshot`): host data only."""
    return dataclasses.replace(h, tokens=list(h.tokens), logprobs=list(h.logprobs),
                               versions=list(h.versions), images=list(h.images), slot=None,
                               kv_length=0, decoding=False)


def play(eng, state, h, ids, ims, task_id, steps=None):
    """Prefills one turn and decodes `steps` tokens (None: to the action's end)."""
    h = eng.prefill(None, h, ids, len(ids), task_id=task_id, images=ims)
    state = eng.insert(h, state)
    while h.decoding and (steps is None or steps > 0):
        state, _ = eng.generate(None, state)
        steps = None if steps is None else steps - 1
    return h, state


def test_pause_evict_recompute_flush_and_migration_keep_the_trajectory(family):
    """One task, three turns (images in the first two), greedy, run twice: once on one engine
    uninterrupted, once evicted mid-action and recomputed (the encoder runs again on the
    patches its handle keeps), migrated to a second engine for turn 2 (everything
    recomputed there), flushed by a weight sync mid-action and recomputed again. The tokens
    are identical, and the behaviour logprobs equal both the uninterrupted run's and the
    trainer's recompute over the full sequence with its images within 1e-4."""
    rng = np.random.default_rng(1)
    turns = [with_images([text(6, rng), image(0), text(4, rng)]),
             with_images([text(3, rng), image(1), text(2, rng)]),
             with_images([text(5, rng)])]
    ref, st = engine(family)
    h = None
    acts_ref = []
    for ids, ims in turns:
        h, st = play(ref, st, h, ids, ims, 7)
        acts_ref.append((list(h.action_tokens), list(h.logprobs)))
    a, sa = engine(family)
    b, sb = engine(family)
    h, sa = play(a, sa, None, *turns[0], 7, steps=2)
    assert h.decoding
    a.evict(h)  # paused with its KV dropped, mid-action
    h, sa = play(a, sa, h, [], None, 7)  # resume: recompute prompt and the action so far
    acts = [(list(h.action_tokens), list(h.logprobs))]
    g = migrated(h)
    a.free(h)
    g, sb = play(b, sb, g, *turns[1], 7, steps=1)  # turn 2 on the other engine
    b.update_weights(b.params)  # a weight sync flushes the KV mid-action
    g, sb = play(b, sb, g, [], None, 7)
    acts.append((list(g.action_tokens), list(g.logprobs)))
    g, sb = play(b, sb, g, *turns[2], 7)
    acts.append((list(g.action_tokens), list(g.logprobs)))
    assert g.tokens == [t for ids_t, act in zip((x for x, _ in turns), (x for x, _ in acts),
                                                strict=True) for t in ids_t + act]
    assert [x for x, _ in acts] == [x for x, _ in acts_ref]
    assert a.counters.images_encoded == 2 and b.counters.images_encoded == 2 + 2
    assert b.counters.recomputed_evicted + b.counters.recomputed_version > 0
    images = turns[0][1] + turns[1][1]
    lp = trainer_logprobs(family, g.tokens, images)
    ends = np.cumsum([len(ids) + len(x) for (ids, _), (x, _) in zip(turns, acts, strict=True)])
    for (x, got), (_, want), end in zip(acts, acts_ref, ends, strict=True):
        np.testing.assert_allclose(got, want, atol=LOGPROB_TOL, rtol=0)
        np.testing.assert_allclose(got, lp[end - len(x):end], atol=LOGPROB_TOL, rtol=0)


def test_siblings_share_prompt_images_and_forks_keep_their_positions(family):
    """A group of three with one prompt holding an image: computed once (one encoding), the
    siblings sample from its logits. Greedy, their actions are equal, so their second
    observations have equal token ids but different screenshots (equal grids): a sibling
    recomputing after an eviction takes a resident sibling's pages only up to the image
    that differs. Then `fork` of a task holding two images: the children sample their own
    first tokens (T = 1) and continue at the parent's rope delta. Every logged logits row
    equals the full forward of that task's own context and images within 1e-5."""
    rng = np.random.default_rng(2)
    eng, st = engine(family)
    ids, ims = with_images([text(5, rng), image(0), text(3, rng)])
    hs = eng.prefill_many(None, [PrefillRequest(None, ids, len(ids), task_id=30 + i,
                                                images=ims, share=[]) for i in range(3)])
    assert eng.counters.images_encoded == 1 and eng.counters.shared_samples == 2
    for h in hs:
        st = eng.insert(h, st)
    st = decode(eng, st, hs)
    assert hs[0].tokens == hs[1].tokens == hs[2].tokens
    obs = [with_images([text(2, np.random.default_rng(9)), image(1, seed=i), [5, 6]])
           for i in range(3)]
    assert obs[0][0] == obs[1][0] and obs[0][1][0].pixels[0, 0] != obs[1][1][0].pixels[0, 0]
    h0, st = play(eng, st, hs[0], *obs[0], 30, steps=0)
    eng.evict(hs[1])
    shared0 = eng.counters.prompt_tokens_shared
    eng.prefill_many(None, [PrefillRequest(hs[1], *obs[1][:1], len(obs[1][0]), images=obs[1][1],
                                           share=hs)])
    # Taken from sibling 0: everything before the second image (its own differs).
    assert eng.counters.prompt_tokens_shared - shared0 == hs[1].images[1].start
    st = eng.insert(hs[1], st)
    st = decode(eng, st, [h0, hs[1]])
    eng.free(hs[2])  # room for the children's slots
    kids = eng.fork(h0, 2, [41, 42])
    for k in kids:
        assert [s.start for s in k.images] == [s.start for s in h0.images]
        assert k.rope_delta == h0.rope_delta
        eng.prefill(None, k, [], 0, temperature=1.0)
        st = eng.insert(k, st)
    decode(eng, st, kids)
    assert kids[0].tokens != kids[1].tokens or kids[0].logprobs != kids[1].logprobs
    for h, own in [(h0, obs[0][1]), (hs[1], obs[1][1]), (kids[0], obs[0][1]),
                   (kids[1], obs[0][1])]:
        full = full_logits(family, h.tokens, ims + own)
        worst = max(np.abs(lg - full[pos - 1]).max() for pos, lg in logged(eng, h.task_id))
        assert worst <= LOGITS_TOL, (h.task_id, worst)


def test_rank_turns_carry_images_through_pause_release_and_handoff(family):
    """The rank's plumbing: a turn's images reach the engine; a paused task (KV evicted) is
    released with its handle (its images' patches with it) and its next turn runs on
    another rank; a turn released before its prefill hands over its unfed tokens with their
    images. The trajectory equals one engine's uninterrupted run."""
    rng = np.random.default_rng(3)
    turns = [with_images([text(4, rng), image(2), text(3, rng)]),
             with_images([text(2, rng), image(0), text(2, rng)])]
    ref, st = engine(family)
    h = None
    for ids, ims in turns:
        h, st = play(ref, st, h, ids, ims, 5)

    async def run():
        cfg, graphdef, params = _model(family)
        a, b = (RolloutRank(i, Engine(graphdef, params, cfg, RolloutConfig(**ROLLOUT), seed=3),
                            evict_on_pause=True) for i in range(2))
        for r in (a, b):
            await r.start()
        await a.turn(1, *turns[0][:1], sample_id=5, images=turns[0][1])
        a.pause(1)
        moved = await a.release(1)
        assert moved.prefix.images and moved.prefix.kv_length == 0
        b.turn(9, turns[1][0], moved.prefix, images=turns[1][1])
        early = await b.release(9)  # before its prefill: the turn's tokens and images
        assert early.unfed == turns[1][0] and early.unfed_images == turns[1][1]
        await b.turn(1, early.unfed, early.prefix, images=early.unfed_images)
        got = b.tasks[1].prefix
        for r in (a, b):
            await r.close()
        return got, a.engine.counters.images_encoded, b.engine.counters.images_encoded

    got, enc_a, enc_b = asyncio.run(run())
    assert got.tokens == h.tokens
    assert (enc_a, enc_b) == (1, 2)
