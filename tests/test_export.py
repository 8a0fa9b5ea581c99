"""`python -m tiderl.export RUN_DIR OUT`: a run's checkpointed actor params become an HF folder
that transformers loads as the same function; `load_run_params` restores only those params (on
the host, or into their shardings on a mesh); bad input is one line and exit 2.

The run folders are made cheaply: config.yaml from a RunConfig, checkpoints from a real
TrainerBackend saved by the real Checkpointer (params shifted between saves, as training would),
no job run. Tolerance: max |Δlogits| ≤ 1e-4 in fp32 against transformers' torch CPU forward.
"""

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tiderl.config import RunConfig  # noqa: E402
from tiderl.export import load_run_params, main  # noqa: E402
from tiderl.models.config import ModelConfig  # noqa: E402
from tiderl.models.hf import from_pretrained, load_hf_config  # noqa: E402
from tiderl.models.sharding import make_mesh  # noqa: E402
from tiderl.train.backend import TrainerBackend  # noqa: E402
from tiderl.train.checkpoint import Checkpointer  # noqa: E402
from tiderl.train.config import TrainerConfig  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _make_source(src):
    """A tiny Qwen3 HF folder (head_dim ≠ d/h, q/k norms) with a locally trained BPE tokenizer."""
    torch.manual_seed(0)
    conf = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                                    tie_word_embeddings=False, eos_token_id=1)
    transformers.Qwen3ForCausalLM(conf).save_pretrained(src, safe_serialization=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(["guess a number between one and eight"] * 20, trainer)
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>",
                                                           "model_max_length": 256}))
    (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>"}))


def _make_run(run_dir, model_cfg, steps, *, policy=None):
    """config.yaml + one Checkpointer save per step, params shifted before each; returns the
    expected params (numpy leaves) per step."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(RunConfig(run_dir=str(run_dir),
                                                   model=model_cfg).to_yaml())
    mesh = make_mesh(jax.devices()[:2], fsdp=2)
    be = TrainerBackend(TrainerConfig(actor_devices=2), model_cfg, actor_mesh=mesh, seed=1,
                        policy=policy(mesh) if policy else None)
    ck = Checkpointer(run_dir / "checkpoints", keep=3)
    rng = np.random.default_rng(0)
    expected = {}
    for step in steps:
        shift = lambda x: x + (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)  # noqa: E731
        be.state = {**be.state, "params": jax.tree.map(shift, be.state["params"]),
                    "step": jax.device_put(np.int32(step), be.state["step"].sharding)}
        ck.save(be, data_state={}, wait=True)
        expected[step] = nnx.State(jax.tree.map(np.asarray, be.state["params"]))
    ck.close()
    return expected


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    src = root / "src"
    _make_source(src)
    cfg = load_hf_config(src)
    cfg = ModelConfig(**{**cfg.__dict__, "tokenizer": str(src / "tokenizer.json")})
    expected = _make_run(root / "run", cfg, [5, 9],
                         policy=lambda mesh: nnx.split(from_pretrained(src, mesh=mesh)))
    return root, src, expected


def _logits_ours(graphdef, params, tokens):
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    b, t = tokens.shape
    out, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)),
                   jnp.ones((b, t), jnp.int32))
    return np.asarray(out)


def test_export_newest_step_loads_in_transformers(qwen3_run, capsys):
    root, src, expected = qwen3_run
    out = root / "hf_newest"
    assert main([str(root / "run"), str(out)]) == 0
    assert "step 9" in capsys.readouterr().out
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3ForCausalLM"] and conf["model_type"] == "qwen3"
    assert conf["head_dim"] == 24 and conf["eos_token_id"] == 1  # kept from the source config
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    rp = load_run_params(root / "run")
    assert rp.step == 9 and rp.model.qk_norm and rp.model.head_dim == 24
    for a, b in zip(jax.tree.leaves(rp.params), jax.tree.leaves(expected[9]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    tokens = np.random.default_rng(1).integers(0, 300, size=(2, 24))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    err = float(np.max(np.abs(_logits_ours(rp.graphdef, expected[9], tokens) - ref)))
    assert err <= 1e-4, f"max |Δlogits| = {err:.3g}"
    # And the exported weights are the trained ones, not the source checkpoint's.
    src_model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        assert float(np.max(np.abs(src_model(torch.tensor(tokens)).logits.numpy() - ref))) > 1e-3
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<eos>"


def test_export_given_step_in_bfloat16(qwen3_run):
    root, _, expected = qwen3_run
    out = root / "hf_step5"
    assert main([str(root / "run"), str(out), "--step", "5", "--dtype", "bfloat16"]) == 0
    conf = json.loads((out / "config.json").read_text())
    assert conf["torch_dtype"] == "bfloat16"
    back = from_pretrained(out, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(expected[5]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), b.astype(jnp.bfloat16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(hf.parameters()).dtype == torch.bfloat16


def test_load_run_params_into_mesh_shardings(qwen3_run):
    from jax.sharding import PartitionSpec as P

    root, _, expected = qwen3_run
    mesh = make_mesh(jax.devices()[4:8], fsdp=2, model=2)
    rp = load_run_params(root / "run", 5, mesh=mesh)
    assert rp.step == 5
    wq = rp.params["layers"][0]["attn"]["wq_dhk"][...]
    assert wq.sharding.mesh == mesh and wq.sharding.spec == P("fsdp", "model", None)
    emb = rp.params["embed_vd"][...]
    assert emb.sharding.spec == P("model", "fsdp")
    for a, b in zip(jax.tree.leaves(rp.params), jax.tree.leaves(expected[5]), strict=True):
        assert set(a.sharding.device_set) <= set(mesh.devices.flat)
        np.testing.assert_array_equal(np.asarray(a), b)


def test_initialised_run_exports_as_qwen2(tmp_path):
    """A run without model.checkpoint (qkv biases, tied) exports as Qwen2, byte tokenizer: no
    tokenizer files."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=128, qkv_bias=True)
    expected = _make_run(tmp_path / "run", cfg, [3])
    out = tmp_path / "hf"
    assert main([str(tmp_path / "run"), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.tie_word_embeddings
    graphdef = load_run_params(tmp_path / "run").graphdef
    tokens = np.random.default_rng(2).integers(0, 64, size=(2, 16))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    err = float(np.max(np.abs(_logits_ours(graphdef, expected[3], tokens) - ref)))
    assert err <= 1e-4, f"max |Δlogits| = {err:.3g}"


def _one_line_error(capsys, argv, *needles):
    # Another test's unreachable leftovers (a pending task of a loop it abandoned) are
    # collected now, so the collector's report lands here and not in the CLI's output.
    gc.collect()
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiderl.export: error:"), lines
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_input_is_one_line_exit_2(qwen3_run, tmp_path, capsys):
    root, _, _ = qwen3_run
    run = str(root / "run")
    _one_line_error(capsys, [run, str(tmp_path / "a"), "--step", "7"],
                    "step 7", "available steps: 5, 9")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    _one_line_error(capsys, [run, str(tmp_path / "full")], "not an empty folder")
    _one_line_error(capsys, [str(tmp_path / "nowhere"), str(tmp_path / "b")], "config.yaml")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text(RunConfig().to_yaml())
    _one_line_error(capsys, [str(empty), str(tmp_path / "c")], "no checkpoints folder")
    (empty / "checkpoints").mkdir()
    _one_line_error(capsys, [str(empty), str(tmp_path / "c")], "no complete checkpoint")
    custom = tmp_path / "custom_run"
    custom.mkdir()
    (custom / "config.yaml").write_text(RunConfig(model=ModelConfig(
        policy="examples.custom_policy:MiniTransformer")).to_yaml())
    _one_line_error(capsys, [str(custom), str(tmp_path / "d")], "model.policy", "custom")
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_model_config_falls_back_to_the_source_checkpoint(qwen3_run, tmp_path):
    """A checkpoint whose recorded model config does not describe its params (a run that loaded
    model.checkpoint but recorded the default model keys) is read with the source config.json;
    with no source to fall back on it is a one-line ConfigError."""
    import shutil

    from tiderl.configlib import ConfigError, to_dict

    root, src, expected = qwen3_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    for step in (5, 9):
        meta_file = run / "checkpoints" / str(step) / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        meta["model"] = to_dict(ModelConfig(checkpoint=str(src)))
        meta_file.write_text(json.dumps(meta))
    rp = load_run_params(run, 5)
    assert rp.model.qk_norm and rp.model.head_dim == 24 and rp.model.checkpoint == str(src)
    for a, b in zip(jax.tree.leaves(rp.params), jax.tree.leaves(expected[5]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    (run / "config.yaml").write_text(RunConfig(run_dir=str(run)).to_yaml())
    with pytest.raises(ConfigError, match="match neither"):
        load_run_params(run)


def test_vlm_run_exports_and_loads_back(tmp_path):
    """A vision-language run (Qwen2.5-VL layout, initialised, no model.checkpoint) exports as
    Qwen2_5_VLForConditionalGeneration; its params read back bit-identical through both
    load_run_params and from_pretrained, and transformers computes the same logits on a
    text+image input (≤ 1e-4 fp32)."""
    from tiderl.models.config import VisionConfig
    from tiderl.models.vlm import image_input, mrope_positions

    image = 60
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=128, qkv_bias=True,
                      tie_embeddings=False, mrope_section=(1, 1, 2),
                      vision=VisionConfig(depth=1, d_model=16, n_heads=2, mlp_dim=32,
                                          patch_size=2, out_dim=32, window_size=8,
                                          image_token_id=image, vision_start_token_id=61))
    expected = _make_run(tmp_path / "run", cfg, [2])
    rp = load_run_params(tmp_path / "run")
    assert rp.model.vision == cfg.vision and "visual" in rp.params
    for a, b in zip(jax.tree.leaves(rp.params), jax.tree.leaves(expected[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    out = tmp_path / "hf"
    assert main([str(tmp_path / "run"), str(out)]) == 0
    back = from_pretrained(out)
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(expected[2]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(out)
    assert type(hf).__name__ == "Qwen2_5_VLForConditionalGeneration"
    rng = np.random.default_rng(3)
    grid = np.array([[1, 4, 6]])  # 24 patches, 6 image tokens
    pixels = rng.standard_normal((24, 3 * 2 * 2 * 2)).astype(np.float32)
    tokens = np.array([[5, 9, 61, *[image] * 6, 62, 7, 8, 3]])
    with torch.no_grad():
        ids = torch.tensor(tokens)
        ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids),
                 pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                 mm_token_type_ids=(ids == image).int()).logits.numpy()
    model = nnx.merge(rp.graphdef, jax.tree.map(jnp.asarray, expected[2]))
    ours, _ = model(jnp.asarray(tokens), jnp.asarray(mrope_positions(tokens, grid, cfg)),
                    jnp.ones(tokens.shape, jnp.int32), images=image_input(pixels, grid,
                                                                          cfg.vision))
    err = float(np.max(np.abs(np.asarray(ours) - ref)))
    assert err <= 1e-4, f"max |Δlogits| = {err:.3g}"
