"""Block-wise generation with the anchor cache, against transformers' DiffusionGemmaForBlockDiffusion.generate."""

import math

import pytest
import torch

from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec, generate_blocks
from tadm.sampling.entropy_bound import EntropyBoundSampler, StableConfidentStopping

from .conftest import randomize

V, L = 128, 8


def _model(gemma, mode="paired"):
    return AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2), mode)


def _prompt(seed=0, B=2, P=5):
    return torch.randint(3, V, (B, P), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("stopping", [None, (1, 0.005), (0, 1.0)])
def test_k1_is_token_identical_to_transformers_generate(gemma, stopping):
    """K = 1 (fresh anchor every step) reproduces ``generate`` token for token, over several canvases.

    Same seed, same settings: the sampler draws from the global generator in the released order
    (initial canvas, then per step one multinomial draw and one re-noising canvas, also at the last
    step), the decoder logits are bit-identical, and EOS/padding and adaptive stopping follow the
    same rules. Nothing differs; with ``categorical="gumbel"`` the draws (not their distribution)
    would differ. ``stopping`` = (stability, confidence) thresholds; (0, 1.0) stops rows at
    different steps.
    """
    prompt = _prompt()
    hf_kwargs = dict(stability_threshold=None, confidence_threshold=None)
    if stopping is not None:
        hf_kwargs = dict(stability_threshold=stopping[0], confidence_threshold=stopping[1])
    torch.manual_seed(7)
    reference = gemma.generate(prompt, max_new_tokens=20, max_denoising_steps=6, **hf_kwargs)
    model = _model(gemma)
    randomize(model.fusion, seed=1)  # a trained fusion is still the identity at K = 1
    run = lambda generator: generate_blocks(
        model,
        prompt,
        sampler=EntropyBoundSampler(V, num_steps=6),
        max_new_tokens=20,
        stopping=None if stopping is None else StableConfidentStopping(*stopping),
        generator=generator,
    )
    torch.manual_seed(7)
    out = run(None)
    assert out.sequences.shape == (2, 5 + 3 * L)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(3 * L / out.decoder_forward_passes.double(), reference.tokens_per_forward.double())
    if stopping == (0, 1.0):  # rows really stopped early, and at different steps
        assert out.decoder_forward_passes.max() < 18 and len(set(out.decoder_forward_passes.tolist())) == 2
    # An explicit generator seeded alike consumes the same stream.
    assert torch.equal(run(torch.Generator().manual_seed(7)).sequences, reference.sequences)


@pytest.mark.slow
def test_k1_matches_generate_with_padding_and_eos(gemma):
    prompt = _prompt(seed=3, P=6)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    mask[0, :2] = False
    eos = int(prompt[1, 0])  # some id the model emits; rows may finish early
    model = _model(gemma)  # built before seeding: the fusion's initialisation draws from the global generator
    torch.manual_seed(2)
    reference = gemma.generate(
        prompt, attention_mask=mask, max_new_tokens=24, max_denoising_steps=5, eos_token_id=[eos, 5],
        pad_token_id=0, stability_threshold=None, confidence_threshold=None,
    ).sequences
    torch.manual_seed(2)
    out = generate_blocks(
        model, prompt, attention_mask=mask, sampler=EntropyBoundSampler(V, num_steps=5), max_new_tokens=24,
        eos_token_id=[eos, 5], pad_token_id=0,
    )
    assert torch.equal(out.sequences, reference)
    assert (out.new_tokens == 0).any()  # some row did end with EOS and was padded


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_layer_calls_follow_algorithm_1_per_canvas(gemma, K):
    T, blocks = 7, 2
    model = _model(gemma)
    out = generate_blocks(model, _prompt(), sampler=EntropyBoundSampler(V, num_steps=T), refresh_interval=K,
                          max_new_tokens=blocks * L, generator=torch.Generator().manual_seed(0))
    calls = out.layer_calls
    assert (calls.shared, calls.denoiser) == (1 * T * blocks, 2 * T * blocks)
    assert calls.anchor_refreshes == blocks * math.ceil(T / K)
    assert calls.anchor == 3 * blocks * math.ceil(T / K)
    assert out.refresh_steps == [[i for i in range(T, 0, -1) if (T - i) % K == 0]] * blocks
    assert out.encoder_layer_calls == 6 * blocks  # the prompt, then the first canvas
    assert out.new_tokens.shape == (2, blocks * L)


def test_zero_init_fusion_equals_naive_reuse_and_a_trained_one_does_not(gemma):
    sampler = EntropyBoundSampler(V, num_steps=6)
    run = lambda model: generate_blocks(model, _prompt(), sampler=sampler, refresh_interval=3, max_new_tokens=L,
                                        generator=torch.Generator().manual_seed(4)).sequences
    paired, naive = _model(gemma), _model(gemma, mode="naive")
    assert torch.equal(run(paired), run(naive))
    randomize(paired.fusion, seed=2, std=0.5)
    randomize(naive.fusion, seed=2, std=0.5)  # ignored in naive mode
    assert torch.equal(run(naive), run(_model(gemma, mode="naive")))
    assert not torch.equal(run(paired), run(naive))


def test_same_seed_same_tokens_and_errors(gemma):
    model = _model(gemma)
    sampler = EntropyBoundSampler(V, num_steps=4)
    run = lambda seed: generate_blocks(model, _prompt(), sampler=sampler, refresh_interval=2, max_new_tokens=L,
                                       generator=torch.Generator().manual_seed(seed)).sequences
    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    with pytest.raises(ValueError, match="K must be an integer >= 1"):
        generate_blocks(model, _prompt(), sampler=sampler, refresh_interval=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_blocks(model, _prompt(), sampler=sampler, max_new_tokens=0)


def test_a_stop_check_ends_rows_after_their_canvas(gemma):
    """Rows the check declares done get padding afterwards; when all are done no further canvas runs."""
    model, T = _model(gemma), 4
    seen = []

    def run(stop):
        return generate_blocks(model, _prompt(), sampler=EntropyBoundSampler(V, num_steps=T), refresh_interval=2,
                               max_new_tokens=3 * L, pad_token_id=0, generator=torch.Generator().manual_seed(3),
                               stop=stop)

    full = run(None)
    row0 = run(lambda new: (seen.append(new.shape[1]), torch.tensor([True, False]))[1])
    assert seen == [L, 2 * L]  # asked after each canvas but the last, with the tokens so far
    assert torch.equal(row0.new_tokens[0, :L], full.new_tokens[0, :L]) and (row0.new_tokens[0, L:] == 0).all()
    assert torch.equal(row0.new_tokens[1], full.new_tokens[1])  # the other row is untouched
    both = run(lambda new: torch.ones(new.shape[0], dtype=torch.bool))
    assert torch.equal(both.new_tokens, full.new_tokens[:, :L])  # one canvas only
    assert both.layer_calls.total * 3 == full.layer_calls.total
