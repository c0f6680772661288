"""Log-likelihood requests of lm-eval on tadm's own models: the scorer, the model, and a local multiple-choice task."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from tadm.eval.continuation import continuation_elbo  # noqa: E402
from tadm.tasks.likelihood import request_seed  # noqa: E402
from tadm.tasks.lm_eval_model import TadmLM  # noqa: E402

QUESTIONS = [
    {"question": "The cat sat on the", "choices": ["mat", "idea", "seven"], "label": 0},
    {"question": "The jury said it was", "choices": ["fair", "blue", "fast"], "label": 0},
    {"question": "He went to the", "choices": ["store", "of", "quickly"], "label": 0},
]


def requests(pairs, kind="loglikelihood"):
    return [Instance(kind, {}, pair, n) for n, pair in enumerate(pairs)]


def own_lm(model_dir, **args):
    return TadmLM(model=str(model_dir), device="cpu", **{"mc_samples": 8, "batch_size": 4, **args})


def test_the_k1_answer_is_llada_s_estimate_of_the_continuation_elbo(tadm_model_dir):
    lm = own_lm(tadm_model_dir, seed=3)
    (ll, greedy), = lm.loglikelihood(requests([("The cat sat on the", " mat")]))
    scorer = lm.likelihood_scorer()
    head, tail = scorer.encode_pair("The cat sat on the", " mat")
    assert head[0] == lm.generator.tokenizer.bos_id and tail == lm.generator.encode("The cat sat on the mat")[len(head):]
    expected = continuation_elbo(lm.generator.model, torch.tensor(head), torch.tensor(tail), num_samples=8,
                                 generator=torch.Generator().manual_seed(request_seed(3, "The cat sat on the", " mat")),
                                 batch_size=4)
    assert ll == -expected.nll and ll < 0 and greedy is False
    # trailing spaces of the context move to the continuation (LLaDA's _encode_pair)
    assert scorer.encode_pair("The cat sat on the ", "mat") == (head, tail)


def test_answers_depend_on_the_seed_and_the_request_not_on_the_order(tadm_model_dir):
    pairs = [("The cat sat on the", " mat and the dog"), ("He went to the", " store"), ("It was", " a dog")]
    first = own_lm(tadm_model_dir).loglikelihood(requests(pairs))
    reordered = own_lm(tadm_model_dir).loglikelihood(requests(pairs[::-1]))
    assert first == reordered[::-1]
    assert own_lm(tadm_model_dir, seed=1).loglikelihood(requests(pairs[:1]))[0][0] != first[0][0]
    # one continuation token is always the one masked position, with weight n / k = 1: no sampling noise
    scorer = own_lm(tadm_model_dir).likelihood_scorer()
    head, tail = scorer.encode_pair("The cat sat on the", " mat")
    assert scorer.score_ids(head, tail[:1], seed=1)[0] == scorer.score_ids(head, tail[:1], seed=2)[0]
    assert scorer.score_ids(head, tail + [7], seed=1)[0] != scorer.score_ids(head, tail + [7], seed=2)[0]


def test_k4_scores_with_the_cached_process_bound_and_reports_its_cost(tadm_model_dir):
    lm = own_lm(tadm_model_dir, K=4, steps=8)
    lm.loglikelihood(requests([("The cat sat on the", " mat")]))
    stats = lm.likelihood_stats[0]
    assert (stats.kind, stats.refresh_interval, stats.num_steps, stats.samples) == ("cached", 4, 8, 8)
    assert stats.network_passes == 2 * 8  # two batches of 4 sweeps, 8 steps each
    summary = lm.summary()["loglikelihood"]
    assert summary["bound"] == "cached" and summary["K"] == 4 and summary["likelihood_steps"] == 8
    assert summary["requests"] == 1 and summary["continuation_tokens"] == stats.continuation_tokens > 0
    assert summary["seconds"] > 0 and summary["tokens_per_second"] > 0
    assert summary["layer_calls"]["total"] == 16 * (lm.generator.model.layer_split.shared +
                                                    lm.generator.model.layer_split.anchor +
                                                    lm.generator.model.layer_split.denoiser)
    lm1 = own_lm(tadm_model_dir, K=1, likelihood_steps=8)  # the discrete bound at K = 1, for a like-for-like K sweep
    lm1.loglikelihood(requests([("The cat sat on the", " mat")]))
    assert lm1.likelihood_stats[0].kind == "cached" and lm1.likelihood_stats[0].refresh_interval == 1


def test_an_adaptive_policy_is_refused_for_loglikelihood(tadm_model_dir):
    lm = own_lm(tadm_model_dir, K="adaptive:tau=0.3")
    with pytest.raises(ValueError, match="need a fixed refresh interval K"):
        lm.loglikelihood(requests([("a", " b")]))


def test_rolling_loglikelihood_sums_disjoint_windows(tadm_model_dir):
    lm = own_lm(tadm_model_dir, mc_samples=2, batch_size=2)
    text = "the jury said it was a fair and quick trial " * 3
    (total,) = lm.loglikelihood_rolling(requests([(text,)], kind="loglikelihood_rolling"))
    windows = lm.likelihood_stats
    n = len(lm.generator.tokenizer.encode(text))  # canvas 64: windows of [BOS] + 63 tokens, then 63 more each
    assert n > 64 and len(windows) == -(-n // 63) and sum(w.continuation_tokens for w in windows) == n
    assert all(w.context_tokens + w.continuation_tokens <= 64 for w in windows)
    assert total == pytest.approx(-sum(w.nll for w in windows))


def test_greedy_check_reports_whether_greedy_decoding_gives_the_continuation(tadm_model_dir):
    lm = own_lm(tadm_model_dir, greedy_check=True, mc_samples=1)
    scorer = lm.likelihood_scorer()
    head, _ = scorer.encode_pair("The cat sat on the", " mat")
    assert not lm.generator.model.time_conditioned
    # the model's own greedy continuation of two tokens (most confident first) passes by construction
    z = head + [lm.generator.model.mask_token_id] * 2
    for _ in range(2):
        with torch.no_grad():
            probs = lm.generator.model(torch.tensor([z])).log_probs[0, len(head):].exp()  # no time input
        confidence, best = probs.max(-1)
        masked = [i for i in range(2) if z[len(head) + i] == lm.generator.model.mask_token_id]
        i = max(masked, key=lambda j: float(confidence[j]))
        z[len(head) + i] = int(best[i])
    greedy = z[len(head):]
    assert scorer.score_ids(head, greedy, seed=0)[1] is True
    other = [(greedy[0] + 1) % 60 + 1, greedy[1]]
    assert scorer.score_ids(head, other, seed=0)[1] is False


def test_a_continuation_that_cannot_fit_is_one_line(tadm_model_dir):
    lm = own_lm(tadm_model_dir)
    with pytest.raises(ValueError, match="a continuation of 70 tokens does not fit the model's max_seq_len"):
        lm.likelihood_scorer().score_ids([1, 2], list(range(3, 73)), seed=0)


@pytest.fixture
def mc_task_dir(tmp_path):
    """A local multiple-choice task (lm-eval's ``dataset_path: json``) and a generation task beside it."""
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(f"""\
task: tadm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "hf-cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (tmp_path / "tiny_gen.yaml").write_text(f"""\
task: tadm_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "hf-cache"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 4])
def test_a_local_multiple_choice_task_runs_through_tadm_lm_eval(mc_task_dir, tadm_model_dir, tmp_path, capsys, K):
    from tadm.tasks.lm_eval_cli import main

    out = tmp_path / f"results-K{K}"
    code = main(["--model", "tadm", "--model_args", f"model={tadm_model_dir},K={K},steps=4,mc_samples=4,seed=1",
                 "--tasks", str(mc_task_dir / "tiny_mc.yaml"), "--batch_size", "4", "--device", "cpu",
                 "--output_path", str(out), "--log_samples"])
    assert code == 0, capsys.readouterr().err[-2000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    metrics = results["results"]["tadm_tiny_mc"]
    assert 0.0 <= metrics["acc,none"] <= 1.0
    samples = [json.loads(line) for line in next(out.rglob("samples_tadm_tiny_mc_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["resps"]) == 3 for s in samples)  # three choices scored per question
    lls = [float(r[0][0]) for s in samples for r in s["resps"]]  # the samples file writes them as strings
    assert all(v < 0 for v in lls) and len(set(lls)) == 9


@pytest.mark.slow
def test_a_run_mixing_generation_and_multiple_choice_tasks_answers_both(mc_task_dir, tadm_model_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tadm.tasks import register_lm_eval_model

    register_lm_eval_model()
    lm = TadmLM(model=str(tadm_model_dir), K=2, steps=4, mc_samples=4, batch_size=3, device="cpu")
    manager = TaskManager(include_path=str(mc_task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tadm_tiny_mc", "tadm_tiny_gen"], task_manager=manager)
    assert set(results["results"]) == {"tadm_tiny_mc", "tadm_tiny_gen"}
    summary = lm.summary()
    assert summary["requests"] == 3 and summary["loglikelihood"]["requests"] == 9
    assert summary["loglikelihood"]["K"] == 2 and summary["loglikelihood"]["bound"] == "cached"
