"""Fixtures for the task-evaluation tests: a tiny DiffusionGemma-class base with a chat tokenizer and
an adapter, and a tiny tadm model with its tokenizer, all saved to disk as a user would have them."""

from __future__ import annotations

import pytest

from tests.posttrain.conftest import _one_thread, build_tiny_gemma, randomize, tiny_chat_tokenizer

__all__ = ["_one_thread"]  # the autouse one-thread fixture of the post-training tests applies here too


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A saved tiny base (vocabulary = the chat tokenizer's, canvas 8) with its tokenizer."""
    tokenizer = tiny_chat_tokenizer()
    base = tmp_path_factory.mktemp("tasks-base")
    build_tiny_gemma(vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


@pytest.fixture(scope="session")
def adapter_dir(base_dir, tmp_path_factory):
    """A fusion adapter (split 1/3/2, random weights far from the identity) for ``base_dir``."""
    from tadm.posttrain import AnchoredBackbone, FusionSpec, SplitSpec, load_backbone, save_adapter

    backbone = load_backbone("diffusion-gemma", base_dir)
    model = AnchoredBackbone(backbone, SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2))
    randomize(model.fusion, seed=3, std=0.05)
    return save_adapter(tmp_path_factory.mktemp("tasks-adapter"), model, base_model=str(base_dir))


@pytest.fixture(scope="session")
def tadm_model_dir(tmp_path_factory):
    """A saved tiny TADM (random weights, max_seq_len 64) with a byte-level BPE tokenizer beside it."""
    from tests.eval.test_evaluator import tiny_diffusion, tiny_tokenizer

    out = tmp_path_factory.mktemp("tasks-tadm")
    tiny_diffusion("tadm", seed=1, max_seq_len=64).save_pretrained(out)
    tiny_tokenizer().save(out)
    return out
