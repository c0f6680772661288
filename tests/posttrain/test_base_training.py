"""pretrain_block_diffusion: the base model's own forward on (context, canvas) pairs, against a direct computation."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from tadm.diffusion import get_schedule, sample_t, uniform_corrupt
from tadm.posttrain.base_training import pretrain_block_diffusion
from tadm.posttrain.data import CanvasBatch

from .conftest import build_tiny_gemma

V, L, B, P = 128, 8, 4, 3


@pytest.fixture(scope="module")
def base():
    return build_tiny_gemma(seed=1, sharpen=1.0)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    target_mask = torch.ones(B, L, dtype=torch.bool)
    target_mask[:, -2:] = False  # padding after the response: not in the loss
    return CanvasBatch(torch.randint(3, V, (B, P), generator=g), torch.ones(B, P, dtype=torch.bool),
                       torch.randint(3, V, (B, L), generator=g), target_mask)


def test_the_first_loss_is_the_masked_cross_entropy_of_the_noised_canvas(base):
    """Step 0 recomputed by hand: t ~ U(eps, 1) antithetic, Eq. (fwd) with pi = 1/V, self-conditioning rows, CE
    over the response tokens only."""
    model, batch, seed = copy.deepcopy(base), _batch(), 7
    reference = copy.deepcopy(base).train()
    history = pretrain_block_diffusion(model, itertools.repeat(batch), steps=1, seed=seed)

    g = torch.Generator().manual_seed(seed + 1)
    t = sample_t(B, eps=1e-3, generator=g)
    z_t = uniform_corrupt(batch.targets, get_schedule("loglinear").alpha(t.double()).float(), V, g)
    inputs = dict(input_ids=batch.context_ids, attention_mask=batch.context_mask, decoder_input_ids=z_t,
                  decoder_attention_mask=F.pad(batch.context_mask, (0, L), value=True))
    rows = torch.rand(B, generator=g) < 0.5
    with torch.no_grad():
        sc = reference(**inputs).logits if bool(rows.any()) else None
        logits = reference(**inputs, self_conditioning_logits=sc,
                           self_conditioning_mask=rows if sc is not None else None).logits
    ce = F.cross_entropy(logits.float().transpose(1, 2), batch.targets, reduction="none")
    expected = float(ce[batch.target_mask].mean())
    assert history == [pytest.approx(expected, rel=1e-5)]
    assert not model.training


def test_training_lowers_the_loss_and_is_reproducible(base):
    batch = _batch(seed=2)
    runs = [pretrain_block_diffusion(copy.deepcopy(base), itertools.repeat(batch), steps=24, seed=s) for s in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(runs[0]) == 24
    assert sum(runs[0][-4:]) / 4 < sum(runs[0][:4]) / 4


def test_the_usdm_objective_runs_and_bad_arguments_are_refused(base):
    history = pretrain_block_diffusion(copy.deepcopy(base), itertools.repeat(_batch()), steps=2, seed=0,
                                       objective="usdm")
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(history)))
    with pytest.raises(ValueError, match="objective 'mse' is unknown; valid: ce, usdm"):
        pretrain_block_diffusion(base, itertools.repeat(_batch()), steps=1, seed=0, objective="mse")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        pretrain_block_diffusion(base, itertools.repeat(_batch()), steps=0, seed=0)
