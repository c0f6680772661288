"""Parsing the degeneration judge's verdicts out of messy answers, and the corruption summary."""

from __future__ import annotations

import math

import pytest

from tadm.tasks.verdict import Verdict, parse_verdict, summarize_verdicts

T, F, N = True, False, None

PARSED = [
    ('{"incoherent": true, "repetition_loop": false, "evidence": ["asdf qwer"], "brief_reason": "gibberish"}', T, F),
    ('```json\n{"incoherent": false, "repetition_loop": true, "evidence": [], "brief_reason": "loop"}\n```', F, T),
    ('```\n{"incoherent": false, "repetition_loop": false}\n```\nDone.', F, F),
    ('Here is my verdict:\n{"incoherent": false, "repetition_loop": null, "evidence": []}\nHope this helps!', F, N),
    ("{'incoherent': False, 'repetition_loop': True, 'evidence': ['a a a'], 'brief_reason': 'repeats'}", F, T),
    ("{'incoherent': false, 'repetition_loop': null}", F, N),
    ('{"incoherent": None, "repetition_loop": False}', N, F),
    ('{"incoherent": false, "repetition_loop": false, "evidence": [],}', F, F),
    ('{"incoherent": "true", "repetition_loop": "false"}', T, F),
    ('{"incoherent": "yes", "repetition_loop": "No"}', T, F),
    ('{"Incoherent": false, "Repetition Loop": true}', F, T),
    ('{"incoherent": false, "repetition-loop": false}', F, F),
    ('{"incoherent": false, "repetition_loop": false, "evidence": ["f(x) = {x}"], "brief_reason": "it\'s fine"}', F, F),
    ('{"incoherent": true, "repetition_loop": false, "evidence": ["he said \\"{\\" twice"]}', T, F),
    ('{"note": "first object"} then {"incoherent": true, "repetition_loop": true}', T, T),
    ('{"verdict": {"a": 1}, "incoherent": false, "repetition_loop": true, "evidence": [{"span": "x"}]}', F, T),
    ('{"incoherent": false, "repetition_loop": true, "evidence": ["the the the', F, T),  # cut off
    ("incoherent: false\nrepetition_loop: false", F, F),
    ('<think>hmm</think>\n```json\n{\n  "incoherent": null,\n  "repetition_loop": null\n}\n```', N, N),
]


@pytest.mark.parametrize("text, incoherent, repetition", PARSED)
def test_messy_answers_parse(text, incoherent, repetition):
    verdict = parse_verdict(text)
    assert verdict.parsed, verdict.error
    assert (verdict.incoherent, verdict.repetition_loop) == (incoherent, repetition)
    assert verdict.raw == text


UNPARSED = [
    "",
    "The response looks fine to me.",
    '{"foo": 1}',
    '{"incoherent": true}',  # a label is missing
    '{"incoherent": "maybe", "repetition_loop": false}',
    '{"incoherent": [true], "repetition_loop": false}',
    "```json\n{incoherent false}\n```",
    "the the the the the the",
    '{"incoherent":true,false,"repetition_loop":true,false,"evidence":[12+30],"brief_reason":"The answer',
    'incoherent: true or false? repetition_loop: false',
]


@pytest.mark.parametrize("text", UNPARSED)
def test_answers_without_a_verdict_are_unparsed_not_dropped(text):
    verdict = parse_verdict(text)
    assert not verdict.parsed and verdict.error and verdict.outcome == "unparsed"
    assert verdict.raw == text and not verdict.corrupted and not verdict.null


def test_evidence_and_reason_are_kept():
    text = '{"incoherent": true, "repetition_loop": false, "evidence": "xq zz", "brief_reason": "noise"}'
    verdict = parse_verdict(text)
    assert verdict.evidence == ["xq zz"] and verdict.brief_reason == "noise"
    assert verdict.as_dict()["outcome"] == "corrupted"


def test_summary_counts_corruption_null_and_unparsed():
    verdicts = [
        Verdict(True, False, parsed=True), Verdict(False, True, parsed=True), Verdict(True, True, parsed=True),
        Verdict(False, False, parsed=True), Verdict(False, None, parsed=True), Verdict(None, True, parsed=True),
        Verdict(raw="garbage", error="x"),
    ]
    summary = summarize_verdicts(verdicts)
    assert (summary.total, summary.parsed, summary.unparsed) == (7, 6, 1)
    assert (summary.corrupted, summary.incoherent, summary.repetition_loop) == (4, 2, 3)
    assert (summary.null, summary.clean) == (1, 1)
    assert summary.corruption == pytest.approx(4 / 6) and summary.null_share == pytest.approx(1 / 6)
    assert summary.as_dict()["corruption"] == pytest.approx(4 / 6)
    empty = summarize_verdicts([Verdict(raw="?")])
    assert empty.unparsed == 1 and math.isnan(empty.corruption)
