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


def test_frozen_tower_gets_no_update_and_no_optimizer_state(mesh):
    """train_vision=false: the tower's params are bit-identical after a step with weight decay
    and its leaves have no AdamW moments; with train_vision=true weight decay alone moves them
    (text-only batches: zero gradient), so the check can fail."""
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.0, weight_decay=0.1, lr=1e-2)
    trajs = synthetic_trajectories(8, vocab=IMAGE, min_len=6, max_len=20, seed=0)
    mbs = microbatches(trajs, n_ranks=2, row_len=64, rows_per_rank=2)[0]
    moved = {}
    for train_vision in (True, False):
        model = dataclasses.replace(VLM, train_vision=train_vision)
        policy = init_policy(model, seed=0)
        before = _leaves(policy[1]["visual"])
        be = TrainerBackend(cfg, model, actor_mesh=mesh, policy=policy)
        be.train_step(mbs)
        after = be.state["params"]
        moved[train_vision] = max(float(np.abs(a - b).max())
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
    assert moved[False] == 0.0 and moved[True] > 0.0


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
