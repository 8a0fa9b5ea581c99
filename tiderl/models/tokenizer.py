"""Tokenizers: a byte-level one with special tokens (the embedded default, nothing to download)
and Hugging Face `tokenizer.json` files through the `tokenizers` library. No JAX.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, and the special ids
`pad_id`, `bos_id`, `eos_id`, `im_start_id`, `im_end_id` (None where a tokenizer lacks one).
HFTokenizer also reads a checkpoint folder's chat facts: `chat_template`, `eos_ids`,
`special_tokens` (bos_token, eos_token, ... as text) and `added_tokens`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class ByteTokenizer:
    """Ids 0..255 are bytes; specials follow. vocab_size is padded to a multiple of 16.

    The image placeholders of the Qwen-VL chat templates are specials too (ids 261..263), so
    a tiny vision-language policy can use this tokenizer; `encode` reads only them as tokens
    (other text, including the chat specials' names, stays bytes)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>",
                "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    _IMAGE_SPECIALS = re.compile(r"(<\|vision_start\|>|<\|image_pad\|>|<\|vision_end\|>)")

    def __init__(self) -> None:
        self.pad_id = 256
        self.bos_id = 257
        self.eos_id = 258
        self.im_start_id = 259
        self.im_end_id = 260
        self.special_ids = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self.vocab_size = 272

    def encode(self, text: str) -> list[int]:
        if "<|" not in text:
            return list(text.encode("utf-8"))
        out: list[int] = []
        for i, part in enumerate(self._IMAGE_SPECIALS.split(text)):
            out += [self.special_ids[part]] if i % 2 else list(part.encode("utf-8"))
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out = bytearray()
        names = {v: k for k, v in self.special_ids.items()}
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special and i in names:
                out.extend(names[i].encode())
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.special_ids.get(token)


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local `tokenizer.json` or its folder.

    Next to the tokenizer.json it reads what a checkpoint folder says about chat and stopping:
    tokenizer_config.json (chat_template, bos/eos/pad tokens), chat_template.jinja (written by
    transformers 5; it wins over the config's template, as in transformers) and
    generation_config.json (eos_token_id, an int or a list: every one ends generation).
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(
                f"tokenizer file {str(p)!r} not found; set model.tokenizer to a tokenizer.json "
                "path (or its folder), or 'byte'"
            )
        self.path = p
        self._tok = Tokenizer.from_file(str(p))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.added_tokens: dict[str, int] = {
            t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items()}
        """Every added token (special or not) by its text: a rendered chat is split on these."""
        folder = p.parent
        config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        self.special_tokens: dict[str, str] = _special_tokens_map(
            config, _read_json(folder / "special_tokens_map.json"))
        """Named special tokens (bos_token, eos_token, pad_token, ...) as text: the variables a
        chat template sees, as transformers passes them."""
        self.chat_template: str | None = _chat_template(folder, config)
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")

        self.im_start_id = self._tok.token_to_id("<|im_start|>")
        self.im_end_id = self._tok.token_to_id("<|im_end|>")
        eos = self._named("eos_token", "<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>",
                          "<eos>")
        self.eos_id = eos if eos is not None else self.im_end_id  # id 0 is a valid id
        self.bos_id = self._named("bos_token", "<s>", "<|begin_of_text|>", "<bos>")
        pad = self._named("pad_token", "<pad>", "<|endoftext|>")
        self.pad_id = pad if pad is not None else self.eos_id
        eos_ids = [] if self.eos_token is None else [self._tok.token_to_id(self.eos_token)]
        gen_eos = gen_config.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(
            int(i) for i in eos_ids if i is not None))
        """Ids that end generation: tokenizer_config's eos_token and generation_config's
        eos_token_id(s), in that order; empty when neither file names one."""

    def _named(self, key: str, *fallback: str) -> int | None:
        """The id of the config's `key` token, else of the first fallback name the vocab has."""
        name = self.special_tokens.get(key)
        if name is not None and self._tok.token_to_id(name) is not None:
            return self._tok.token_to_id(name)
        for n in fallback:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {str(path)!r} ({e}); fix or remove the file that "
                         "model.tokenizer points next to") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as text: configs hold a string or a serialised AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens_map(config: dict[str, Any], legacy: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in _NAMED_SPECIALS:
        text = _token_text(config[key]) if key in config else _token_text(legacy.get(key))
        if text is not None:
            out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # model-specific named tokens (image_token, ...)
        for key, value in extra.items():
            if (text := _token_text(value)) is not None:
                out.setdefault(str(key), text)
    return out


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config's chat_template (a string, or a list of named
    templates of which 'default' is used), else None."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    processor = _read_json(folder / "chat_template.json").get("chat_template")
    template = config.get("chat_template", processor)
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def max_token_chars(spec: str) -> int | None:
    """An upper bound on the characters one token of tokenizer `spec` decodes to: 1 for the
    byte tokenizer (a byte decodes to at most one character, U+FFFD for a stray byte); for a
    tokenizer.json, its longest vocabulary or added token's text plus one (byte-level BPE
    writes one character per byte, SentencePiece's '▁' is one space, byte-fallback '<0xNN>'
    is one byte, and a decoder adds at most one space before a token). None when the file
    cannot be read (loading the tokenizer reports that). Reads only the JSON, no `tokenizers`."""
    if spec == "byte":
        return 1
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        return _longest_token(str(p), p.stat().st_mtime_ns)
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=8)
def _longest_token(path: str, _mtime_ns: int) -> int:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    pieces = list(vocab) if isinstance(vocab, dict) else [  # Unigram: [[piece, score], ...]
        v[0] for v in vocab if isinstance(v, list) and v and isinstance(v[0], str)]
    pieces += [t.get("content", "") for t in data.get("added_tokens") or []
               if isinstance(t, dict)]
    if not pieces:
        raise ValueError(f"{path}: no vocabulary")
    return max(len(t) for t in pieces if isinstance(t, str)) + 1


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte', a path to a tokenizer.json, or a checkpoint's tokenizer folder."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
