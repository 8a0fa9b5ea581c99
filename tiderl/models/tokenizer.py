"""Tokenizers: a byte-level one with special tokens (the embedded default, nothing to download)
and Hugging Face `tokenizer.json` files through the `tokenizers` library. No JAX.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, and the special ids
`pad_id`, `bos_id`, `eos_id`, `im_start_id`, `im_end_id` (None where a tokenizer lacks one).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class ByteTokenizer:
    """Ids 0..255 are bytes; specials follow. vocab_size is padded to a multiple of 16."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.pad_id = 256
        self.bos_id = 257
        self.eos_id = 258
        self.im_start_id = 259
        self.im_end_id = 260
        self.special_ids = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self.vocab_size = 272

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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
    """A Hugging Face `tokenizer.json` (fast tokenizer) loaded from a local path."""

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
        self._tok = Tokenizer.from_file(str(p))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.im_start_id = self._tok.token_to_id("<|im_start|>")
        self.im_end_id = self._tok.token_to_id("<|im_end|>")
        eos = self._first("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>")
        self.eos_id = eos if eos is not None else self.im_end_id  # id 0 is a valid id
        self.bos_id = self._first("<s>", "<|begin_of_text|>", "<bos>")
        pad = self._first("<pad>", "<|endoftext|>")
        self.pad_id = pad if pad is not None else self.eos_id

    def _first(self, *names: str) -> int | None:
        for n in names:
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


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte' or a path to a tokenizer.json (or its folder)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
