"""Significance over independent units, checked against hand computations."""

import math

import pytest

from tadm.eval.significance import mean_interval, paired_summary, prompt_differences, recovered_share, sign_test


@pytest.mark.parametrize("wins,losses,expected", [
    (5, 0, 2 / 32),  # 2 * P(X <= 0), n = 5
    (3, 0, 0.25),  # three of three training seeds
    (6, 4, 2 * (1 + 10 + 45 + 120 + 210) / 1024),  # 2 * P(X <= 4), n = 10
    (0, 0, 1.0),
    (10, 10, 1.0),
])
def test_sign_test_matches_the_binomial_tail(wins, losses, expected):
    assert sign_test(wins, losses) == pytest.approx(expected, rel=1e-12)
    assert sign_test(losses, wins) == pytest.approx(expected, rel=1e-12)


def test_mean_interval_is_the_student_t_interval():
    values = [1.0, 2.0, 3.0, 4.0]
    sd = math.sqrt(sum((v - 2.5) ** 2 for v in values) / 3)  # 1.2910
    half = 3.182446305284263 * sd / 2  # t_{0.975, 3} * sd / sqrt(4)
    mean, low, high = mean_interval(values)
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - half, 2.5 + half), rel=1e-9)
    assert math.isnan(mean_interval([0.3])[1])
    with pytest.raises(ValueError):
        mean_interval([])


def test_repeated_prompts_and_seeds_collapse_into_one_unit_each():
    # Method A and B on four items holding two distinct prompts, two sampling seeds each.
    a = [[("p", True), ("p", True), ("q", False), ("q", True)], [("p", True), ("p", False), ("q", True), ("q", True)]]
    b = [[("p", False), ("p", False), ("q", True), ("q", True)], [("p", True), ("p", False), ("q", True), ("q", True)]]
    d = prompt_differences(a, b)
    assert d == {"p": pytest.approx(3 / 4 - 1 / 4), "q": pytest.approx(3 / 4 - 1.0)}
    summary = paired_summary(d.values())
    assert (summary.units, summary.ahead, summary.behind, summary.tied) == (2, 1, 1, 0)
    assert summary.mean == pytest.approx((0.5 - 0.25) / 2)
    assert summary.sign_p == 1.0


def test_prompts_seen_by_one_method_only_are_an_error():
    with pytest.raises(ValueError, match="same prompts"):
        prompt_differences([[("p", True)]], [[("q", True)]])


def test_runs_of_unequal_seeds_or_items_are_an_error():
    """The paired design needs the same prompts with the same seeds: A with two seeds against B with one, or a run
    where one method saw a prompt more often, is refused in one line instead of averaged."""
    a = [[("p1", True), ("p2", False)], [("p1", False), ("p2", False)]]
    with pytest.raises(ValueError, match=r"method A has 2 runs \(sampling seeds\) and method B 1") as err:
        prompt_differences(a, [[("p1", True), ("p2", True)]])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"same prompts in run 0 \(e.g. \['p1', 'p2'\]\)"):
        prompt_differences([[("p1", True), ("p1", False), ("p2", True)]],
                           [[("p1", False), ("p2", False), ("p2", True)]])
    with pytest.raises(ValueError, match="same prompts in run 1"):  # the seeds' prompts swapped between runs
        prompt_differences([[("p1", True)], [("p2", True)]], [[("p1", True)], [("p1", True)]])
    # the same prompts and seeds in another item order pair up
    assert prompt_differences([[("p1", True), ("p2", False)]], [[("p2", True), ("p1", True)]]) == \
        {"p1": 0.0, "p2": -1.0}


def test_paired_summary_counts_ties_and_tests_the_rest():
    s = paired_summary([0.5, -0.25, 0.0, 1 / 3])
    assert (s.units, s.ahead, s.behind, s.tied) == (4, 2, 1, 1)
    assert s.sign_p == pytest.approx(1.0)  # 2 * P(X <= 1), n = 3 = 2 * 4/8
    s = paired_summary([0.1] * 6)
    assert s.sign_p == pytest.approx(2 / 64) and s.low == pytest.approx(0.1) and s.high == pytest.approx(0.1)
    assert math.isnan(s.t_p)  # no spread: no t statistic


def test_paired_t_test_of_a_zero_mean():
    d = [1.0, 2.0, 3.0, 4.0]
    t = 2.5 / (math.sqrt(5 / 3) / 2)  # mean / (sd / sqrt(n)) = 3.873
    assert t == pytest.approx(3.872983346)
    # two-sided p of t = 3.873 with 3 degrees of freedom: 2 * (1 - F_t3(t)), with the closed form of
    # the t3 CDF: F(t) = 1/2 + (atan(x) + x / (1 + x^2)) / pi, x = t / sqrt(3)
    x = t / math.sqrt(3)
    p = 2 * (0.5 - (math.atan(x) + x / (1 + x * x)) / math.pi)
    assert paired_summary(d).t_p == pytest.approx(p, rel=1e-9)
    assert math.isnan(paired_summary([0.2]).t_p)


def test_recovered_share():
    assert recovered_share(0.570, 0.442, 0.546) == pytest.approx(0.104 / 0.128)
    assert recovered_share(0.5, 0.3, 0.3) == 0.0
    assert math.isnan(recovered_share(0.4, 0.5, 0.6))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_paired_summary_refuses_a_unit_without_a_finite_difference(value):
    with pytest.raises(ValueError, match=rf"the difference of unit 1 is {value}; leave out units without a value"):
        paired_summary([0.5, value, 0.25])
    with pytest.raises(ValueError, match="at least one unit"):
        paired_summary([])
