"""GGUF checkpoints (llama.cpp's single-file format) as local HF folders. No JAX.

`model.checkpoint=PATH.gguf` is converted once into an HF folder that the normal import path
(`tiderl.models.hf.from_pretrained`) then reads unchanged:

  config.json             LlamaConfig/Qwen2Config/Qwen3Config fields from the `<arch>.*` metadata
                          (tied embeddings when the file has no output.weight)
  model*.safetensors      every tensor dequantized to float32 (the `gguf` library), under HF names,
                          with llama.cpp's Q/K row permutation undone (llama only)
  tokenizer.json, ...     the file's tokenizer and chat template, through transformers'
                          GGUF tokenizer conversion (`AutoTokenizer.from_pretrained(gguf_file=)`)
  generation_config.json  bos/eos ids (and an end-of-turn id) from the tokenizer metadata
  tiderl_gguf.json        what was converted: the source, its size and mtime, the tensor types

The folder lives in a cache (`$TIDERL_GGUF_CACHE`, else `$XDG_CACHE_HOME` or ~/.cache, under
tiderl/gguf), named by the file's stem and a key of its resolved path, size, mtime and the
converter version: a changed file is converted again, an unchanged one is reused. A folder
appears whole or not at all (written beside it, then renamed), so concurrent runs are safe.

Whatever this cannot read (another architecture, a tensor type the installed `gguf` cannot
dequantize, RoPE scaling, experts) is a one-line ConfigError naming `model.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from tiderl.configlib import ConfigError

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Part of the cache key: bump it when a change to the conversion changes its output."""
ENV_CACHE = "TIDERL_GGUF_CACHE"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
"""GGUF `general.architecture` → the HF architecture it is converted to."""
SHARD_BYTES = 2 << 30
"""Float32 weights above this are written as several safetensors files with an index."""
MARKER = "tiderl_gguf.json"

# GGUF tensor name (blk.N. prefix stripped) → HF name (model.layers.N. prefix added).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `model.checkpoint` names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(".gguf")


def _where(path: Any) -> str:
    return f"config key 'model.checkpoint'={str(path)!r}"


def _one_line(e: BaseException) -> str:
    """An exception's message with its whitespace runs (newlines included) as single spaces."""
    return " ".join(str(e).split())


def _gguf_module(path: Any) -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ConfigError(f"{_where(path)} is a GGUF file, and reading one needs the gguf "
                          "package: pip install 'tiderl[real]' (or gguf>=0.10)") from e
    return gguf


def _reader(path: Path) -> Any:
    gguf = _gguf_module(path)
    if not path.is_file():
        raise ConfigError(f"{_where(path)}: no such file; name a local .gguf file")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ConfigError(f"{_where(path)}: not a readable GGUF file ({_one_line(e)})") from e


def _scalar(part: np.ndarray, vtype: Any, gguf: Any) -> Any:
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    values = part.tolist()
    return values[0] if len(values) == 1 else values


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or a list of them), or `default`."""
    import gguf

    f = reader.fields.get(key)
    if f is None or not f.types:
        return default
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        sub = f.types[1] if len(f.types) > 1 else None
        return [_scalar(f.parts[i], sub, gguf) for i in f.data]
    return _scalar(f.parts[f.data[0]], f.types[0], gguf)


def _nice(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), as the HF config the file was made from most likely said."""
    return float(str(np.float32(x)))


def readable_types() -> dict[str, int]:
    """Tensor types the installed `gguf` dequantizes (name → GGMLQuantizationType value)."""
    import gguf
    from gguf import quants

    q = gguf.GGMLQuantizationType
    traits = getattr(quants, "_type_traits", {})
    ok = [q.F32, q.F16, *[t for t in q if t in traits]]
    return {t.name: int(t) for t in sorted(set(ok))}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's `permute`): per head,
    the GGUF rows interleave the two rotary halves (0, d/2, 1, d/2+1, ...), HF keeps them
    contiguous (0, 1, ..., d/2-1 | d/2, ...). `w` is [heads*head_dim, ...] (a weight or a bias)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_names(arch: str, n_layers: int) -> dict[str, str]:
    """Every GGUF tensor name tiderl reads for `arch` → its HF name."""
    per_layer = dict(_LAYER_TENSORS)
    if arch == "qwen2":
        per_layer.update(_QKV_BIAS)
    if arch == "qwen3":
        per_layer.update(_QK_NORM)
    out = dict(_GLOBAL_TENSORS)
    for i in range(n_layers):
        out.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in per_layer.items()})
    return out


def hf_config_from_gguf(reader: Any, path: Path) -> dict[str, Any]:
    """The HF config.json of a GGUF file, from its metadata and tensor list (no tensor data
    is read); a ConfigError names whatever tiderl cannot import."""
    where = _where(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where} has GGUF architecture {arch!r}, which is not supported; "
                          f"tiderl converts {', '.join(ARCHITECTURES)} GGUF files")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{k}" for k in required if key(k) is None]
    if missing:
        raise ConfigError(f"{where} lacks the GGUF metadata {', '.join(missing)}; re-export it "
                          "with llama.cpp's convert_hf_to_gguf.py")
    heads = key("attention.head_count")
    kv = key("attention.head_count_kv", heads)
    ffn = key("feed_forward_length")
    if any(isinstance(v, list) for v in (heads, kv, ffn)):
        raise ConfigError(f"{where} has per-layer head counts or MLP widths, which are not "
                          "supported; use a model with one shape for all layers")
    if key("expert_count", 0):
        raise ConfigError(f"{where} is a mixture of experts ({arch}.expert_count="
                          f"{key('expert_count')}), which is not supported; use a dense model")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{where} has RoPE scaling {arch}.rope.scaling.type={scaling!r}, which "
                          "is not supported from GGUF; use a checkpoint without it (or its HF "
                          "folder)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError(f"{where} has per-frequency RoPE factors (rope_freqs.weight: Llama "
                          "3.1+ 'llama3' scaling), which tiderl cannot read from GGUF; use the "
                          "model's HF folder for model.checkpoint")
    d = key("embedding_length")
    head_dim = key("attention.key_length", d // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{where} has key_length {head_dim} != value_length "
                          f"{key('attention.value_length')}, which is not supported")
    rot = key("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ConfigError(f"{where} rotates {rot} of {head_dim} head dims ({arch}.rope."
                          "dimension_count), which is not supported (tiderl rotates whole heads)")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError(f"{where} has no token_embd.weight tensor; it is not a complete "
                          f"{arch} model")
    vocab = int(embd.shape[-1])  # GGUF shapes are innermost-first: [d_model, vocab]
    theta = _nice(key("rope.freq_base", 10000.0))
    n_layers = int(key("block_count"))
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": int(d),
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": _nice(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if arch == "llama":
        hf["mlp_bias"] = False
    else:
        hf.update(use_sliding_window=False, sliding_window=None,
                  layer_types=["full_attention"] * n_layers)
    for name in ("bos", "eos", "padding"):
        tid = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            hf[f"{'pad' if name == 'padding' else name}_token_id"] = int(tid)
    return hf


def _check_tensors(reader: Any, path: Path, hf: dict[str, Any]) -> dict[str, str]:
    """GGUF name → HF name for every tensor; a ConfigError for a type the installed `gguf`
    cannot dequantize, and for missing or unexpected tensors."""
    where = _where(path)
    readable = readable_types()
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if t.tensor_type.name not in readable})
    if bad:
        raise ConfigError(f"{where} holds tensors of type {', '.join(bad)}, which gguf "
                          f"{_gguf_version()} cannot dequantize; tiderl reads "
                          f"{', '.join(readable)} (re-quantize the file, e.g. to Q8_0)")
    names = _tensor_names(hf["model_type"], hf["num_hidden_layers"])
    if hf["tie_word_embeddings"]:
        names.pop("output.weight")
    present = {t.name for t in reader.tensors}
    missing = sorted(set(names) - present)
    unexpected = sorted(present - set(names))
    if missing or unexpected:
        parts = [f"{what} {', '.join(ts[:6])}{' ...' if len(ts) > 6 else ''}"
                 for what, ts in (("missing", missing), ("unexpected", unexpected)) if ts]
        raise ConfigError(f"{where}: its tensors do not match a {hf['model_type']} model with "
                          f"{hf['num_hidden_layers']} layers ({'; '.join(parts)}); tiderl "
                          "reads plain decoders (no biases on Llama, no extra tensors)")
    return names


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def _dequantize(t: Any) -> np.ndarray:
    """One tensor as float32 in numpy (HF) axis order: GGUF lists shapes innermost-first."""
    from gguf import quants

    shape = tuple(int(n) for n in reversed(list(t.shape)))
    return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def _write_weights(reader: Any, names: dict[str, str], hf: dict[str, Any], out: Path) -> None:
    """Dequantized float32 tensors as safetensors, one shard at a time (SHARD_BYTES each)."""
    from safetensors.numpy import save_file

    tensors = [t for t in reader.tensors if t.name in names]
    sizes = [4 * int(np.prod([int(n) for n in t.shape])) for t in tensors]
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    permute = {"attn_q.weight": hf["num_attention_heads"],
               "attn_k.weight": hf["num_key_value_heads"]} if hf["model_type"] == "llama" else {}
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        arrays = {}
        for i in shard:
            t = tensors[i]
            w = _dequantize(t)
            heads = permute.get(t.name.split(".", 2)[-1])
            if heads is not None:
                w = unpermute_qk(w, heads)
            arrays[names[t.name]] = np.ascontiguousarray(w)
            weight_map[names[t.name]] = fname
        save_file(arrays, str(out / fname), metadata={"format": "pt"})
        del arrays
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(reader: Any, path: Path, out: Path) -> bool:
    """The file's tokenizer and chat template as tokenizer.json + tokenizer_config.json (+
    chat_template.jinja), via transformers; False when the file carries no tokenizer."""
    if _field(reader, "tokenizer.ggml.model") is None:
        return False
    needs = (f"{_where(path)}: converting the tokenizer of a GGUF file needs transformers "
             "and torch (pip install transformers torch)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(needs) from e
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                            local_files_only=True)
    except ImportError as e:  # transformers' GGUF reader also needs torch
        raise ConfigError(f"{needs}: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001 (transformers raises many kinds)
        raise ConfigError(f"{_where(path)}: transformers cannot convert its tokenizer "
                          f"({type(e).__name__}: {_one_line(e)}); use the model's HF folder "
                          "for model.checkpoint instead") from e
    tok.save_pretrained(str(out))
    return True


def _generation_config(reader: Any) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


def convert_gguf(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Writes the HF folder of GGUF file `path` into `out` (created; see the module doc)."""
    path, out = Path(path), Path(out)
    start = time.perf_counter()
    reader = _reader(path)
    hf = hf_config_from_gguf(reader, path)
    names = _check_tensors(reader, path, hf)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(reader, path, out)
    _write_weights(reader, names, hf, out)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if gen := _generation_config(reader):
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    st = path.stat()
    marker = {
        "source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "converter": CONVERTER_VERSION, "architecture": _field(reader, "general.architecture"),
        "name": _field(reader, "general.name"), "tokenizer": tokenizer,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "seconds": round(time.perf_counter() - start, 2),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """$TIDERL_GGUF_CACHE, else $XDG_CACHE_HOME (or ~/.cache) / tiderl / gguf."""
    env = os.environ if environ is None else environ
    if env.get(ENV_CACHE):
        return Path(env[ENV_CACHE]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiderl" / "gguf"


def cache_key(path: str | os.PathLike[str]) -> str:
    """The cache folder name of GGUF file `path`: its stem and a hash of its resolved path,
    size, mtime and CONVERTER_VERSION."""
    p = Path(path).resolve()
    st = p.stat()
    digest = hashlib.sha256(
        f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}".encode()).hexdigest()
    return f"{p.stem}-{digest[:16]}"


def gguf_folder(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
                ) -> Path:
    """The converted HF folder of GGUF file `path`: the cached one when the file is unchanged,
    else converted now (into a temporary folder beside it, then renamed into place)."""
    path = Path(path).expanduser()
    _gguf_module(path)
    if not path.is_file():
        raise ConfigError(f"{_where(path)}: no such file; name a local .gguf file")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / cache_key(path)
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        log.info("converting %s (%.0f MB) to a float32 HF folder at %s", path,
                 path.stat().st_size / 1e6, final)
        convert_gguf(path, tmp)
        for f in tmp.iterdir():  # safetensors writes 0600: readable as the umask allows
            f.chmod(0o666 & ~umask)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first (or a stale, incomplete folder)
            if not (final / MARKER).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


__all__ = ["ARCHITECTURES", "ENV_CACHE", "cache_key", "cache_root", "convert_gguf",
           "gguf_folder", "hf_config_from_gguf", "is_gguf", "readable_types", "unpermute_qk"]
