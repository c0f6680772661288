"""The study report's spreads are over training seeds, and its paired table tests seeds as pairs."""

from tadm.study.config import load_study_config
from tadm.study.report import _model_table, _paired_table


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
