import math

import pytest
import torch

from tadm.diffusion import (
    SCHEDULES,
    CosineSchedule,
    LinearSchedule,
    LogLinearSchedule,
    NoiseSchedule,
    get_schedule,
)

ALL = [LogLinearSchedule(), LinearSchedule(), CosineSchedule()]
IDS = [s.name for s in ALL]


def test_registry_names_match_classes():
    assert set(SCHEDULES) == {"loglinear", "linear", "cosine"}
    for name, cls in SCHEDULES.items():
        sched = get_schedule(name)
        assert isinstance(sched, cls)
        assert sched.name == name
        assert isinstance(sched, NoiseSchedule)


@pytest.mark.parametrize(
    "sched, alpha0, alpha1",
    [
        (LogLinearSchedule(), 1.0, 1e-3),
        (LinearSchedule(), math.exp(-1e-4), math.exp(-20.0)),
        (CosineSchedule(), 1.0, 1e-3),
    ],
    ids=IDS,
)
def test_alpha_endpoints(sched, alpha0, alpha1):
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    a = sched.alpha(t)
    assert a.dtype == torch.float64
    torch.testing.assert_close(a, torch.tensor([alpha0, alpha1], dtype=torch.float64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("sched", ALL, ids=IDS)
def test_alpha_strictly_decreasing_in_unit_interval(sched):
    t = torch.linspace(0, 1, 1001, dtype=torch.float64)
    a = sched.alpha(t)
    assert (a[1:] < a[:-1]).all()
    assert (a >= 0).all() and (a <= 1).all()


@pytest.mark.parametrize("sched", ALL, ids=IDS)
def test_dalpha_matches_central_finite_difference(sched):
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    h = 1e-6
    fd = (sched.alpha(t + h) - sched.alpha(t - h)) / (2 * h)
    torch.testing.assert_close(sched.dalpha(t), fd, rtol=1e-6, atol=1e-9)
    assert (sched.dalpha(t) < 0).all()


@pytest.mark.parametrize("sched", ALL, ids=IDS)
def test_loss_weight_is_minus_dalpha_over_one_minus_alpha(sched):
    t = torch.linspace(0.01, 1.0, 100, dtype=torch.float64)
    direct = -sched.dalpha(t) / (1.0 - sched.alpha(t))
    torch.testing.assert_close(sched.loss_weight(t), direct, rtol=1e-10, atol=0)


def test_loglinear_weight_is_exactly_one_over_t():
    t = torch.rand(1000) * 0.999 + 1e-3
    assert torch.equal(LogLinearSchedule().loss_weight(t), 1.0 / t)
    assert torch.equal(LogLinearSchedule(eps=0.1).loss_weight(t), 1.0 / t)


def test_cosine_weight_stays_accurate_at_small_t():
    # Exact series: 1 - cos(x) = x^2/2 - x^4/24 + ..., sin(x) = x - x^3/6; at tiny t the weight -> 2 / t.
    t = torch.tensor([1e-6], dtype=torch.float32)
    torch.testing.assert_close(CosineSchedule().loss_weight(t), 2.0 / t, rtol=1e-5, atol=0)


def test_python_and_integer_inputs_become_float():
    s = LogLinearSchedule()
    assert s.alpha(0.5).is_floating_point()
    torch.testing.assert_close(s.alpha(torch.tensor([0, 1])), torch.tensor([1.0, 1e-3]))


def test_get_schedule_passes_kwargs():
    s = get_schedule("loglinear", eps=0.01)
    torch.testing.assert_close(s.alpha(torch.tensor(1.0, dtype=torch.float64)), torch.tensor(0.01, dtype=torch.float64))
    lin = get_schedule("linear", sigma_min=0.0, sigma_max=5.0)
    one = torch.tensor(1.0, dtype=torch.float64)
    torch.testing.assert_close(lin.alpha(one), torch.tensor(math.exp(-5.0), dtype=torch.float64))


def test_unknown_schedule_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_schedule("geometric")
    msg = str(err.value)
    assert "'geometric'" in msg
    for name in ("loglinear", "linear", "cosine"):
        assert name in msg


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("loglinear", {"eps": 1.0}),
        ("cosine", {"eps": -0.1}),
        ("linear", {"sigma_min": 5.0, "sigma_max": 1.0}),
        ("loglinear", {"beta": 1.0}),
    ],
)
def test_bad_schedule_parameters_raise(name, kwargs):
    with pytest.raises(ValueError):
        get_schedule(name, **kwargs)
