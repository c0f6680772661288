"""Left-to-right sampling of the autoregressive baseline."""

import pytest
import torch

from tadm.sampling.autoregressive import generate_autoregressive

V = 7


def _successor_logits(tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, l, V) that put all mass on (token + 1) mod V after every position."""
    return torch.nn.functional.one_hot((tokens + 1) % V, V).float() * 50.0


def test_each_token_is_drawn_from_the_logits_of_the_prefix():
    out = generate_autoregressive(_successor_logits, batch_size=2, seq_len=9, bos_id=3)
    assert out.tolist() == [[(3 + i) % V for i in range(9)]] * 2


def test_nucleus_keeps_only_the_top_token_and_draws_are_reproducible():
    def two_way(tokens: torch.Tensor) -> torch.Tensor:  # 0.7 on token 1, 0.3 on token 2 after every prefix
        probs = torch.zeros(*tokens.shape, V)
        probs[..., 1], probs[..., 2] = 0.7, 0.3
        return probs.log()

    greedy = generate_autoregressive(two_way, batch_size=4, seq_len=6, bos_id=0, top_p=0.5)
    assert greedy[:, 1:].eq(1).all()
    draws = [generate_autoregressive(two_way, batch_size=64, seq_len=6, bos_id=0,
                                     generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert set(draws[0][:, 1:].unique().tolist()) == {1, 2}


def test_a_sequence_shorter_than_one_token_is_refused():
    with pytest.raises(ValueError, match="sequence length must be >= 1"):
        generate_autoregressive(_successor_logits, batch_size=1, seq_len=0, bos_id=0)
