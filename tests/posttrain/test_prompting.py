"""Prompts for block-wise generation: left padding, the chat template, the stop id."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tadm.posttrain.prompting import encode_prompts, end_of_sequence_id


class FakeTokenizer:
    pad_token_id = 9
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [ord(c) - 96 for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        assert tokenize and add_generation_prompt and enable_thinking is False
        return {"input_ids": [7] + self(messages[0]["content"])["input_ids"][1:] + [8]}


def test_prompts_are_left_padded_with_a_mask():
    ids, mask = encode_prompts(FakeTokenizer(), ["ab", "c"], chat=False)
    assert ids.tolist() == [[1, 1, 2], [9, 1, 3]]
    assert mask.tolist() == [[True, True, True], [False, True, True]]


def test_chat_prompts_use_the_template_without_thinking():
    ids, mask = encode_prompts(FakeTokenizer(), ["a", "bc"])
    assert ids.tolist() == [[9, 7, 1, 8], [7, 2, 3, 8]] and mask.sum().item() == 7
    with pytest.raises(ValueError, match="no prompts"):
        encode_prompts(FakeTokenizer(), [])


def test_end_of_sequence_prefers_the_generation_config():
    tok = FakeTokenizer()
    with_config = SimpleNamespace(model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 106])))
    assert end_of_sequence_id(with_config, tok) == [1, 106]
    assert end_of_sequence_id(SimpleNamespace(), tok) == 2
    assert torch.is_tensor(encode_prompts(tok, ["a"])[0])


def test_ids_beyond_the_base_vocabulary_are_one_line_naming_the_tokenizer():
    tok = FakeTokenizer()
    ids, _ = encode_prompts(tok, ["ab"], chat=False, vocab_size=10)  # ids 1, 1, 2 and pad 9 fit
    assert ids.tolist() == [[1, 1, 2]]
    with pytest.raises(ValueError) as error:
        encode_prompts(tok, ["az"], chat=False, vocab_size=10)  # z -> 26
    assert str(error.value) == ("tokenizer 'FakeTokenizer' has ids up to 26 but the base's vocabulary is 10 "
                                "(ids 0..9): use the base model's own tokenizer")
    with pytest.raises(ValueError, match="has ids up to 9 but the base's vocabulary is 9"):
        encode_prompts(tok, ["ab"], chat=False, vocab_size=9)  # the pad id, written after a reply's end
