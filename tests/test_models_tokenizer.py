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


def test_byte_tokenizer_reads_the_image_placeholders_as_tokens_and_nothing_else():
    """The Qwen-VL image placeholders are ids 261-263 (a tiny vision-language policy's); the
    chat specials' names and other text stay bytes, so the embedded default's ids are
    unchanged."""
    tok = ByteTokenizer()
    ids = tok.encode("a<|vision_start|><|image_pad|><|image_pad|><|vision_end|>b")
    assert ids == [97, 261, 262, 262, 263, 98]
    assert tok.encode("<|im_end|> <eos> <|image|>") == list(b"<|im_end|> <eos> <|image|>")
    assert tok.decode(ids) == "ab"
    assert tok.encode(tok.decode(ids, skip_special=False)) == ids
    assert [tok.token_to_id(t) for t in ("<|vision_start|>", "<|image_pad|>",
                                         "<|vision_end|>")] == [261, 262, 263]
    assert tok.vocab_size == 272


def test_hf_tokenizer_specials_keep_id_zero(tmp_path):
    t = Tokenizer(models.WordLevel({"</s>": 0, "<pad>": 1, "a": 2, "b": 3}, unk_token="a"))
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.vocab_size == 4
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        HFTokenizer(tmp_path / "missing")


def _folder_with_specials(path):
    t = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    t.add_special_tokens(["<s>", "</s>", "<|eot|>", "<|eom|>", "<pad>"])
    path.mkdir(parents=True, exist_ok=True)
    t.save(str(path / "tokenizer.json"))
    return t


def test_hf_tokenizer_reads_a_checkpoint_folder(tmp_path):
    """tokenizer_config.json (specials as text or as AddedToken dicts, a chat_template), a
    chat_template.jinja that wins over it, and generation_config.json's eos list."""
    import json

    t = _folder_with_specials(tmp_path)
    ids = {n: t.token_to_id(n) for n in ("<s>", "</s>", "<|eot|>", "<|eom|>", "<pad>")}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "<|eot|>", "pad_token": "<pad>", "unk_token": None,
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}D"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["</s>"], ids["<|eom|>"], ids["<|eot|>"]]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.chat_template == "{{ bos_token }}D"  # the 'default' of a list of templates
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "<|eot|>", "pad_token": "<pad>"}
    assert (tok.bos_token, tok.eos_token) == ("<s>", "<|eot|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ids["<s>"], ids["<|eot|>"], ids["<pad>"])
    # The config's eos first, then generation_config's, without repeats.
    assert tok.eos_ids == (ids["<|eot|>"], ids["</s>"], ids["<|eom|>"])
    assert tok.added_tokens["<|eom|>"] == ids["<|eom|>"]

    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["</s>"]}))
    tok = HFTokenizer(tmp_path / "tokenizer.json")  # a file path reads its folder too
    assert tok.chat_template == "J{{ eos_token }}"
    assert tok.eos_ids == (ids["<|eot|>"], ids["</s>"])


def test_hf_tokenizer_without_config_has_no_chat_facts(tmp_path):
    _folder_with_specials(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.chat_template is None and tok.eos_ids == () and tok.special_tokens == {}
    assert tok.eos_id == tok.token_to_id("</s>") and tok.bos_id == tok.token_to_id("<s>")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.tokenizer"):
        HFTokenizer(tmp_path)
