"""The study report's spreads are over training seeds, and its paired table tests seeds as pairs."""

from tadm.study.config import load_study_config
from tadm.study.report import _likelihood_lines, _model_table, _paired_table, _sampling_lines


def _cfg():
    return load_study_config("study-tiny", ["staleness.steps=[32]", "staleness.max_age=2", "staleness.refresh=[1,2]",
                                            "seeds=[0,1,2,3]"])


def _staleness(model, seed, eval_seed, inc, blank=0.3):
    return {"model": model, "seed": seed, "eval_seed": eval_seed, "fresh": 2.0, "uninformative": 2.0 * (1 + blank),
            "curves": {"32": [2.0, 2.0, 2.0 * (1 + inc)]}}


def test_paired_table_takes_one_difference_per_training_seed():
    stale = [0.02, 0.03, 0.04, 0.05]
    fresh = [0.05, 0.05, 0.05, 0.07]
    rows = []
    for seed in range(4):  # two evaluation seeds each, +-0.01 around the seed's value: averaged first
        for e, shift in ((0, -0.01), (1, 0.01)):
            rows += [_staleness("tadm", seed, e, stale[seed] + shift), _staleness("tadm-fresh", seed, e, fresh[seed] + shift)]
    res = {"staleness": rows, "cached": [], "samples": []}
    table = _paired_table(_cfg(), res)
    row = next(line for line in table.splitlines() if line.startswith("| NELBO increase at k = 2, T = 32"))
    # differences -3, -2, -1, -2 points: mean -2, sd 0.8165, t_{0.975,3} = 3.1824 -> half width 1.30
    assert "| 4 | +3.50% | +5.50% | -2.00 [-3.30, -0.70] | 4 / 0 / 0 |" in row
    assert row.rstrip(" |").endswith("0.125")  # sign test: 2 / 2^4
    assert "| 0.0163 |" in row  # paired t-test: t = -4.899, 3 degrees of freedom


def test_model_table_spread_is_over_training_seeds_not_records():
    cfg = _cfg()
    lik = [{"model": "tadm", "seed": s, "eval_seed": e, "nll": v, "bound": "nelbo"}
           for s, e, v in ((0, 0, 2.0), (0, 1, 2.2), (1, 0, 2.4), (1, 1, 2.4))]
    models = [{"model": "tadm", "seed": s, "num_parameters": 1e6, "tokens_seen": 1e6, "train_seconds": 60.0}
              for s in (0, 1)]
    res = {"models": models, "likelihood": lik, "staleness": [], "cached": [], "samples": []}
    line = next(x for x in _model_table(cfg, res).splitlines() if x.startswith("| tadm |"))
    assert "2.2500 ± 0.1500" in line  # per-seed means 2.1 and 2.4; over the four records it would be ± 0.2000


def test_no_pairs_no_table():
    res = {"staleness": [_staleness("tadm", 0, 0, 0.02)], "cached": [], "samples": []}
    assert _paired_table(_cfg(), res) is None


def _sample(seed, gen_ppl, tps, mauve):
    return {"evaluator": "ar", "model": "tadm", "seed": seed, "steps": 8, "refresh": 2, "gen_ppl": gen_ppl,
            "entropy": 4.0, "mauve": mauve, "mauve_num_samples": 64, "mauve_buckets": 6, "tokens_per_second": tps,
            "tokens_per_second_min": tps - 10.0, "tokens_per_second_max": tps + 10.0, "throughput_generations": 5,
            "throughput_batch_size": 1, "layer_calls": 16, "compute_relative": 0.5}


def test_sampling_and_cached_sections_say_they_show_means_over_two_training_seeds():
    cfg = _cfg()
    res = {"samples": [_sample(0, 20.0, 100.0, 0.5), _sample(1, 30.0, 200.0, 0.7)], "data": [], "baseline_layers": 3,
           "models": [], "likelihood": [], "staleness": [],
           "cached": [{"model": "tadm", "seed": s, "eval_seed": 0, "bounds": {"1": 2.0, "2": 2.0 * (1 + inc)},
                       "increase": {"2": inc}} for s, inc in ((0, 0.10), (1, 0.20))]}
    text = "\n".join(_sampling_lines(cfg, res))
    assert "is the mean over the models of training seeds 0, 1" in text
    assert "| tadm (K=2) | 0.600 [64, 6 cl.] | 25.00 | 4.000 | 150.00 [140.0-160.0] |" in text  # means of both seeds
    assert "median tokens/s" not in text
    one_seed = "\n".join(_sampling_lines(cfg, {**res, "samples": res["samples"][:1]}))
    assert "mean over the models of training seeds" not in one_seed
    cached = "\n".join(_likelihood_lines(cfg, res))
    assert "| tadm | 2.0000 | 2.3000 (+15.00% ± 5.00) |" in cached  # increases 10% and 20%: ± is half their range
    assert "mean over training seeds ± half the range of the per-training-seed values" in cached.split(
        "## Cached reverse process")[1]
