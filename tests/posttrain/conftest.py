"""Fixtures for the post-training tests: tiny DiffusionGemma models and a tiny chat tokenizer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors are fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_tiny_gemma(seed: int = 0, sharpen: float = 30.0, **config):
    """A random DiffusionGemmaForBlockDiffusion (6 layers: 5 sliding + 1 full, MoE, vocab 128, canvas 8).

    The token embedding (tied with the LM head) is scaled by ``sharpen`` so that predictions are
    peaked and the entropy-bound sampler accepts several tokens per step.
    """
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain.backbone import tiny_diffusion_gemma_config

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_diffusion_gemma_config(**config)).eval()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="module")
def gemma():
    return build_tiny_gemma()


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Overwrite every parameter with N(0, std^2) draws (a fusion that is far from its zero init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def tiny_chat_tokenizer():
    """A word-level tokenizer over a few words, with the Gemma-style chat template and its special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tadm.posttrain.data import make_chat_tokenizer

    words = "[UNK] the cat sat on a mat dog ran far away hello how are you fine thanks what is it user model".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return make_chat_tokenizer(backend)
