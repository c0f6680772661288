"""Chat JSONL -> templated prompt / response ids -> (context, canvas) pairs -> left-padded batches."""

import json

import pytest
import torch

from tadm.posttrain import (
    ChatCanvasDataset,
    ChatExample,
    collate_canvases,
    encode_chat,
    read_chat_jsonl,
    split_into_canvases,
)

from .conftest import tiny_chat_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


def _ids(tok, text):
    return tok.convert_tokens_to_ids(text.split())


def test_chat_template_splits_prompt_and_response(tok):
    prompt, response = encode_chat(tok, ChatExample("hello how are you", "fine thanks"))
    assert prompt == _ids(tok, "<bos> <start_of_turn> user hello how are you <end_of_turn> <start_of_turn> model")
    assert response == _ids(tok, "fine thanks <end_of_turn>")  # the reply and its end-of-turn marker


def test_truncation_keeps_the_generation_prompt_and_the_reply_start(tok):
    prompt, response = encode_chat(
        tok, ChatExample("the cat sat on a mat", "the dog ran far away"), max_prompt_tokens=4, max_response_tokens=3
    )
    assert prompt == _ids(tok, "mat <end_of_turn> <start_of_turn> model")
    assert response == _ids(tok, "the dog ran")
    with pytest.raises(ValueError, match=">= 1"):
        encode_chat(tok, ChatExample("a", "b"), max_prompt_tokens=0)


def test_canvases_carry_their_block_wise_context():
    canvases = split_into_canvases([1, 2], [10, 11, 12, 13, 14], canvas_length=2, pad_id=0)
    assert [c.context_ids for c in canvases] == [[1, 2], [1, 2, 10, 11], [1, 2, 10, 11, 12, 13]]
    assert [c.target_ids for c in canvases] == [[10, 11], [12, 13], [14, 0]]
    assert [c.target_mask for c in canvases] == [[True, True], [True, True], [True, False]]
    assert len(split_into_canvases([1], list(range(20)), canvas_length=4, pad_id=0, max_canvases=2)) == 2
    with pytest.raises(ValueError, match="non-empty prompt"):
        split_into_canvases([], [1], canvas_length=2, pad_id=0)


def test_collate_left_pads_contexts():
    canvases = split_into_canvases([1, 2], [10, 11, 12], canvas_length=2, pad_id=9)
    batch = collate_canvases(canvases, pad_id=9)
    assert batch.context_ids.tolist() == [[9, 9, 1, 2], [1, 2, 10, 11]]
    assert batch.context_mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert batch.targets.tolist() == [[10, 11], [12, 9]]
    assert batch.target_mask.tolist() == [[True, True], [True, False]]


def test_read_chat_jsonl_formats_and_errors(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"prompt": "hello", "response": "fine"},
        {"messages": [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}]},
        {"prompt": "what is it", "response": "a cat", "reasoning": "on"},
        {"prompt": "what is it", "response": "a dog", "reasoning": "off"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = read_chat_jsonl(path)
    assert examples == [ChatExample("hello", "fine"), ChatExample("how are you", "fine thanks"),
                        ChatExample("what is it", "a dog")]
    assert len(read_chat_jsonl(path, skip_reasoning=False)) == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: record lacks 'prompt', 'response'"):
        read_chat_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="none.jsonl' does not exist"):
        read_chat_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(IsADirectoryError, match="is a directory; give a JSONL file"):
        read_chat_jsonl(tmp_path)


@pytest.mark.parametrize("line,message", [
    ("{not json", r"bad.jsonl:1: not valid JSON"),
    ('["hello", "fine"]', r"bad.jsonl:1: expected a JSON object"),
    ('{"messages": "hello"}', r"bad.jsonl:1: 'messages' must be a list of \{'role', 'content'\} objects"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
     "expected exactly one user and one assistant message, got 2 and 0"),
    ('{"prompt": "a", "response": "b", "reasoning": "on"}', r"holds no usable \(no-think\) chat examples"),
])
def test_read_chat_jsonl_names_each_bad_record(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        read_chat_jsonl(bad)


@pytest.mark.parametrize("call,message", [
    (lambda: split_into_canvases([1], [2], canvas_length=0, pad_id=0), "canvas_length must be >= 1, got 0"),
    (lambda: split_into_canvases([1], [2], canvas_length=2, pad_id=0, max_canvases=0), "max_canvases must be >= 1"),
    (lambda: split_into_canvases([], [2], canvas_length=2, pad_id=0), "a canvas needs a non-empty prompt"),
    (lambda: collate_canvases([], pad_id=0), "cannot collate an empty batch"),
    (lambda: collate_canvases(split_into_canvases([1], [2], canvas_length=2, pad_id=0)
                              + split_into_canvases([1], [2], canvas_length=3, pad_id=0), pad_id=0),
     r"canvases of different lengths \[2, 3\] cannot be batched"),
])
def test_bad_canvas_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_dataset_builds_every_canvas(tok):
    examples = [ChatExample("hello", "the cat sat on a mat"), ChatExample("how are you", "fine")]
    data = ChatCanvasDataset(examples, tok, canvas_length=4, pad_id=tok.pad_token_id, canvases_per_example=8)
    # "the cat sat on a mat <end_of_turn>" = 7 tokens -> 2 canvases; "fine <end_of_turn>" -> 1
    assert len(data) == 3
    assert data[1].target_ids == _ids(tok, "a mat <end_of_turn>") + [tok.pad_token_id]
    batch = collate_canvases(list(data), tok.pad_token_id)
    assert batch.targets.shape == (3, 4) and batch.context_mask.sum(1).tolist() == [7, 11, 9]
    assert torch.equal(batch.context_ids[1, -4:], torch.tensor(_ids(tok, "the cat sat on")))


def test_dataset_refuses_ids_beyond_the_base_vocabulary(tok):
    examples = [ChatExample("hello", "the cat sat on a mat")]
    data = ChatCanvasDataset(examples, tok, canvas_length=4, pad_id=tok.pad_token_id, vocab_size=len(tok))
    assert len(data) == 2
    with pytest.raises(ValueError) as error:
        ChatCanvasDataset(examples, tok, canvas_length=4, pad_id=tok.pad_token_id, vocab_size=len(tok) - 1)
    assert "\n" not in str(error.value)
    assert f"has ids up to {len(tok) - 1} but the base's vocabulary is {len(tok) - 1}" in str(error.value)
