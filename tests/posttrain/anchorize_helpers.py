"""Shared by the anchorize tests: the families' own generation paths on the stand-ins, and a tiny MDLM."""

from __future__ import annotations

import json

import torch

from tadm.nn.baselines import MDLM, MDLMConfig
from tadm.posttrain import generate_sequence
from tadm.sampling import build_sampler
from tadm.sampling.llada import LLaDASampler
from tests.standins.dream import FIXTURE as DREAM_FIXTURE
from tests.standins.llada import FIXTURE as LLADA_FIXTURE

LLADA = json.loads((LLADA_FIXTURE / "generate.json").read_text())
DREAM = json.loads((DREAM_FIXTURE / "generate.json").read_text())


def llada_generate(model: torch.nn.Module, case: dict) -> torch.Tensor:
    """What LLaDA's ``generate`` does, written out: the prompt then masks, one ``model(x, attention_mask=...)``
    call per step, the canvas updated in place (its step rule is tadm's LLaDA sampler, equal to the reference's)."""
    prompt = torch.tensor(LLADA["prompt"])
    B, G = prompt.shape[0], case["gen_length"]
    x = torch.cat([prompt, torch.full((B, G), LLADA["mask_id"])], dim=1)  # (B, P + G)
    mask = None
    if case["attention_mask"]:
        mask = torch.cat([torch.tensor(LLADA["prompt_attention_mask"]), torch.ones(B, G, dtype=torch.long)], dim=1)
    sampler = LLaDASampler(LLADA["mask_id"], case["block_length"], case["remasking"], case["temperature"])
    sampler.set_timesteps(case["steps"])
    generator = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for i in range(case["steps"], 0, -1):
            logits = model(x, attention_mask=mask).logits
            x[:] = sampler.step(logits, i, x, generator).prev_sample
    return x


def llada_stage_by_stage(view, case: dict, K: int):
    """tadm's own loop over the stage view (AnchoredBackbone over LLaDABackbone) at refresh interval K."""
    sampler = build_sampler("llada", view, block_length=case["block_length"], remasking=case["remasking"],
                            temperature=case["temperature"])
    mask = torch.tensor(LLADA["prompt_attention_mask"]) if case["attention_mask"] else None
    return generate_sequence(view, sampler, torch.tensor(LLADA["prompt"]), gen_length=case["gen_length"],
                             num_steps=case["steps"], attention_mask=mask, refresh_interval=K,
                             generator=torch.Generator().manual_seed(case["seed"]))


def dream_generate(model: torch.nn.Module, case: dict) -> torch.Tensor:
    """The model's own ``diffusion_generate`` after ``torch.manual_seed``, as the reference fixtures were made."""
    torch.manual_seed(case["seed"])
    mask = torch.tensor(DREAM["prompt_attention_mask"]) if case["attention_mask"] else None
    return model.diffusion_generate(torch.tensor(DREAM["prompt"]), attention_mask=mask,
                                    max_new_tokens=case["max_new_tokens"], steps=case["steps"], alg=case["alg"],
                                    temperature=case["temperature"], top_p=case["top_p"], top_k=case["top_k"],
                                    alg_temp=case["alg_temp"], eps=case["eps"])


def dream_stage_by_stage(view, case: dict, K: int):
    sampler = build_sampler("dream-" + case["alg"].replace("_", "-"), view, temperature=case["temperature"],
                            top_p=case["top_p"], top_k=case["top_k"], alg_temp=case["alg_temp"], eps=case["eps"])
    mask = torch.tensor(DREAM["prompt_attention_mask"]) if case["attention_mask"] else None
    return generate_sequence(view, sampler, torch.tensor(DREAM["prompt"]), gen_length=case["max_new_tokens"],
                             num_steps=case["steps"], attention_mask=mask, refresh_interval=K,
                             generator=torch.Generator().manual_seed(case["seed"]))


def tiny_mdlm(seed: int = 0, vocab_size: int = 61) -> MDLM:
    """A 4-layer tadm MDLM with random weights everywhere (the zero-initialised gates and head included) and
    sharpened attention, so that its predictions depend on the context (and a stale anchor shows)."""
    torch.manual_seed(seed)
    model = MDLM(MDLMConfig(vocab_size=vocab_size, hidden_size=32, num_heads=2, cond_dim=16, num_layers=4,
                            max_seq_len=32, dropout=0.0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
        for block in model.blocks.blocks:
            block.qkv.weight.mul_(4.0)
    return model.eval()


def mdlm_generate(model: torch.nn.Module, sampler, *, batch_size: int, seq_len: int, num_steps: int, seed: int):
    """A user's loop over tadm's MDLM sampler calling the model's own ``forward(z_t)`` once per step."""
    sampler.set_timesteps(num_steps)
    generator = torch.Generator().manual_seed(seed)
    z = sampler.initial_canvas(batch_size, seq_len, generator, torch.device("cpu"))
    with torch.no_grad():
        for i in range(num_steps, 0, -1):
            log_probs = model(z)
            z = sampler.step(log_probs, i, z, generator).prev_sample
    return sampler.finish(z, log_probs) if sampler.unfinished(z) else z
