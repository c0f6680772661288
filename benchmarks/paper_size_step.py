"""One optimisation step of the paper's 224M TADM pretraining config at L = 1024, on whatever device is here.

    python benchmarks/paper_size_step.py                    # CPU: the tadm-owt-small preset, micro-batch 1
    python benchmarks/paper_size_step.py --device cuda --batch-size 16

A rehearsal of the paper-size path without a GPU: the model, objective (T-ANELBO with stale anchors,
K drawn from the preset's refresh intervals) and AdamW settings of ``tadm-owt-small`` are built
exactly as ``tadm train tadm-owt-small`` builds them, with the GPT-2 vocabulary size (50,257 + the
mask), on random token blocks (no tokenizer or data download). Prints the parameter count, the
seconds of forward + backward + AdamW update (after one warm-up step), the loss, and the memory the
step added (peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import time

import torch

from tadm.cli import OneLineErrorParser
from tadm.cli.common import positive_int
from tadm.config import list_presets, load_config
from tadm.devices import resolve_device
from tadm.nn import build_model
from tadm.training.objectives import get_objective
from tadm.training.trainer import objective_config

GPT2_VOCAB_WITH_MASK = 50_258


def _rss(field: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tadm-owt-small", choices=list_presets())
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=positive_int, default=1, help="micro-batch (the preset's is 16 per GPU)")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        p.error(str(err))
    cfg = load_config(args.preset)
    torch.manual_seed(0)
    # only TADM has the training-only anchor LM head (used when gamma > 0)
    extra = {"anchor_lm_head": cfg.objective.gamma > 0} if cfg.model.arch == "tadm" else {}
    model = build_model(f"{cfg.model.arch}-{cfg.model.preset}", vocab_size=GPT2_VOCAB_WITH_MASK,
                        max_seq_len=cfg.data.seq_len, **extra).to(device).train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay)
    objective, ocfg = get_objective(cfg.model.arch), objective_config(cfg)
    L, B = cfg.data.seq_len, args.batch_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, GPT2_VOCAB_WITH_MASK - 1, (B, L), generator=g).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> float:
        with autocast:
            loss = objective(model, x, torch.Generator().manual_seed(1), ocfg).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().item()

    params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {cfg.model.arch}-{cfg.model.preset}, {params:,} parameters, L = {L}, micro-batch {B}, "
          f"{device}, {torch.get_num_threads()} threads")
    step()  # warm-up: AdamW state
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as handle:  # reset the peak RSS (VmHWM) to the current size
            handle.write("5")
        base = _rss("VmRSS:")
    start = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    added = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss("VmHWM:")) - base
    print(f"one optimisation step: {seconds:.1f} s ({B * L / seconds:,.0f} training tokens/s), loss {loss:.3f}, "
          f"memory added by the step {added / 1e9:.2f} GB (weights and AdamW state were already resident)")


if __name__ == "__main__":
    main()
