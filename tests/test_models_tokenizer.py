"""Tokenizers: the byte tokenizer and a local HF tokenizer.json (made here, never downloaded)."""

import pytest
from tokenizers import Tokenizer, models

from tiderl.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo 1-8")
    assert max(ids) < 256 and tok.decode(ids) == "héllo 1-8"
    assert tok.decode([tok.bos_id, *ids, tok.im_end_id]) == "héllo 1-8"
    assert tok.decode([tok.im_start_id], skip_special=False) == "<|im_start|>"
    assert tok.vocab_size == 272 and load_tokenizer("byte").eos_id == 258


def test_hf_tokenizer_specials_keep_id_zero(tmp_path):
    t = Tokenizer(models.WordLevel({"</s>": 0, "<pad>": 1, "a": 2, "b": 3}, unk_token="a"))
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.vocab_size == 4
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        HFTokenizer(tmp_path / "missing")
