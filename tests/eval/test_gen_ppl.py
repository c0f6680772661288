"""Gen PPL against a direct computation of the evaluator's NLL, the counted positions, and bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tadm.cli import main
from tadm.eval.evaluator import evaluator_from_hf
from tadm.eval.gen_ppl import counted_positions, decode_samples, gen_ppl
from tadm.eval.mauve import text_features
from tests.eval.test_evaluator import (
    fixture_docs,
    save_ar_evaluator,
    tiny_ar,
    tiny_ar_evaluator,
    tiny_hf_gpt2,
    tiny_tokenizer,
)

EOS = "<|endoftext|>"


def known_texts() -> list[str]:
    docs = fixture_docs(3)
    return [
        docs[0][:300],
        "Short one." + EOS + "After the end." + EOS + EOS + "Tail",
        docs[1][:180] + EOS,
        docs[2][:40],
    ]


@torch.no_grad()
def direct_nll(texts, encode, logits_of, context, end_ids):
    """Per-chunk scoring written out with Python loops: sum of -log p over counted targets, count."""
    total, count = 0.0, 0
    for text in texts:
        ids = encode(text)
        for start in range(0, len(ids), context):
            chunk = ids[start : start + context]
            if len(chunk) < 2:
                continue
            log_probs = torch.log_softmax(logits_of(torch.tensor([chunk]))[0].double(), dim=-1)  # (n, V)
            seen_end = chunk[0] in end_ids
            for j in range(1, len(chunk)):
                is_end = chunk[j] in end_ids
                if is_end and seen_end:
                    continue  # only the first end-of-text token of a chunk is scored
                seen_end = seen_end or is_end
                total -= float(log_probs[j - 1, chunk[j]])
                count += 1
    return total, count


def test_counted_positions_hand_made():
    E = 9
    ids = torch.tensor([[5, E, 7, E, E, 3], [E, 3, E, 4, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    got = counted_positions(ids, valid, {E})
    # row 0: targets E(first end: counted), 7, E (second), E (third), 3 (not an end: counted)
    # row 1: position 0 is the first end, so the E at position 2 is not counted; padding never is
    expected = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("context", [64, 16])
def test_gen_ppl_equals_direct_nll_tadm_ar(context):
    ev = tiny_ar_evaluator()
    model = tiny_ar()
    texts = known_texts()
    total, count = direct_nll(texts, ev.encode_fn, model, context, ev.end_ids)
    result = gen_ppl(texts, ev, batch_size=3, context_size=context)
    assert result.num_tokens == count
    assert result.nll == pytest.approx(total / count, rel=1e-5)
    assert result.gen_ppl == pytest.approx(math.exp(total / count), rel=1e-5)
    # the first token of each chunk is context only
    n_tokens = [len(ev.encode([t])[0]) for t in texts]
    assert result.num_chunks == sum(math.ceil(n / context) - (n % context == 1) for n in n_tokens)
    assert sum(result.per_text_tokens) == count


@pytest.mark.slow
def test_gen_ppl_equals_direct_nll_hf_gpt2():
    model, hf_tok = tiny_hf_gpt2()
    ev = evaluator_from_hf(model, hf_tok, name="tiny-gpt2", context_size=32)
    texts = known_texts()
    total, count = direct_nll(texts, ev.encode_fn, lambda ids: model(ids).logits, 32, ev.end_ids)
    result = gen_ppl(texts, ev, batch_size=2)
    assert result.num_tokens == count
    assert result.gen_ppl == pytest.approx(math.exp(total / count), rel=1e-5)


@pytest.mark.slow
def test_gen_ppl_does_not_depend_on_batching_or_text_order():
    ev = tiny_ar_evaluator()
    texts = known_texts()
    one = gen_ppl(texts, ev, batch_size=1, context_size=16)
    many = gen_ppl(list(reversed(texts)), ev, batch_size=8, context_size=16)
    assert one.gen_ppl == pytest.approx(many.gen_ppl, rel=1e-5)  # float32 sums in another order
    assert one.num_tokens == many.num_tokens


def test_gen_ppl_is_token_weighted_not_a_mean_of_sample_perplexities():
    ev = tiny_ar_evaluator()
    texts = [fixture_docs(1)[0][:400], "Yes, sir."]
    result = gen_ppl(texts, ev)
    per_text = [math.exp(n / c) for n, c in zip(result.per_text_nll, result.per_text_tokens)]
    corpus = math.exp(sum(result.per_text_nll) / sum(result.per_text_tokens))
    assert result.gen_ppl == pytest.approx(corpus)
    assert result.gen_ppl != pytest.approx(sum(per_text) / 2, rel=1e-3)


def test_max_tokens_truncates_each_text():
    ev = tiny_ar_evaluator()
    texts = [fixture_docs(1)[0][:400]]
    assert gen_ppl(texts, ev, max_tokens=10).num_tokens == 9


def test_empty_sample_set_is_a_clear_error():
    with pytest.raises(ValueError, match="sample set is empty"):
        gen_ppl([], tiny_ar_evaluator())
    with pytest.raises(ValueError, match="no position to score"):
        gen_ppl(["a"], tiny_ar_evaluator())
    with pytest.raises(ValueError, match="sample set is empty"):
        decode_samples(torch.zeros((0, 4), dtype=torch.long), tiny_tokenizer())


def test_decode_rejects_samples_from_another_vocabulary_and_drops_masks():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"mismatched tokenizer.*id 500.*0\.\.319") as err:
        decode_samples(torch.tensor([[1, 2, 500]]), tok)
    assert "\n" not in str(err.value)
    ids = tok.encode("The jury")
    texts = decode_samples(torch.tensor([ids + [tok.mask_id]]), tok)
    assert texts == ["The jury"]
    assert decode_samples([[tok.eos_id] + ids], tok) == [EOS + "The jury"]


@pytest.mark.slow
def test_cli_gen_ppl_matches_the_api(tmp_path, capsys):
    evaluator_dir = save_ar_evaluator(tmp_path / "ar")
    tok = tiny_tokenizer()
    texts = known_texts()[:2]
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps({"token_ids": [tok.encode(t) for t in texts]}))
    code = main(["eval", "gen-ppl", "--samples", str(samples), "--tokenizer", str(evaluator_dir),
                 "--evaluator", str(evaluator_dir), "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    # the eos text inside a sample decodes to "<|endoftext|>" and is re-tokenized as the EOS id
    expected = gen_ppl(decode_samples([tok.encode(t) for t in texts], tok), tiny_ar_evaluator())
    assert record["gen_ppl"] == pytest.approx(expected.gen_ppl, rel=1e-6)
    assert record["entropy"] > 0


def test_cli_errors_are_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"token_ids": []}))
    assert main(["eval", "gen-ppl", "--samples", str(empty), "--evaluator", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "sample set is empty" in err and "\n" not in err
    text = tmp_path / "t.txt"
    text.write_text("Some text to score.")
    assert main(["eval", "gen-ppl", "--texts", str(text), "--evaluator", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing" in err and "prepare-evaluator" in err and "\n" not in err


def test_features_from_the_scoring_pass_equal_a_separate_mauve_pass():
    """MAUVE features taken from Gen PPL's own forward passes (one pass) are the ones text_features computes,
    including for a text of a single evaluator token, which the scoring pass cannot give."""
    ev = tiny_ar_evaluator()
    texts = known_texts()[:3] + ["a"]
    assert len(ev.encode(["a"])[0]) == 1
    result = gen_ppl(texts, ev, batch_size=2, features=True)
    separate = text_features(texts, ev, max_tokens=ev.context_size)
    assert result.features.shape == separate.shape and result.features.dtype == np.float32
    np.testing.assert_allclose(result.features, separate, rtol=1e-4, atol=1e-5)
    assert gen_ppl(texts, ev, batch_size=2).features is None
