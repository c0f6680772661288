import torch
from torch import Tensor

from tadm.protocol import LayerSplit


class OracleDenoiser:
    """A protocol-conforming stand-in whose prediction is a fixed clean sequence.

    ``encode`` returns a float view of the canvas so ``predict`` can depend on the anchor; calls
    are recorded so tests can check exactly which stages ran at which step.
    """

    def __init__(self, target: Tensor, vocab_size: int, split: LayerSplit = LayerSplit(1, 12, 6), sharpness=None):
        self.target = target  # (B, L)
        self.vocab_size = vocab_size
        self.mask_token_id = vocab_size - 1
        self.layer_split = split
        self.sharpness = sharpness
        self.calls: list[str] = []

    time_conditioned = False
    predicts_rows = False

    def prepare(self, z_t, context=None, t=None):
        return t

    def encode(self, z_t, t=None):
        self.calls.append("encode")
        return z_t.float().unsqueeze(-1)  # (B, L, 1)

    def compute_anchor(self, c, t=None):
        self.calls.append("anchor")
        return c.clone()

    def predict(self, z_t, c_t, anchor, t=None):
        self.calls.append("predict")
        V = self.vocab_size
        if self.sharpness is None:
            probs = torch.nn.functional.one_hot(self.target, V).double()
        else:  # a soft prediction peaked on the target
            logits = self.sharpness * torch.nn.functional.one_hot(self.target, V).double()
            logits[..., -1] = -float("inf")
            probs = torch.softmax(logits, -1)
        probs[..., self.mask_token_id] = 0
        unmasked = z_t != self.mask_token_id
        probs = torch.where(unmasked.unsqueeze(-1), torch.nn.functional.one_hot(z_t, V).double(), probs)
        return probs.clamp_min(1e-30).log().float()
