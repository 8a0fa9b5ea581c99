"""Training a vision-language policy: a frozen vision tower gets no optimizer update (weight
decay included) and no optimizer state; packed micro-batches with images give the gradient of
the fused loss over the unpacked sequences; the sliding image window's segments are trained.

A tiny random VLM (Qwen2.5-VL layout: 1 language layer, 1 vision block, patch 2, merge 2) on 4
fake CPU devices (data 2 × fsdp 2); images are random patch rows (no processor needed)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from tiderl.models.config import ModelConfig, VisionConfig
from tiderl.models.policy import init_policy
from tiderl.models.sharding import make_mesh
from tiderl.train.backend import TrainerBackend
from tiderl.train.config import TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.synthetic import synthetic_trajectories

IMAGE = 60
VLM = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, max_seq_len=256, mrope_section=(1, 1, 2),
                  vision=VisionConfig(depth=1, d_model=16, n_heads=2, mlp_dim=32, patch_size=2,
                                      out_dim=32, window_size=8, image_token_id=IMAGE))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(jax.devices()[:4], data=2, fsdp=2)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_frozen_tower_gets_no_update_and_no_optimizer_state(mesh):
    """train_vision=false: the tower's params are bit-identical after a step with weight decay
    and its leaves have no AdamW moments; with train_vision=true weight decay alone moves them
    (text-only batches: zero gradient), so the check can fail; `trainer.vision_lr_scale`
    scales that move."""
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.0, weight_decay=0.1, lr=1e-2)
    trajs = synthetic_trajectories(8, vocab=IMAGE, min_len=6, max_len=20, seed=0)
    mbs = microbatches(trajs, n_ranks=2, row_len=64, rows_per_rank=2)[0]
    moved = {}
    for train_vision, scale in ((True, 1.0), (False, 1.0), (True, 0.01)):
        model = dataclasses.replace(VLM, train_vision=train_vision)
        policy = init_policy(model, seed=0)
        before = _leaves(policy[1]["visual"])
        be = TrainerBackend(dataclasses.replace(cfg, vision_lr_scale=scale), model,
                            actor_mesh=mesh, policy=policy)
        be.train_step(mbs)
        after = be.state["params"]
        moved[train_vision, scale] = max(float(np.abs(a - b).max())
                                  for a, b in zip(_leaves(after["visual"]), before, strict=True))
        lm = max(float(np.abs(a - b).max()) for a, b in
                 zip(_leaves(after["layers"]), _leaves(policy[1]["layers"]), strict=True))
        assert lm > 0
        moments = [x for x in jax.tree.leaves(be.state["opt"]) if x.ndim > 0]
        n_params = len(jax.tree.leaves(after))
        n_visual = len(jax.tree.leaves(after["visual"]))
        # AdamW keeps mu and nu per trained leaf; a frozen leaf has none.
        assert len(moments) == 2 * (n_params - (0 if train_vision else n_visual))
        be.close()
    assert moved[False, 1.0] == 0.0 and moved[True, 1.0] > 0.0
    # A 1e-5 move read off fp32 params (|p| up to ~0.1, spacing ~7e-9): 1e-2 relative.
    np.testing.assert_allclose(moved[True, 0.01], 0.01 * moved[True, 1.0], rtol=1e-2)


def test_optimizer_mask_leaves_named_params_alone():
    from tiderl.train.ref_actor import frozen_labels, make_optimizer

    params = {"visual": {"w": np.ones(3, np.float32)}, "embed": np.ones(2, np.float32)}
    assert frozen_labels(params, ("visual",)) == {"visual": {"w": "frozen"}, "embed": "train"}
    tx = make_optimizer(TrainerConfig(weight_decay=0.5, lr=0.1, grad_clip=0.0), ("visual",))
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.array_equal(new["visual"]["w"], params["visual"]["w"])
    assert not np.allclose(new["embed"], params["embed"])


def test_the_towers_learning_rate_scale_scales_its_whole_adamw_update():
    """`trainer.vision_lr_scale`: the tower's AdamW step (weight decay included) is the
    decoder's times the scale, for the same gradients; the clip stays global."""
    from tiderl.config import load_config
    from tiderl.configlib import ConfigError
    from tiderl.train.ref_actor import frozen_labels, make_optimizer

    params = {"visual": {"w": np.full(3, 2.0, np.float32)}, "embed": np.full(3, 2.0, np.float32)}
    assert frozen_labels(params, (), {"visual": 0.1}) == {"visual": {"w": "scaled:visual"},
                                                         "embed": "train"}
    cfg = TrainerConfig(weight_decay=0.5, lr=0.1, grad_clip=0.0)
    tx = make_optimizer(cfg, (), (("visual", 0.01),))
    grads = {"visual": {"w": np.asarray([1.0, -2.0, 3.0], np.float32)},
             "embed": np.asarray([1.0, -2.0, 3.0], np.float32)}
    state = tx.init(params)
    for _ in range(3):  # the params held equal, so weight decay reads the same values in both
        updates, state = tx.update(grads, state, params)
        np.testing.assert_allclose(updates["visual"]["w"], 0.01 * updates["embed"], rtol=1e-6)
        assert np.abs(updates["embed"]).min() > 0
    with pytest.raises(ConfigError, match=r"trainer.vision_lr_scale'=0.1 scales a trained "
                                          r"vision tower's learning rate, and this run trains"):
        load_config(None, ["trainer.vision_lr_scale=0.1"])
    with pytest.raises(ConfigError, match="trainer.vision_lr_scale' must be positive"):
        TrainerConfig(vision_lr_scale=0.0)


PATCH_F = 3 * 2 * 2 * 2  # channels · temporal patch · patch²
GRIDS = ((1, 4, 4), (1, 2, 6), (1, 4, 2), (1, 2, 2))  # 4, 3, 2, 1 image tokens


def _image(rng, grid):
    return (rng.standard_normal((int(np.prod(grid)), PATCH_F)).astype(np.float32),
            np.asarray(grid))


def _image_sequence(uid, rng, n_images, adv=None, version=0):
    """Text runs with `n_images` placeholder runs between them; the last text run of each
    turn after an image is the action (as an observation's image then the policy's reply)."""
    from tiderl.models.vlm import placeholder_count
    from tiderl.train.dispatch import TrainSequence

    images = [_image(rng, GRIDS[int(rng.integers(len(GRIDS)))]) for _ in range(n_images)]
    tokens, mask = list(rng.integers(1, IMAGE, 3)), [0, 0, 0]
    for k in range(max(n_images, 1)):
        if k < n_images:
            n = placeholder_count(images[k][1], 2)[0]
            tokens += [IMAGE] * n
            mask += [0] * n
        obs, act = int(rng.integers(1, 4)), int(rng.integers(2, 5))
        tokens += list(rng.integers(1, IMAGE, obs + act))
        mask += [0] * obs + [1] * act
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    return TrainSequence(uid, tokens, np.asarray(mask, bool),
                         rng.normal(-3.0, 0.3, n).astype(np.float32),
                         float(rng.normal()) if adv is None else adv,
                         np.full(n, version, np.int32), images=tuple(images))


def _unpacked_batch(seqs, vision):
    """Each sequence alone in a row of its own (padded to the longest), the images in row
    order: no packing."""
    from tiderl.models.vlm import image_input, mrope_positions

    n, t = len(seqs), max(s.length for s in seqs)
    batch = {"tokens_bt": np.zeros((n, t), np.int32), "segment_ids_bt": np.zeros((n, t), np.int32),
             "positions_bt": np.zeros((n, t, 3), np.int32)}
    for k in ("loss_mask_bt", "behaviour_logprobs_bt", "advantages_bt"):
        batch[k] = np.zeros((n, t), np.float32)
    batch["versions_bt"] = np.zeros((n, t), np.int32)
    for b, s in enumerate(seqs):
        at = slice(0, s.length)
        m = s.action_mask.astype(np.float32)
        batch["tokens_bt"][b, at] = s.tokens
        batch["segment_ids_bt"][b, at] = 1
        batch["loss_mask_bt"][b, at] = m
        batch["behaviour_logprobs_bt"][b, at] = np.where(m > 0, s.behaviour_logprobs, 0.0)
        batch["advantages_bt"][b, at] = s.advantage
        batch["versions_bt"][b, at] = s.versions
    images = [im for s in seqs for im in s.images]
    grid = np.stack([g for _, g in images])
    batch["positions_bt"] = mrope_positions(batch["tokens_bt"], grid, VLM,
                                            batch["segment_ids_bt"]).astype(np.int32)
    batch["images"] = image_input(np.concatenate([p for p, _ in images]), grid, vision)
    return batch


GRAD_RTOL = 1e-5  # relative L2 error of the whole gradient tree, fp32 (packing reorders sums)


@pytest.mark.slow
def test_packed_images_give_the_fused_gradient_of_the_unpacked_sequences(mesh):
    """A packed micro-batch of image sequences through the deferred path (Ref forward, Actor
    forward's vjp, cotangent in the backward) gives `jax.grad` of the fused loss summed over
    the sequences one by one (each with only its own images), vision tower included; the Ref
    logprobs (its own tower) equal the per-sequence ones."""
    from tiderl.models.vlm import placeholder_count

    rng = np.random.default_rng(0)
    seqs = [_image_sequence(i, rng, n) for i, n in enumerate([2, 1, 0, 3, 1, 2, 0, 1])]
    mbs, rest = microbatches(seqs, n_ranks=4, row_len=64, rows_per_rank=2)
    assert len(mbs) == 1 and not rest
    mb = mbs[0]
    assert max(len(set(row[row > 0].tolist())) for row in mb.segment_ids_bt) >= 2  # packed
    # The images, in the row-major order of the placeholder runs.
    runs = [n for n in placeholder_count(np.stack([g for _, g in mb.images]), 2)]
    assert sum(runs) == int((mb.tokens_bt == IMAGE).sum()) and len(mb.images) == 10
    err, vis, ref, refs = _packed_vs_fused(seqs, mb, mesh)
    print(f"packed vs unpacked fused gradient: rel L2 {err:.2e} (vision tower {vis:.2e})")
    assert err <= GRAD_RTOL and vis <= GRAD_RTOL
    # Ref logprobs per sequence, read back out of the packed rows by (row, segment).
    i = 0
    for b in range(mb.tokens_bt.shape[0]):
        for seg in range(1, int(mb.segment_ids_bt[b].max()) + 1):
            at = mb.segment_ids_bt[b] == seg
            uid = mb.uids[i]
            n = int(at.sum())
            np.testing.assert_allclose(ref[b, at][1:], refs[uid, 1:n], atol=1e-5)
            i += 1


def _packed_vs_fused(seqs, mb, mesh):
    """(relative L2 error of the packed micro-batch's deferred-path gradient sum against
    `jax.grad` of the fused loss over `seqs` unpacked (a row each), the same for the vision
    tower alone, the packed Ref logprobs, the unpacked ones [seq, T]). KL on, against a
    perturbed Ref."""
    import jax.numpy as jnp

    from tiderl.train.grpo import loss_sum
    from tiderl.train.ref_actor import make_logprobs, make_outputs

    cfg = TrainerConfig(actor_devices=4, kl_coef=0.1)
    graphdef, params = init_policy(VLM, seed=0)
    ref_params = jax.tree.map(lambda x: x + 0.02 * jnp.sin(jnp.arange(x.size).reshape(x.shape)
                                                           ).astype(x.dtype), params)
    be = TrainerBackend(cfg, VLM, actor_mesh=mesh, policy=(graphdef, params),
                        ref_params=ref_params)
    batch = be.put(mb, "actor")
    assert batch["positions_bt"].shape == (*mb.tokens_bt.shape, 3)
    ref = be.ref_forward(batch)
    outs, vjp = be.actor_forward(batch)
    grads, _ = be.k.backward(vjp, outs, ref, batch, jnp.int32(0), None)
    be.close()
    outputs = make_outputs(graphdef, 1.0, entropy_grad=False)
    ref_lp = make_logprobs(graphdef, 1.0)
    alone = _unpacked_batch(seqs, VLM.vision)

    @jax.jit
    def fused(p, r):
        refs = ref_lp(r, alone)
        total = lambda q: loss_sum(outputs(q, alone), refs, alone, jnp.int32(0),  # noqa: E731
                                   be.spec)[0]
        return jax.grad(total)(p), refs

    want, refs = fused(params, ref_params)
    assert float(sum(np.abs(x).sum() for x in _leaves(grads["visual"]))) > 0
    return (_rel_err(grads, want), _rel_err(grads["visual"], want["visual"]), np.asarray(ref),
            np.asarray(refs))


def _rel_err(a, b) -> float:
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(_leaves(a), _leaves(b), strict=True))
    den = sum(float(np.sum(y ** 2)) for y in _leaves(b))
    assert den > 0
    return (num / den) ** 0.5


HEAD = [61, 5, 6, 7, 62]  # the system and task prompt: every segment starts with it


def _windowed_rollout(rng, n_images, window=10, keep=5):
    """A task played turn by turn as the rollout plays it: observation k (an opening token,
    image k's placeholder run, a text token), then the policy's 2-token action; before each
    observation the context is cut when it holds `window` images. Returns (segments, the
    turns' (observation ids, image, action ids, action logprobs))."""
    from tiderl.models.vlm import placeholder_count
    from tiderl.train.image_window import Segment, cut, needs_cut

    ctx = Segment(list(HEAD), [0] * len(HEAD), [0.0] * len(HEAD), [-1] * len(HEAD),
                  image_token=IMAGE)
    segments, turns = [], []
    for k in range(n_images):
        if needs_cut(ctx, window):
            done, ctx = cut(ctx, head_len=len(HEAD), keep=keep)
            segments.append(done)
        image = _image(rng, GRIDS[k % len(GRIDS)])
        obs = [50 + k % 3] + [IMAGE] * placeholder_count(image[1], 2)[0] + [40]
        act = [1 + k, 20 + k]
        lp = rng.normal(-2.0, 0.3, 2).round(3).tolist()
        ctx.add_observation(obs, [image])
        ctx.add_action(act, lp, version=0)
        turns.append((obs, image, act, lp))
    return segments + [ctx], turns


def test_twelve_images_become_two_segments():
    """Window 10, keep 5 (the paper's): a 12-image trajectory is cut once, before its 11th
    observation. Segment 1 is the head + turns 1–10 (images 1–10, every action trained);
    segment 2 is the head + turns 6–12 (images 6–12), turns 6–10 as context and the actions
    of turns 11–12 trained. Both, packed with the trajectory's advantage, reach the loss."""
    segments, _ = _check_twelve_image_segments()
    adv = 0.75
    seqs = [seg.sequence(uid, adv) for uid, seg in enumerate(segments)]
    mbs, _ = microbatches(seqs, n_ranks=4, row_len=128, rows_per_rank=1)
    assert len(mbs) == 1
    mb = mbs[0]
    on = mb.loss_mask_bt > 0
    assert int(on.sum()) == 2 * 10 + 2 * 2 and np.all(mb.advantages_bt[on] == adv)
    assert len(mb.images) == 10 + 7


@pytest.mark.slow
def test_both_window_segments_are_trained(mesh):
    """The two segments of the 12-image trajectory, packed: the deferred-path gradient equals
    `jax.grad` of the fused loss over the two segments unpacked (both reach the loss)."""
    segments, _ = _check_twelve_image_segments()
    seqs = [seg.sequence(uid, 0.75) for uid, seg in enumerate(segments)]
    mb = microbatches(seqs, n_ranks=4, row_len=128, rows_per_rank=1)[0][0]
    err, vis, _, _ = _packed_vs_fused(seqs, mb, mesh)
    print(f"window segments: packed vs fused gradient rel L2 {err:.2e} (tower {vis:.2e})")
    assert err <= GRAD_RTOL and vis <= GRAD_RTOL


def _check_twelve_image_segments():
    """The 12-image trajectory's segments, checked token for token and image for image."""
    rng = np.random.default_rng(7)
    segments, turns = _windowed_rollout(rng, 12)
    assert len(segments) == 2
    one, two = segments

    def ids(ks, trained):
        toks, mask = list(HEAD), [0] * len(HEAD)
        for k in ks:
            obs, _, act, _ = turns[k]
            toks += obs + act
            mask += [0] * len(obs) + [int(k in trained)] * len(act)
        return toks, mask

    assert (one.tokens, one.loss_mask) == ids(range(10), set(range(10)))
    assert (two.tokens, two.loss_mask) == ids(range(5, 12), {10, 11})
    for seg, ks in ((one, range(10)), (two, range(5, 12))):
        assert len(seg.images) == len(ks)
        for (px, grid), k in zip(seg.images, ks, strict=True):
            assert px is turns[k][1][0] and np.array_equal(grid, turns[k][1][1])
    # Behaviour logprobs and versions on the trained actions only, as sampled.
    at = [i for i, m in enumerate(two.loss_mask) if m]
    assert [two.logprobs[i] for i in at] == turns[10][3] + turns[11][3]
    assert all(two.versions[i] == -1 for i, m in enumerate(two.loss_mask) if not m)
    return segments, turns


def test_window_errors_name_the_fix():
    from tiderl.train.image_window import Segment, WindowError, cut

    seg = Segment([1, IMAGE, 2], [0, 0, 0], [0.0] * 3, [-1] * 3, images=[], image_token=IMAGE)
    with pytest.raises(WindowError, match="1 image placeholder runs but 0 images"):
        cut(seg, head_len=1, keep=1)
    with pytest.raises(WindowError, match="logprobs"):
        seg.add_action([3, 4], [0.1], version=0)
    with pytest.raises(WindowError, match="differ in length"):
        Segment([1, 2], [0], [0.0], [0])


def test_buffer_trains_cut_segments_with_their_trajectorys_advantage():
    """A group whose first task was cut once by the window: the buffer emits the cut segment
    (with its images and M-RoPE positions) and the task's last part, both with its advantage."""
    from tiderl.control.buffer import ReadinessBuffer
    from tiderl.envs.protocol import EndReason
    from tiderl.serving.trajectory import Trajectory

    segments, _ = _windowed_rollout(np.random.default_rng(1), 12)
    last = segments[-1]

    def traj(i, reward, cut):
        return Trajectory(task_id=f"t{i}", group_id="g", is_eval=False, tokens=last.tokens,
                          loss_mask=last.loss_mask, logprobs=last.logprobs,
                          versions=last.versions, reward=reward,
                          end_reason=EndReason.done, turns=12, segments=cut)

    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=4, min_ok_per_group=2)
    g = buf.add_group([traj(0, 1.0, segments[:1]), traj(1, 0.0, [])], now=0.0)
    assert g is not None and len(g.seqs) == 3
    cut_seq, last0, last1 = g.seqs
    assert cut_seq.advantage == last0.advantage > 0 > last1.advantage
    assert list(cut_seq.tokens) == segments[0].tokens and len(cut_seq.images) == 10
    assert all(a is b for a, b in zip(cut_seq.images, segments[0].images, strict=True))
    assert g.action_tokens == 2 * (10 + 2 + 2)
