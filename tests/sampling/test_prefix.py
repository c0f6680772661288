"""Prompted generation: ``generate(..., prefix=...)`` keeps the prompt at every step, for every model, sampler and K."""

from __future__ import annotations

import pytest
import torch

from tadm.nn import adlm_tiny, ar_tiny, mdlm_tiny, tadm_tiny
from tadm.posttrain import AnchoredBackbone, FusionSpec, MDLMBackbone, SplitSpec
from tadm.sampling import AdaptiveRefresh, ScheduleRefresh, generate, get_sampler
from tadm.sampling.autoregressive import generate_autoregressive

from tests.sampling.oracle import OracleDenoiser
from tests.sampling.test_generate_models import _randomize

PROMPTS = [[0, 5, 6, 7, 8], [0, 9]]  # rows of different lengths: each keeps its own
MASKED_SAMPLERS = ("mdlm", "remdm-cap", "remdm-rescale", "remdm-conf", "remdm-loop")


def _models():
    torch.manual_seed(0)
    mdlm = _randomize(mdlm_tiny()).eval()
    return {
        "tadm": _randomize(tadm_tiny()).eval(),
        "tadm-tc": _randomize(tadm_tiny(time_conditioning=True)).eval(),
        "adlm": _randomize(adlm_tiny()).eval(),
        "mdlm": mdlm,
        "split-mdlm": AnchoredBackbone(MDLMBackbone(mdlm), SplitSpec(1, 1), FusionSpec(rank=8, num_heads=2)),
    }


MODELS = _models()


def _kept(out, prompts=PROMPTS):
    return all(out.tokens[n, :len(p)].tolist() == p for n, p in enumerate(prompts))


@pytest.mark.parametrize("net", sorted(MODELS))
@pytest.mark.parametrize("sampler", MASKED_SAMPLERS)
def test_the_prompt_is_kept_at_every_K_and_the_rest_is_generated(net, sampler):
    model = MODELS[net]
    for refresh in (dict(refresh_interval=1), dict(refresh_interval=3), dict(policy=AdaptiveRefresh(tau=0.3)),
                    dict(policy=ScheduleRefresh([10, 6, 2]))):
        out = generate(model, sampler, batch_size=2, seq_len=14, num_steps=10, prefix=PROMPTS,
                       generator=torch.Generator().manual_seed(3), **refresh)
        assert _kept(out), (net, sampler, refresh)
        assert out.prefix_lengths == [5, 2]
        assert not torch.any(out.tokens == model.mask_token_id)  # every position after the prompt is generated
        assert out.new_tokens(1).shape == (12,) and torch.equal(out.new_tokens(0), out.tokens[0, 5:])


def test_one_prompt_for_every_row_a_tensor_and_a_list_give_the_same_tokens():
    model = MODELS["tadm"]
    runs = [generate(model, "remdm-cap", batch_size=3, seq_len=12, num_steps=8, refresh_interval=2, prefix=prefix,
                     generator=torch.Generator().manual_seed(1)).tokens
            for prefix in ([0, 4, 2], torch.tensor([0, 4, 2]), torch.tensor([[0, 4, 2]] * 3), [[0, 4, 2]] * 3)]
    assert all(torch.equal(tokens, runs[0]) for tokens in runs)
    assert runs[0][:, :3].tolist() == [[0, 4, 2]] * 3


def _uncached_with_prefix(model, sampler, prompts, L, T, seed, time_conditioned):
    """The reference: a full forward pass model(z_t) at every step, no cache object, the prompt written back."""
    g = torch.Generator().manual_seed(seed)
    sampler.set_timesteps(T)
    z = sampler.initial_canvas(len(prompts), L, g, torch.device("cpu"))
    kept = torch.zeros_like(z, dtype=torch.bool)
    values = torch.zeros_like(z)
    for n, p in enumerate(prompts):
        kept[n, :len(p)], values[n, :len(p)] = True, torch.tensor(p)
    z = torch.where(kept, values, z)
    for i in range(T, 0, -1):
        t = torch.full((len(prompts),), sampler.time(i)) if time_conditioned else None
        with torch.no_grad():
            log_probs = model(z, t=t).log_probs
        z = torch.where(kept, values, sampler.step(log_probs, i, z, g).prev_sample)
    return z


@pytest.mark.parametrize("sampler", ["mdlm", "remdm-cap", "remdm-loop"])
@pytest.mark.parametrize("net", ["tadm", "tadm-tc"])
def test_K1_with_a_prompt_equals_the_uncached_model_token_for_token(sampler, net):
    model, tc = MODELS[net], net == "tadm-tc"
    ref = _uncached_with_prefix(model, get_sampler(sampler, model.mask_token_id), PROMPTS, 16, 12, 7, tc)
    out = generate(model, get_sampler(sampler, model.mask_token_id), batch_size=2, seq_len=16, num_steps=12,
                   refresh_interval=1, prefix=PROMPTS, generator=torch.Generator().manual_seed(7))
    assert torch.equal(out.tokens, ref)


def test_a_remasking_sampler_never_changes_the_prompt_even_where_the_network_predicts_other_tokens():
    target = torch.full((2, 10), 3)  # the network is sure every position is token 3
    oracle = OracleDenoiser(target, vocab_size=8, sharpness=50.0)
    sampler = get_sampler("remdm-cap", oracle.mask_token_id, eta=1.0, top_p=1.0)  # remask all it may
    out = generate(oracle, sampler, batch_size=2, seq_len=10, num_steps=20, refresh_interval=4,
                   prefix=[[1, 2, 4], [5]], generator=torch.Generator().manual_seed(0))
    assert out.tokens[0, :3].tolist() == [1, 2, 4] and out.tokens[1, 0].item() == 5
    assert torch.all(out.tokens[0, 3:] == 3) and torch.all(out.tokens[1, 1:] == 3)


def test_the_network_reads_the_prompt_at_every_step(monkeypatch):
    model = _randomize(tadm_tiny()).eval()
    seen = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda z, *rest: seen.append(z.clone()) or encode(z, *rest))
    generate(model, "remdm-cap", batch_size=2, seq_len=12, num_steps=9, refresh_interval=4, prefix=PROMPTS,
             generator=torch.Generator().manual_seed(2))
    assert len(seen) == 9
    assert all(z[0, :5].tolist() == PROMPTS[0] and z[1, :2].tolist() == PROMPTS[1] for z in seen)
    assert (seen[0][0, 5:] == model.mask_token_id).all()  # and nothing else at the first step


@pytest.mark.parametrize("prefix, batch, match", [
    ([64], 1, r"prefix token id 64 is not a token of the model \(ids 0..64, the mask 64 excluded\)"),
    ([-1], 1, "prefix token id -1 is not a token"),
    ([[1], [2], [3]], 2, "prefix has 3 rows but batch_size is 2"),
    ("the cat", 1, "prefix must be token ids .* encode text with the model's tokenizer first"),
    ([1.5], 1, "prefix must hold integer token ids, got 1.5"),
    (torch.zeros(2, 2), 2, "prefix must hold integer token ids"),
    (list(range(12)), 1, "a prompt of 12 tokens leaves nothing to generate in seq_len=12"),
])
def test_a_bad_prefix_is_one_clear_error(prefix, batch, match):
    with pytest.raises(ValueError, match=match):
        generate(MODELS["tadm"], "mdlm", batch_size=batch, seq_len=12, num_steps=4, prefix=prefix)


def test_the_autoregressive_sampler_continues_after_bos_and_the_prompt():
    torch.manual_seed(0)
    model = _randomize(ar_tiny()).eval()
    out = generate_autoregressive(model, batch_size=2, seq_len=9, bos_id=0, prefix=[5, 6, 7],
                                  generator=torch.Generator().manual_seed(1))
    assert out.shape == (2, 9) and out[:, :4].tolist() == [[0, 5, 6, 7]] * 2
    with pytest.raises(ValueError, match="BOS and a prompt of 8 tokens leave nothing to generate in seq_len=9"):
        generate_autoregressive(model, batch_size=1, seq_len=9, bos_id=0, prefix=list(range(8)))
