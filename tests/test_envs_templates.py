"""Turn templates: token ids end to end, loss mask on actions, parity with HF chat templates."""

from __future__ import annotations

import pytest

from tiderl.envs.templates import Transcript, template_for
from tiderl.models.tokenizer import ByteTokenizer, HFTokenizer

CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_byte_template_layout_and_loss_mask():
    tok = ByteTokenizer()
    tpl = template_for(tok)
    assert tpl.name == "byte" and tpl.stop_ids == {tok.im_end_id}
    t = Transcript.start(tpl, "guess 1-8")
    assert t.tokens == [tok.bos_id, tok.im_start_id, *b"guess 1-8", tok.im_end_id,
                        tok.im_start_id]
    sampled = [ord("4"), tok.im_end_id]
    assert t.add_action(sampled) == "4"
    new = t.add_observation("higher")
    assert new == [tok.im_start_id, *b"higher", tok.im_end_id, tok.im_start_id]
    # The sampled ids are kept verbatim, masked 1; everything the template wrote is masked 0.
    start, end = t.action_spans[0]
    assert t.tokens[start:end] == sampled
    assert [i for i, m in enumerate(t.loss_mask) if m] == list(range(start, end))
    assert len(t.tokens) == len(t.loss_mask) == 13 + 2 + 9


def test_truncated_action_is_closed_by_the_template_not_the_model():
    tok = ByteTokenizer()
    t = Transcript.start(template_for(tok), "go")
    assert t.add_action([ord("7"), ord("7")]) == "77"  # hit the action limit, no stop token
    new = t.add_observation("invalid")
    assert new[0] == tok.im_end_id and t.loss_mask[-len(new)] == 0


def _tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["user assistant system\n", "You are in a kitchen. There is a fridge.",
              "go north\ntake apple from fridge", "higher lower correct"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_chatml_matches_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    ours = HFTokenizer(path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path),
                                              chat_template=CHATML_JINJA)
    tpl = template_for(ours)
    assert tpl.name == "chatml"
    obs1, act1, obs2, act2, obs3 = ("You are in a kitchen.\nThere is a fridge.", "open fridge",
                                    "You open the fridge. It holds an apple.", "take apple",
                                    "Taken.")
    t = Transcript.start(tpl, obs1, system="Play the game.")
    for act, obs in ((act1, obs2), (act2, obs3)):
        # What the engine would sample: the action's tokens and the stop token.
        assert t.add_action(ours.encode(act) + [ours.im_end_id]) == act
        t.add_observation(obs)
    messages = [{"role": "system", "content": "Play the game."},
                {"role": "user", "content": obs1}, {"role": "assistant", "content": act1},
                {"role": "user", "content": obs2}, {"role": "assistant", "content": act2},
                {"role": "user", "content": obs3}]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    assert t.tokens == list(expected)
    assert tpl.stop_ids == {ours.im_end_id, ours.token_to_id("<|endoftext|>")}


def test_unknown_family_and_missing_specials_name_the_fix():
    with pytest.raises(ValueError, match="template family"):
        template_for(ByteTokenizer(), "mistral")
    with pytest.raises(ValueError, match="special tokens"):
        template_for(ByteTokenizer(), "llama3")
