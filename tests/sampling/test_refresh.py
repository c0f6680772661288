"""Refresh policies (fixed, schedule, adaptive) driving Algorithm 1's one loop."""

import math

import pytest
import torch

from tadm.eval.compute import layer_calls, policy_layer_calls
from tadm.nn import tadm_tiny
from tadm.sampling.base import ConfiguredSampler
from tadm.sampling import (
    AdaptiveRefresh,
    FixedRefresh,
    LayerSplit,
    LoopContext,
    SamplerOutput,
    ScheduleRefresh,
    denoise,
    generate,
    get_refresh_policy,
    get_sampler,
    is_refresh_step,
    parse_refresh,
    policy_from_key,
)

SPLIT = LayerSplit(shared=1, anchor=3, denoiser=2)


class _StubNet:
    """A network whose stages cost nothing: the loop's decisions are all that is tested."""

    layer_split = SPLIT
    vocab_size = 5
    mask_token_id = 4
    time_conditioned = False
    predicts_rows = False

    def prepare(self, z, context=None, t=None):
        return t

    def encode(self, z, t=None):
        return z[..., None].float()

    def compute_anchor(self, c, t=None):
        return c.clone()

    def predict(self, z, c, anchor, t=None):
        return torch.zeros(*z.shape, self.vocab_size)


class _UnmaskSampler(ConfiguredSampler):
    """Unmasks the ``per_step[n]`` leftmost masked positions at the n-th step (deterministic drift)."""

    def set_timesteps(self, num_steps):
        self.num_steps = num_steps

    def time(self, i):
        return i / self.num_steps

    def initial_canvas(self, batch_size, seq_len, generator, device):
        return torch.full((batch_size, seq_len), 4)

    def __init__(self, per_step):
        self.per_step = per_step
        self.calls = 0

    def step(self, log_probs, i, z, generator=None):
        z = z.clone()
        for row in z:
            masked = (row == 4).nonzero().flatten()[: self.per_step[self.calls]]
            row[masked] = 0
        self.calls += 1
        return SamplerOutput(prev_sample=z)


def _refresh_steps(policy, T, L=8, per_step=None):
    sampler = _UnmaskSampler(per_step or [0] * T)
    z = torch.full((1, L), 4)
    run = denoise(_StubNet(), sampler, z, range(T, 0, -1), policy=policy)
    return run.cache.history, run.layer_calls


@pytest.mark.parametrize("T", [128, 256, 512, 1024])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_fixed_reproduces_algorithm_1_refresh_steps_for_table_2(T, K):
    history, calls = _refresh_steps(FixedRefresh(K), T, L=2)
    assert history == [i for i in range(T, 0, -1) if (T - i) % K == 0]
    assert history == [i for i in range(T, 0, -1) if is_refresh_step(i, T, K)]
    assert len(history) == math.ceil(T / K)
    assert calls.total == layer_calls(SPLIT, T, K) == policy_layer_calls(SPLIT, T, FixedRefresh(K))


def test_schedule_refreshes_exactly_at_the_given_steps():
    steps = [32, 31, 20, 7, 6, 1]
    history, calls = _refresh_steps(ScheduleRefresh(steps), 32)
    assert history == steps
    assert calls.anchor_refreshes == 6
    assert calls.total == 32 * (1 + 2) + 6 * 3 == policy_layer_calls(SPLIT, 32, ScheduleRefresh(steps))
    # steps outside the run never refresh, and order/duplicates in the list do not matter
    assert _refresh_steps(ScheduleRefresh([40, 10, 16, 16]), 16)[0] == [16, 10]


def test_schedule_without_the_first_step_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must list the first step, i = T = 16 .*got steps 10/5"):
        _refresh_steps(ScheduleRefresh([10, 5]), 16)
    # the compute count refuses the same schedule the loop refuses, and a one-step schedule is a schedule
    with pytest.raises(ValueError, match="i = T = 16"):
        policy_layer_calls(SPLIT, 16, ScheduleRefresh([10, 5]))
    assert policy_layer_calls(SPLIT, 16, parse_refresh("schedule:steps=16")) == 16 * (1 + 2) + 3
    assert policy_layer_calls(SPLIT, 16, parse_refresh("schedule:steps=32/16/4")) == 16 * (1 + 2) + 2 * 3


def test_adaptive_refreshes_when_the_drift_reaches_tau():
    # L = 20; step n unmasks per_step[n] positions; tau = 0.14 means 3 changed positions, counted
    # against the canvas the cached anchor was computed on.
    per_step = [1, 1, 1, 2, 0, 3, 1, 1, 1, 0]
    # refresh at n = 0 (empty cache); drift 3 at n = 3 -> refresh; then 2 (n=4), 2 (n=5), 5 (n=6)
    # -> refresh; then 1, 2, 3 -> refresh at n = 9.
    history, calls = _refresh_steps(AdaptiveRefresh(0.14), 10, L=20, per_step=per_step)
    assert history == [10 - n for n in (0, 3, 6, 9)]
    assert calls.anchor_refreshes == 4
    assert policy_layer_calls(SPLIT, 10, AdaptiveRefresh(0.14), counted=calls) == calls.total == 10 * 3 + 4 * 3
    # min_interval 4: n = 4 (drift 5) and n = 8 (drift 0 + 3 + 1 + 1 = 5)
    assert _refresh_steps(AdaptiveRefresh(0.14, min_interval=4), 10, L=20, per_step=per_step)[0] == [10, 6, 2]
    # max_interval 2 forces n = 2, 4, 6, 8 (the drift never reaches 3 within two steps here)
    assert _refresh_steps(AdaptiveRefresh(0.14, max_interval=2), 10, L=20, per_step=per_step)[0] == [10, 8, 6, 4, 2]


def test_adaptive_compute_needs_the_counted_calls():
    with pytest.raises(ValueError, match="depends on the sampled canvases; only a counted generation gives it"):
        policy_layer_calls(SPLIT, 10, AdaptiveRefresh(0.1))


def _tiny():
    torch.manual_seed(0)
    model = tadm_tiny().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("sampler_name", ["mdlm", "remdm-loop"])
def test_adaptive_limits_equal_fixed_policies_token_for_token(sampler_name):
    model = _tiny()
    run = lambda **kw: generate(model, get_sampler(sampler_name, model.mask_token_id), batch_size=2, seq_len=16,
                                num_steps=24, generator=torch.Generator().manual_seed(5), **kw)
    k1, k4 = run(refresh_interval=1), run(refresh_interval=4)
    tau0 = run(policy=AdaptiveRefresh(0.0))
    assert torch.equal(tau0.tokens, k1.tokens) and tau0.refresh_steps == k1.refresh_steps
    capped = run(policy=AdaptiveRefresh(1.5, max_interval=4))
    assert torch.equal(capped.tokens, k4.tokens) and capped.refresh_steps == k4.refresh_steps
    assert capped.layer_calls.as_dict() == k4.layer_calls.as_dict()
    # in between, the policy really adapts: fewer refreshes than K = 1, more than never
    middle = run(policy=AdaptiveRefresh(0.1))
    assert 1 < middle.layer_calls.anchor_refreshes < 24
    assert middle.policy == "adaptive tau=0.1" and middle.refresh_interval is None


def test_fixed_with_skip_unchanged_is_the_old_generate_flag():
    model = _tiny()
    run = lambda **kw: generate(model, get_sampler("mdlm", model.mask_token_id), batch_size=1, seq_len=8,
                                num_steps=64, generator=torch.Generator().manual_seed(2), **kw)
    flag, policy = run(refresh_interval=2, skip_unchanged=True), run(policy=FixedRefresh(2, skip_unchanged=True))
    assert torch.equal(flag.tokens, policy.tokens)
    assert flag.layer_calls.as_dict() == policy.layer_calls.as_dict()
    assert flag.layer_calls.skipped_steps > 0  # T = 64 > L = 8: many steps unmask nothing


def test_policy_is_reset_between_runs():
    policy = AdaptiveRefresh(0.14)
    first = _refresh_steps(policy, 10, L=20, per_step=[1, 1, 1, 2, 0, 3, 1, 1, 1, 0])[0]
    second = _refresh_steps(policy, 10, L=20, per_step=[1, 1, 1, 2, 0, 3, 1, 1, 1, 0])[0]
    assert first == second == [10, 7, 4, 1]


class _StopAfter(LoopContext):
    def __init__(self, n):
        self.n, self.seen = n, 0

    def after_step(self, position, step_index, z, output):
        self.seen += 1
        return output.prev_sample

    def finished(self):
        return self.seen >= self.n


def test_loop_context_can_stop_a_run_early():
    run = denoise(_StubNet(), _UnmaskSampler([1] * 10), torch.full((1, 4), 4), range(10, 0, -1),
                  policy=FixedRefresh(1), context=_StopAfter(3))
    assert run.steps_run == 3 and run.cache.history == [10, 9, 8]


def test_a_context_is_refused_by_networks_that_take_none():
    class _Prompted(LoopContext):
        def pass_context(self):
            return "a prompt"

    model = tadm_tiny().eval()
    sampler = get_sampler("mdlm", model.mask_token_id)
    sampler.set_timesteps(1)
    with pytest.raises(TypeError, match="TADM takes no per-pass context"):
        denoise(model, sampler, torch.full((1, 4), model.mask_token_id), [1], policy=FixedRefresh(1),
                context=_Prompted())


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("fixed", {"interval": 0}, "K must be an integer >= 1, got 0"),
        ("fixed", {"interval": 2.5}, "got 2.5"),
        ("fixed", {"K": 2}, "refresh policy 'fixed' has no parameter 'K'; its parameters: interval, skip_unchanged"),
        ("adaptive", {}, "refresh policy 'adaptive' needs tau; its parameters: tau, min_interval"),
        ("schedule", {"steps": []}, "non-empty list"),
        ("schedule", {"steps": [3, -1]}, "step indices i >= 0"),
        ("adaptive", {"tau": float("nan")}, r"tau \(share of changed positions\) must be a finite number in \[0, inf\), got nan"),
        ("adaptive", {"tau": -0.1}, "got -0.1"),
        ("adaptive", {"tau": 0.1, "min_interval": 4, "max_interval": 2}, "max_interval 2 is below min_interval 4"),
        ("stale", {}, "unknown refresh policy 'stale'; valid: fixed, schedule, adaptive"),
    ],
)
def test_bad_policy_parameters_are_clear_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        get_refresh_policy(name, **params)


def test_generate_refuses_a_policy_together_with_an_interval():
    model = _tiny()
    with pytest.raises(ValueError, match="either a refresh policy or refresh_interval"):
        generate(model, get_sampler("mdlm", model.mask_token_id), batch_size=1, seq_len=4, num_steps=4,
                 refresh_interval=2, policy="fixed")


@pytest.mark.parametrize("policy", [FixedRefresh(4, skip_unchanged=True), ScheduleRefresh([16, 9, 3]),
                                    AdaptiveRefresh(0.05, min_interval=2, max_interval=8)])
def test_a_policy_round_trips_through_its_config_mapping(policy):
    """config() is what results and YAML hold; refresh_policy_from_config rebuilds the same policy."""
    from tadm.sampling import refresh_policy_from_config

    rebuilt = refresh_policy_from_config(policy.config())
    assert type(rebuilt) is type(policy) and rebuilt.config() == policy.config()
    assert refresh_policy_from_config("fixed").config() == FixedRefresh(1).config()
    with pytest.raises(ValueError, match="'policy' key"):
        refresh_policy_from_config({"tau": 0.1})
    with pytest.raises(ValueError, match="refresh policy 'adaptive' has no parameter 'taus' and needs tau"):
        refresh_policy_from_config({"policy": "adaptive", "taus": 0.1})


@pytest.mark.parametrize("spec", [4, "fixed:K=4:skip_unchanged=true", "adaptive:tau=0.3",
                                  "adaptive:tau=0.3:max_interval=16:min_interval=2", "schedule:steps=48/40/24",
                                  "schedule:steps=48/40/24:skip_unchanged=true"])
def test_policy_from_key_reads_a_key_back(spec):
    policy = parse_refresh(spec)
    again = policy_from_key(policy.key)
    assert type(again) is type(policy) and again.config() == policy.config() and again.key == policy.key
    assert policy_from_key(policy.record).config() == policy.config()  # the int K that result rows record


def test_policy_from_key_refuses_what_no_policy_writes():
    with pytest.raises(ValueError, match="cannot read 'bogus3'"):
        policy_from_key("adaptive-bogus3")
    with pytest.raises(ValueError, match="unknown refresh policy"):
        policy_from_key("sometimes-tau0.3")


@pytest.mark.parametrize("spec,message", [
    (2.5, "refresh spec 2.5 is not a refresh policy; valid forms: 4, fixed:K=4"),
    (True, "refresh spec True is not a refresh policy"),
    ("adaptive:tau", "refresh spec 'adaptive:tau': 'tau' is not KEY=VALUE"),
    ("sometimes:tau=0.1", "unknown policy 'sometimes'"),
    ("fixed:K=0", "anchor refresh interval K must be an integer >= 1, got 0"),
    ("fixed:K=2:K=3", "refresh spec 'fixed:K=2:K=3' gives 'interval' twice"),
    ("fixed:K=2:interval=3", "gives 'interval' twice"),
    ("adaptive:tau=0.1:tau=0.2", "gives 'tau' twice"),
])
def test_parse_refresh_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_refresh(spec)


def test_spec_values_and_ready_policies():
    policy = parse_refresh("adaptive:tau=0.25:max_interval=none:skip_unchanged=false")
    assert (policy.tau, policy.max_interval, policy.skip_unchanged) == (0.25, None, False)
    assert parse_refresh(policy) is policy and get_refresh_policy(policy) is policy
    with pytest.raises(ValueError, match=r"parameters \['interval'\] given with a ready policy"):
        get_refresh_policy(policy, interval=2)
    assert repr(parse_refresh("fixed:K=4")) == "FixedRefresh(skip_unchanged=False, interval=4)"


def test_a_schedule_needs_one_step_index_per_step():
    """Rows on different step indices (the rollout's per-row steps) cannot follow a schedule of step indices."""
    with pytest.raises(TypeError, match="one step index per step, not one per row"):
        ScheduleRefresh([4, 2]).due(0, torch.tensor([4, 3]), torch.zeros(2, 3), None)


@pytest.mark.parametrize("spec,label", [
    ("4", "K=4"),
    ("fixed:K=4:skip_unchanged=true", "K=4 (skip unchanged)"),
    ("schedule:steps=8/4/2", "schedule(3)"),
    ("schedule:steps=8/4:skip_unchanged=true", "schedule(2) (skip unchanged)"),
    ("adaptive:tau=0.1:max_interval=8", "adaptive tau=0.1,<=8"),
    ("adaptive:tau=0.1:skip_unchanged=true", "adaptive tau=0.1 (skip unchanged)"),
])
def test_labels_say_what_every_policy_does(spec, label):
    assert parse_refresh(spec).label() == label


def test_the_short_form_of_K_takes_parameters_too():
    assert parse_refresh("4:skip_unchanged=true").config() == parse_refresh("fixed:K=4:skip_unchanged=true").config()
    with pytest.raises(ValueError, match="gives 'interval' twice"):
        parse_refresh("4:K=3")
