"""LoRA (`trainer.lora_rank`): the deferred-backward gradient w.r.t. the adapters against
`jax.grad` of the same GRPO loss on the unmerged model and on merged weights (relative L2 error
<= 1e-5, fp32); merged serving weights against the unmerged forward (max |Δlogits| <= 1e-5 of
the logits' scale); an update leaves the base bit-identical and the optimizer holds only
adapter-shaped moments; a sync moves exactly the adapters' bytes (counted by hand) and merges
on the rollout devices; a real launch with LoRA runs, resumes and exports; config errors are
one line naming the key."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl.configlib import ConfigError
from tiderl.models.config import ModelConfig
from tiderl.models.lora import TARGETS, merge_lora
from tiderl.models.policy import init_policy
from tiderl.models.sharding import make_mesh
from tiderl.train.backend import TrainerBackend
from tiderl.train.config import LORA_TARGETS, TrainerConfig
from tiderl.train.dispatch import microbatches
from tiderl.train.grpo import cotangent, loss_sum
from tiderl.train.ref_actor import make_outputs
from tiderl.train.synthetic import synthetic_trajectories

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
REL_TOL = 1e-5  # fp32 gradients: relative L2 error of the whole adapter gradient tree
FWD_TOL = 1e-5  # merged vs unmerged logits: max |Δ| relative to max |logit|
TEMP = 0.8


def rel_err(a, b) -> float:
    num = sum(float(jnp.sum((x - y) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    den = sum(float(jnp.sum(y ** 2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _backend(model_cfg=TINY, *, perturb=True, **kw):
    """A LoRA backend on a data=2 × fsdp=2 mesh; `perturb`: B made nonzero (a fresh B is 0, so
    dL/dA would be 0 and A's gradient check would test nothing)."""
    mesh = make_mesh(jax.devices()[:4], data=2, fsdp=2)
    cfg = TrainerConfig(actor_devices=4, kl_coef=0.1, lora_rank=4, lora_alpha=8.0,
                        entropy_coef=0.05, **kw)
    be = TrainerBackend(cfg, model_cfg, actor_mesh=mesh, temperature=TEMP,
                        policy=init_policy(model_cfg, seed=0, mesh=mesh))
    if perturb:
        keys = iter(jax.random.split(jax.random.key(3), 1000))
        ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                          be.state["params"])
        be.state = {**be.state, "params": jax.device_put(ad, be.sh.params)}
    return be


def _mbs(be, n_traj=10, seed=1, n_ranks=4):
    trajs = synthetic_trajectories(n_traj, vocab=64, min_len=6, max_len=30, seed=seed,
                                   versions=(0,))
    mbs, _ = microbatches(trajs, n_ranks=n_ranks, row_len=64, rows_per_rank=1)
    rng = np.random.default_rng(seed)
    out = []
    for mb in mbs:  # behaviour logprobs near the policy's: some tokens clip, some do not
        lp = be.logprobs(mb)
        noisy = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32) * mb.loss_mask_bt
        out.append(dataclasses.replace(mb, behaviour_logprobs_bt=noisy))
    return out


LAYOUTS = {
    "per_layer": ({}, {}),
    "scan_remat_chunked": ({"scan_layers": True},
                           {"remat": True, "token_chunk": 16, "head_chunk": 32}),
}


@pytest.mark.parametrize("layout", [
    "per_layer", pytest.param("scan_remat_chunked", marks=pytest.mark.slow)])
def test_deferred_lora_gradient_equals_jax_grad(layout):
    """(a) The Actor forward's saved vjp, run later from the GRPO cotangent, gives the
    adapters' gradient of `jax.grad` of the same loss on the unmerged model (no remat, no
    chunks) and on the plain decoder run on merged weights W + scale·A·B. The Ref is the base
    (no copy of it is kept when colocated)."""
    mkw, tkw = LAYOUTS[layout]
    be = _backend(dataclasses.replace(TINY, **mkw), **tkw)
    assert be.uses_ref and be.ref_params is None  # the Ref reads the frozen base itself
    b = be.put(_mbs(be)[0], "actor")
    ref = be.ref_forward(b)
    lp, vjp = be.actor_forward(b)
    version = jnp.int32(be.version)
    cot, m = cotangent(lp, ref, b, version, be.spec)
    deferred = be.k.actor_backward(vjp, cot)
    # The saved vjp refers to the base in place: no base-shaped array among its residuals.
    base_shapes = {x.shape for x in jax.tree.leaves(be.frozen) if x.ndim >= 2}
    assert not base_shapes & {r.shape for r in jax.tree.leaves(vjp.residuals)}
    assert sum(s >= 0 for s in vjp.slots) >= len(base_shapes)
    assert 0 < int(m["clipped_tokens"]) < float(m["action_tokens"])
    assert float(m["kl_sum"]) > 0  # the adapters move the policy away from the Ref

    unmerged = make_outputs(be.graphdef, TEMP)
    plain = make_outputs(be.ref_graphdef, TEMP)
    scale = be.lora.scale

    def loss_unmerged(ad):
        return loss_sum(unmerged(ad, b, be.frozen), ref, b, version, be.spec)[0]

    def loss_merged(ad):
        return loss_sum(plain(merge_lora(be.frozen, ad, scale), b), ref, b, version,
                        be.spec)[0]

    adapters = be.state["params"]
    g_unmerged = jax.jit(jax.grad(loss_unmerged))(adapters)
    g_merged = jax.jit(jax.grad(loss_merged))(adapters)
    e1, e2 = rel_err(deferred, g_unmerged), rel_err(deferred, g_merged)
    print(f"{layout}: deferred vs jax.grad unmerged {e1:.2e}, vs merged {e2:.2e}")
    assert e1 <= REL_TOL and e2 <= REL_TOL
    assert jax.tree.structure(deferred) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(deferred))
    # The fused reference step of the backend agrees too.
    fused = be.k.fused_grads(adapters, [b], [ref], version, be.frozen)
    assert rel_err(deferred, fused) <= REL_TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_serving_forward_equals_unmerged(layout):
    """(b) `export_weights()` (the engines' per-layer layout, merged) run by the serving
    graphdef gives the unmerged model's logits; with fresh adapters (B = 0) the policy is the
    Ref exactly."""
    mkw, _ = LAYOUTS[layout]
    cfg = dataclasses.replace(TINY, **mkw)
    fresh = _backend(cfg, perturb=False)
    b = fresh.put(_mbs(fresh)[0], "actor")
    np.testing.assert_array_equal(np.asarray(fresh.ref_forward(b)),
                                  np.asarray(fresh.k.logprobs(fresh.state["params"], b,
                                                              fresh.frozen)))
    be = _backend(cfg)
    tokens = b["tokens_bt"]
    pos, seg = b["positions_bt"], b["segment_ids_bt"]
    unmerged = nnx.merge(be.graphdef, be.state["params"], be.frozen)(tokens, pos, seg)[0]
    served = be.export_weights()
    merged = nnx.merge(be.serving_graphdef, served)(tokens, pos, seg)[0]
    base = nnx.merge(be.ref_graphdef, be.frozen)(tokens, pos, seg)[0]
    scale = float(jnp.abs(unmerged).max())
    err = float(jnp.abs(merged - unmerged).max()) / scale
    print(f"{layout}: merged vs unmerged logits, max |Δ| / max |logit| = {err:.2e}")
    assert err <= FWD_TOL
    assert float(jnp.abs(base - unmerged).max()) / scale > 100 * FWD_TOL  # adapters matter


def test_update_trains_only_the_adapters():
    """(c) After a train step the base is bit-identical, the adapters moved, and every
    optimizer moment has an adapter's shape: two moments per adapter leaf, no base-sized one."""
    be = _backend()
    base = jax.tree.map(np.asarray, be.frozen)
    before = jax.tree.map(np.asarray, be.state["params"])
    out = be.train_step(_mbs(be))
    assert np.isfinite(out["loss"]) and not out["skipped"]
    for x, y in zip(jax.tree.leaves(be.frozen), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    moved = [float(np.abs(np.asarray(x) - y).max())
             for x, y in zip(jax.tree.leaves(be.state["params"]), jax.tree.leaves(before),
                             strict=True)]
    assert min(moved) > 0
    ad_shapes = sorted(x.shape for x in jax.tree.leaves(be.state["params"]))
    moments = sorted(x.shape for x in jax.tree.leaves(be.state["opt"]) if x.ndim)
    assert moments == sorted(ad_shapes * 2)
    base_shapes = {x.shape for x in jax.tree.leaves(be.frozen)}
    assert not base_shapes & set(moments)
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(be.state["opt"]) if x.ndim)
    assert opt_bytes == 2 * _nbytes(be.state["params"]) < _nbytes(be.frozen) / 2
    for leaf in jax.tree.leaves(be.state["params"]):  # pinned shardings on the Actor mesh
        assert leaf.sharding.mesh == be.actor_mesh
    q = be.state["params"]["layers"][0]["attn"]["lora"]["q_proj"]
    assert q["lora_a"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)  # as W's "embed"


def test_decoupled_ref_is_a_copy_of_the_base_on_its_own_mesh():
    """A Ref on devices of its own holds a copy of the base there (the only Ref copy LoRA
    makes); switching to colocated drops it, switching back makes it again; steps train in
    both modes."""
    devs = jax.devices()
    actor, ref = make_mesh(devs[:2], fsdp=2), make_mesh(devs[2:4], fsdp=2)
    cfg = TrainerConfig(actor_devices=2, ref_devices=2, kl_coef=0.1, lora_rank=4,
                        lora_alpha=8.0)
    be = TrainerBackend(cfg, TINY, actor_mesh=actor, ref_mesh=ref, temperature=TEMP,
                        policy=init_policy(TINY, seed=0, mesh=actor))

    def ref_is_base_copy():
        assert be.mode == "decoupled"
        for x, y in zip(jax.tree.leaves(be.ref_params), jax.tree.leaves(be.frozen),
                        strict=True):
            assert x.sharding.mesh == ref and y.sharding.mesh == actor
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    ref_is_base_copy()
    mbs = _mbs(be, n_ranks=2)
    assert np.isfinite(be.train_step(mbs)["loss"])
    be.set_ref_mesh(None)
    assert be.mode == "colocated" and be.ref_params is None
    assert np.isfinite(be.train_step(mbs)["loss"])
    be.set_ref_mesh(ref)
    ref_is_base_copy()
    assert np.isfinite(be.train_step(mbs)["loss"])


def _adapter_bytes_by_hand(cfg: ModelConfig, rank: int, targets=LORA_TARGETS) -> int:
    d, hd, kd, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, \
        cfg.mlp_dim
    dims = {"q_proj": (d, hd), "k_proj": (d, kd), "v_proj": (d, kd), "o_proj": (hd, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    return 4 * cfg.n_layers * sum(rank * (i + o) for i, o in (dims[t] for t in targets))


def test_sync_moves_only_the_adapters():
    """(d) The site's sync (`WeightPlacer`): the first puts the serving base on every rank once;
    later syncs move the adapters alone — bytes = the adapters' fp32 bytes counted by hand ×
    ranks, below whole weights — and merge on the rank's device to the trainer's merged weights
    with the shapes, dtypes and shardings an engine checks at `update_weights`."""
    from tiderl.runtime.parts import WeightPlacer
    from tiderl.runtime.weightsync import tree_bytes

    be = _backend()
    devs = jax.devices()
    meshes = [make_mesh(devs[6:7]), make_mesh(devs[7:8])]
    place = WeightPlacer(TINY, be.serving_abstract, meshes)
    full_place = WeightPlacer(TINY, be.serving_abstract, meshes)
    full_trees, full_stats = full_place(be.export_weights())
    whole = tree_bytes(be.serving_abstract)
    assert full_stats.local_bytes == 2 * whole
    first, first_stats = place(be.export_lora())
    hand = _adapter_bytes_by_hand(TINY, 4)
    assert first_stats.local_bytes == 2 * (whole + hand)  # the base once, then the adapters
    be.train_step(_mbs(be))
    trees, stats = place(be.export_lora())
    m = stats.metrics()
    print(f"tiny model (per rank): LoRA sync {hand} B, full sync {whole} B "
          f"({whole / hand:.1f}x)")
    assert stats.local_bytes == m["sync_bytes"] == 2 * hand
    assert m["sync_full_bytes"] == 2 * whole and hand < whole
    want = be.export_weights()
    spec = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(full_trees[1])]
    for dev, tree in zip(devs[6:8], trees, strict=True):
        assert [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree)] == \
            [(s, t, jax.sharding.SingleDeviceSharding(dev)) for s, t, _ in spec]
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
    assert jax.tree.structure(trees[0]) == jax.tree.structure(full_trees[0])
    # An engine built on whole weights takes the merged ones as any new weights (the path that
    # stamps each token with the version it was sampled at, as for full syncs).
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine

    eng = Engine(be.serving_graphdef, full_trees[0], TINY,
                 RolloutConfig(page_size=4, num_pages=32, max_slots=2, max_context=64,
                               max_action_tokens=4, decode_buckets=(1, 2),
                               prefill_buckets=(16,)), version=0)
    eng.init_decode_state()
    eng.update_weights(trees[0], version=1)
    assert eng.version == 1 and eng.params is trees[0]


def test_smollm2_shape_sync_bytes():
    """Sync bytes per update on SmolLM2-135M's shape (30 layers, d 576, 9/3 heads of 64, mlp
    1536, vocab 49,152, tied), computed from the shapes (no weights): rank 16, all targets."""
    from tiderl.models.lora import LoraSpec
    from tiderl.models.policy import abstract_lora, abstract_policy
    from tiderl.runtime.weightsync import tree_bytes

    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, mlp_dim=1536, tie_embeddings=True, scan_layers=True)
    whole = tree_bytes(abstract_policy(smol)[1])  # stacked: the same bytes, traced faster
    lora = tree_bytes(abstract_lora(smol, LoraSpec(16, 32.0)))
    assert lora == _adapter_bytes_by_hand(smol, 16)
    print(f"SmolLM2-135M shape: full sync {whole:,} B (fp32), LoRA r=16 sync {lora:,} B "
          f"({whole / lora:.1f}x fewer)")
    assert 130e6 < whole / 4 < 140e6 and lora < whole / 20


def test_config_errors_name_the_key():
    """(f) One-line errors naming the key and the fix."""
    cases = [({"lora_rank": -1}, "trainer.lora_rank"),
             ({"lora_rank": 4, "lora_alpha": 0.0}, "trainer.lora_alpha"),
             ({"lora_rank": 4, "lora_targets": ()}, "trainer.lora_targets"),
             ({"lora_rank": 4, "lora_targets": ("q_proj", "wq")}, "'wq'"),
             ({"lora_rank": 4, "lora_targets": ("q_proj", "q_proj")}, "twice")]
    for kw, want in cases:
        with pytest.raises(ConfigError, match=want) as e:
            TrainerConfig(**kw)
        assert "\n" not in str(e.value) and "trainer.lora_" in str(e.value)
    assert set(LORA_TARGETS) == set(TARGETS)
    mesh = make_mesh(jax.devices()[:1])
    custom = dataclasses.replace(TINY, policy="examples.custom_policy:MiniTransformer",
                                 n_kv_heads=4)
    with pytest.raises(ConfigError, match="trainer.lora_rank.*model.policy"):
        TrainerBackend(TrainerConfig(lora_rank=2), custom, actor_mesh=mesh,
                       policy=init_policy(custom, mesh=mesh))
    from tiderl.config import load_config

    with pytest.raises(ConfigError, match="'trainer.lora_targets' names 'qproj'"):
        load_config(None, ["trainer.lora_rank=4", "trainer.lora_targets=[qproj]"])
    with pytest.raises(ConfigError, match="'trainer.lora_rank'=4 needs the built-in decoder"):
        load_config(None, ["trainer.lora_rank=4", "model.n_kv_heads=4",
                           "model.policy=examples.custom_policy:MiniTransformer"])


LAUNCH = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32",
          "model.mlp_dim=64", "model.head_dim=8", "controller.groups_per_step=2",
          "controller.groups_per_microbatch=1", "controller.eval_every=0",
          "controller.console=false", "env.group_size=4", "controller.checkpoint_every=1",
          "trainer.lora_rank=4", "trainer.lora_alpha=8"]


@pytest.mark.entry
@pytest.mark.slow
def test_launch_with_lora_runs_resumes_and_exports(tmp_path):
    """(e) `python -m tiderl.launch trainer.lora_rank=4 ...` completes, each step's record has
    the sync's bytes (adapters only, below whole weights), it resumes from its checkpoint with
    the same LoRA (another lora_rank is refused), and `tiderl.export` writes merged weights
    whose logits are the restored unmerged model's."""
    from tiderl.config import load_config
    from tiderl.export import load_run_params
    from tiderl.export import main as export_main
    from tiderl.launch import main
    from tiderl.train.checkpoint import Checkpointer

    run = tmp_path / "run"
    assert main([*LAUNCH, f"run_dir={run}", "controller.steps=2"]) == 0
    assert main(["--resume", str(run), "controller.steps=3"]) == 0
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
             if '"kind": "step"' in x]
    assert [r["step"] for r in steps] == [1, 2, 3]
    cfg = load_config(str(run / "config.yaml"))
    hand = _adapter_bytes_by_hand(cfg.model, 4) * cfg.rollout.ranks
    whole = steps[0]["sync_full_bytes"]
    # The first sync of a launch (and of the resume) also puts the base on the rank once.
    assert [r["sync_bytes"] for r in steps] == [whole + hand, hand, whole + hand]
    assert hand < whole / 4
    bad = main(["--resume", str(run), "controller.steps=4", "trainer.lora_rank=8"])
    assert bad != 0

    out = tmp_path / "hf"
    assert export_main([str(run), str(out)]) == 0
    rp = load_run_params(run)
    assert rp.step == 3
    mesh = make_mesh(jax.devices()[:1])
    be = TrainerBackend(cfg.trainer, cfg.model, actor_mesh=mesh, temperature=1.0)
    ck = Checkpointer(run / "checkpoints")
    assert ck.restore(be)[0] == 3
    ck.close()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)))
    pos, seg = jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32)
    unmerged = nnx.merge(be.graphdef, be.state["params"], be.frozen)(tokens, pos, seg)[0]
    exported = nnx.merge(rp.graphdef, rp.params)(tokens, pos, seg)[0]
    err = float(jnp.abs(exported - unmerged).max()) / float(jnp.abs(unmerged).max())
    assert err <= FWD_TOL
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(unmerged), ref, atol=1e-4)
