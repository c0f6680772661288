"""x_theta on the decoded rows only: same rows as the full output, same tokens as the full path.

The loop draws a masked sampler's moves before the network runs and computes the output head and
log-softmax only where a token is decoded (SUBS carries every other position over). These tests
hold that fast path to the reference (``full_output=True``) bit for bit, and check it is really
taken (the head sees n < B x L rows) and refused where it would be wrong.
"""

from __future__ import annotations

import pytest
import torch

from tadm.nn import NaiveReuse, adlm_tiny, mdlm_tiny, tadm_tiny
from tadm.nn.dit import subs_log_probs
from tadm.sampling import AdaptiveRefresh, FixedRefresh, generate, get_sampler
from tadm.sampling.entropy_bound import EntropyBoundSampler
from tadm.sampling.loop import check_contract

from tests.posttrain.conftest import _one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)
from tests.sampling.test_loop_golden import _randomize


NETS = {"tadm": tadm_tiny, "mdlm": mdlm_tiny, "adlm": adlm_tiny}


@pytest.mark.parametrize("net", ["tadm", "mdlm", "adlm", "naive"])
def test_predict_on_rows_equals_the_full_output_rows(net):
    model = _randomize(tadm_tiny() if net == "naive" else NETS[net]()).eval()
    model = NaiveReuse(model) if net == "naive" else model
    g = torch.Generator().manual_seed(0)
    z = torch.randint(0, model.vocab_size - 1, (3, 12), generator=g)
    z[torch.rand(z.shape, generator=g) < 0.6] = model.mask_token_id
    rows = (z == model.mask_token_id).nonzero()[::2]  # some masked positions, across rows
    c = model.encode(z)
    anchor = model.compute_anchor(c)
    with torch.no_grad():
        full = model.predict(z, c, anchor)
        part = model.predict(z, c, anchor, rows=rows)
    assert part.shape == (len(rows), model.vocab_size)
    assert torch.equal(part, full[rows[:, 0], rows[:, 1]])


def test_rows_output_is_subs_at_masked_positions_by_hand():
    """masked_log_probs = log_softmax with the mask logit removed; SUBS adds carry-over elsewhere."""
    logits = torch.tensor([[[0.0, 1.0, 2.0, 9.0], [3.0, 0.0, 0.0, 5.0]]])
    z = torch.tensor([[3, 1]])  # mask id 3 at position 0, token 1 at position 1
    lp = subs_log_probs(logits, z, 3)
    expected = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    assert torch.allclose(lp[0, 0, :3], expected) and lp[0, 0, 3] < -1e5
    assert lp[0, 1, 1] == 0.0 and (lp[0, 1, [0, 2, 3]] < -1e5).all()


CASES = [(net, sampler, K, opts)
         for net in ("tadm", "mdlm", "adlm")
         for sampler, opts in [("mdlm", {}), ("mdlm", {"top_p": 0.8}), ("remdm-cap", {}), ("remdm-rescale", {}),
                               ("remdm-conf", {}), ("remdm-loop", {}), ("remdm-loop", {"top_p": 0.9}),
                               ("remdm-cap", {"top_p": 0.9, "nucleus": "standard"})]
         for K in (1, 2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("net,sampler,K,opts", CASES)
def test_rows_only_path_samples_the_reference_tokens(net, sampler, K, opts):
    model = _randomize(NETS[net]()).eval()
    tokens = []
    for full in (True, False):
        s = get_sampler(sampler, model.mask_token_id, **opts)
        out = generate(model, s, batch_size=2, seq_len=16, num_steps=12, refresh_interval=K,
                       generator=torch.Generator().manual_seed(7), full_output=full)
        tokens.append(out.tokens)
    assert torch.equal(tokens[0], tokens[1])


def test_the_head_sees_only_decoded_rows_except_at_the_last_step():
    model = _randomize(tadm_tiny()).eval()
    seen = []
    model.head.register_forward_hook(lambda m, args, out: seen.append(out.shape[:-1]))
    generate(model, get_sampler("mdlm", model.mask_token_id), batch_size=2, seq_len=16, num_steps=16,
             generator=torch.Generator().manual_seed(0))
    assert len(seen) == 16
    assert all(len(shape) == 1 for shape in seen[:-1])  # (n,) rows before the last step
    assert 0 < sum(shape[0] for shape in seen[:-1]) <= 2 * 16  # MDLM decodes each position once in all
    assert tuple(seen[-1]) == (2, 16)  # the last step's full output (argmax of any mask left)


def test_the_full_path_is_kept_where_rows_only_cannot_run():
    model = _randomize(tadm_tiny()).eval()
    masked = get_sampler("remdm-cap", model.mask_token_id)

    def rows_only(network, sampler, policy, **kw):
        return check_contract(network, sampler, policy, **kw).rows_only

    assert rows_only(model, masked, FixedRefresh(2))
    assert rows_only(model, masked, AdaptiveRefresh(tau=0.2))
    # a step that reuses the previous prediction reuses its hidden states
    assert rows_only(model, masked, FixedRefresh(2, skip_unchanged=True))
    assert not rows_only(model, masked, FixedRefresh(2), full_output=True)  # the reference path, asked for
    # a sampler that consumes raw logits needs predict_logits, which a TADM does not have: refused once, clearly
    with pytest.raises(TypeError, match="TADM lacks predict_logits"):
        check_contract(model, EntropyBoundSampler(vocab_size=model.vocab_size), FixedRefresh(1))
    no_rows = _randomize(tadm_tiny()).eval()
    no_rows.predicts_rows = False  # a network that cannot stop before its output layer
    assert not rows_only(no_rows, masked, FixedRefresh(1))


def test_a_sampler_for_another_mask_id_is_refused():
    model = tadm_tiny().eval()
    wrong = get_sampler("mdlm", model.mask_token_id - 1)
    with pytest.raises(ValueError, match=f"mask id {model.mask_token_id - 1} differs from the model's "
                                         f"mask_token_id {model.mask_token_id}"):
        generate(model, wrong, batch_size=1, seq_len=8, num_steps=4)


@pytest.mark.parametrize("net", ["tadm", "mdlm"])
@pytest.mark.parametrize("K", [1, 2])
def test_skipping_unchanged_canvases_on_decoded_rows_samples_the_reference_tokens(net, K):
    """T > L: many steps decode nothing; they reuse the last hidden states and run the head on their rows."""
    model = _randomize(NETS[net]()).eval()
    outs = []
    for full in (True, False):
        out = generate(model, get_sampler("mdlm", model.mask_token_id), batch_size=2, seq_len=8, num_steps=32,
                       refresh_interval=K, skip_unchanged=True, generator=torch.Generator().manual_seed(3),
                       full_output=full)
        outs.append(out)
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert outs[0].layer_calls.as_dict() == outs[1].layer_calls.as_dict()
    assert outs[1].layer_calls.skipped_steps > 0
