"""CPU demonstration of TADM:Post-train on a tiny DiffusionGemma-class model (a few minutes on 2 cores).

1. Tokenizer and data: a byte-level BPE trained on the bundled Brown corpus, wrapped with a Gemma-style
   chat template; every paragraph becomes a chat example (prompt = its opening words, response = the
   continuation). Documents are split into training and held-out sets.
2. Pretraining: a random ``transformers`` ``DiffusionGemmaForBlockDiffusion`` (6 layers, d = 64, MoE,
   sliding and full attention, self-conditioning with probability 0.5) is trained briefly on
   (context, canvas) pairs through the model's own ``forward``: the canvas is corrupted with uniform
   noise at t ~ U(0, 1) and the loss is the cross-entropy of the clean canvas (default) or the
   uniform-state NELBO integrand ``usdm_loss`` (``--objective usdm``). The NELBO's weight
   -alpha'_t / (V alpha_t) puts almost all of the signal on the noisiest times, and within this budget
   it leaves the model a context-free unigram predictor (its predictions do not move along a
   sampling trajectory, so there is nothing for a fusion to correct); the flat cross-entropy quickly
   teaches it to read the canvas.
3. Post-training: the model is frozen and split 1 / 3 / 2 (shared / anchor / denoiser); only the
   paired-attention fusion is trained with on-policy rollouts (cache ages {0, 1, 2}) and the
   CE + KD objective.
4. Evaluation on held-out canvases: the base model's own entropy-bound sampler (K = 1) is run and the
   visited states are recorded. At every step that a sampler with refresh interval K would serve from a
   stale anchor (cache age a = (T - i) mod K > 0), the anchor is taken from the state a steps earlier,
   and the fused stale prediction D(Phi(C_i, C0, H0)) and the naive one D(H0) are compared with the
   fresh prediction D(A(C_i)): KL(fresh || stale) per token and greedy-token agreement.

    python scripts/posttrain_demo.py                 # writes runs/posttrain-demo/
    python scripts/posttrain_demo.py --quick         # a much shorter smoke run

The base model, tokenizer and chat JSONL it writes are what the shipped preset ``posttrain-tiny`` trains on.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from tadm.cli import OneLineErrorParser
from tadm.cli.common import int_at_least, positive_int
from tadm.posttrain.data import CHAT_SPECIAL_TOKENS

# the BPE's own vocabulary is --vocab-size less the chat tokens; it needs the 256 bytes, <|endoftext|> and <|mask|>
MIN_VOCAB_SIZE = 256 + 2 + len(CHAT_SPECIAL_TOKENS)
FULL = {"pretrain_steps": 600, "posttrain_steps": 500, "eval_canvases": 128}
QUICK = {"pretrain_steps": 30, "posttrain_steps": 10, "eval_canvases": 16}  # --quick, where not given


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineErrorParser(prog="posttrain_demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/posttrain-demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (1 is fastest for these sizes)")
    p.add_argument("--vocab-size", type=int_at_least(MIN_VOCAB_SIZE), default=1024,
                   help=f"tokenizer size, chat tokens included (at least {MIN_VOCAB_SIZE})")
    p.add_argument("--canvas-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="denoising steps T per canvas")
    p.add_argument("--pretrain-steps", type=positive_int, default=None, help="default: 600 (30 with --quick)")
    p.add_argument("--objective", choices=("ce", "usdm"), default="ce",
                   help="pretraining loss: x0 cross-entropy at t ~ U(0, 1), or the uniform-state NELBO (usdm_loss)")
    p.add_argument("--pretrain-batch", type=int, default=32)
    p.add_argument("--posttrain-steps", type=positive_int, default=None, help="default: 500 (10 with --quick)")
    p.add_argument("--posttrain-lr", type=float, default=2e-3)
    p.add_argument("--posttrain-batch", type=int, default=16)
    p.add_argument("--eval-canvases", type=positive_int, default=None, help="default: 128 (16 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny budgets, for a smoke test (the step and canvas counts not given explicitly)")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ------------------------------------------------------------------------------------------- data
def chat_examples(docs: list[str], rng: random.Random) -> list[dict[str, str]]:
    """Paragraphs of at least 30 words -> {"prompt": opening 8-16 words, "response": the rest}."""
    rows = []
    for doc in docs:
        for paragraph in re.split(r"\n\s*\n", doc):
            words = paragraph.split()
            if len(words) < 30:
                continue
            cut = rng.randint(8, 16)
            rows.append({"prompt": " ".join(words[:cut]), "response": " ".join(words[cut:])})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def batches(dataset, batch_size: int, pad_id: int, seed: int):
    from tadm.posttrain import canvas_batches

    return canvas_batches(dataset, batch_size, pad_id, seed=seed)


def first_last_loss(history: list[float], first: int = 20, last: int = 50) -> list[float]:
    """The mean loss over the first ``first`` and the last ``last`` steps (fewer when the run was shorter)."""
    head, tail = history[:first], history[-last:]
    return [sum(head) / max(1, len(head)), sum(tail) / max(1, len(tail))]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - wall:6.1f}s] {message}", flush=True)

    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain import (
        AnchoredBackbone,
        ChatCanvasDataset,
        ChatExample,
        DiffusionGemmaBackbone,
        FusionSpec,
        PosttrainTrainer,
        SplitSpec,
        load_posttrain_config,
        save_adapter,
    )
    from tadm.posttrain.backbone import tiny_diffusion_gemma_config
    from tadm.posttrain.base_training import pretrain_block_diffusion
    from tadm.posttrain.data import make_chat_tokenizer
    from tadm.posttrain.diagnostics import stale_fresh_divergence
    from tadm.sampling.entropy_bound import EntropyBoundSampler
    from tadm.training.data import load_texts
    from tadm.training.tokenization import train_bpe_tokenizer

    # 1. tokenizer and chat data ------------------------------------------------------------------
    docs = list(load_texts("brown"))
    held_out = set(range(0, len(docs), 20))  # every 20th document (25 of 500)
    train_docs = [d for n, d in enumerate(docs) if n not in held_out]
    eval_docs = [d for n, d in enumerate(docs) if n in held_out]
    bpe = train_bpe_tokenizer(train_docs, vocab_size=args.vocab_size - len(CHAT_SPECIAL_TOKENS))
    tokenizer = make_chat_tokenizer(bpe.backend)
    V = len(tokenizer)
    train_rows, eval_rows = chat_examples(train_docs, rng), chat_examples(eval_docs, rng)
    write_jsonl(out / "chat_train.jsonl", train_rows)
    write_jsonl(out / "chat_eval.jsonl", eval_rows)
    L = args.canvas_length
    make = lambda rows: ChatCanvasDataset(
        [ChatExample(r["prompt"], r["response"]) for r in rows], tokenizer, canvas_length=L,
        pad_id=tokenizer.pad_token_id, max_prompt_tokens=32, max_response_tokens=2 * L, canvases_per_example=2,
    )
    train_set, eval_set = make(train_rows), make(eval_rows)
    log(f"vocab {V}; {len(train_rows)} train / {len(eval_rows)} held-out chats -> "
        f"{len(train_set)} / {len(eval_set)} canvases of {L} tokens")

    # 2. pretrain a tiny DiffusionGemma ------------------------------------------------------------
    config = tiny_diffusion_gemma_config(
        vocab_size=V, hidden_size=64, num_layers=6, canvas_length=L, num_heads=2, head_dim=32, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(args.seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    log(f"DiffusionGemmaForBlockDiffusion: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"layers {config.text_config.layer_types}")
    history = pretrain_block_diffusion(model, batches(train_set, args.pretrain_batch, tokenizer.pad_token_id, args.seed),
                                       steps=args.pretrain_steps, seed=args.seed, objective=args.objective, log=log)
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    loss_first, loss_last = first_last_loss(history)
    log(f"pretrained: {args.objective} loss {loss_first:.3f} -> {loss_last:.3f}; "
        f"saved to {out / 'base'}")

    # 3. post-train the fusion -------------------------------------------------------------------
    split = AnchoredBackbone(DiffusionGemmaBackbone(model), SplitSpec(1, 3), FusionSpec(rank=32, num_heads=4))
    trainable = sum(p.numel() for p in split.fusion.parameters())
    cfg = load_posttrain_config(None, [
        f"rollout.sampler.num_steps={args.steps}", f"train.max_steps={args.posttrain_steps}", f"optim.lr={args.posttrain_lr}",
        "optim.warmup_steps=20", f"train.seed={args.seed}", "train.precision=fp32", "train.grad_accum_steps=1",
    ])
    trainer = PosttrainTrainer(split, cfg)
    data_iter = batches(train_set, args.posttrain_batch, tokenizer.pad_token_id, args.seed + 7)
    sampler = EntropyBoundSampler(V, num_steps=args.steps)

    def eval_batches():
        g = torch.Generator().manual_seed(1234)
        from tadm.posttrain import collate_canvases

        items = list(eval_set)[: args.eval_canvases]
        for b in range(0, len(items), 32):
            yield collate_canvases(items[b : b + 32], tokenizer.pad_token_id), g

    before = stale_fresh_divergence(split, eval_batches(), sampler)
    log(f"post-training {trainable:,} fusion parameters (split 1/3/2, rank 32, 4 heads), {args.posttrain_steps} steps")
    losses = []
    for step in range(args.posttrain_steps):
        metrics = trainer.train_step([next(data_iter)])
        losses.append(metrics["loss"])
        if (step + 1) % max(1, args.posttrain_steps // 6) == 0:
            recent = sum(losses[-25:]) / len(losses[-25:])
            log(f"  post-train step {step + 1}/{args.posttrain_steps}: loss {recent:.3f} (kd {metrics['kd']:.4f})")
    save_adapter(out / "adapter", split, base_model=str(out / "base"), extra={"step": trainer.step})

    # 4. evaluate ---------------------------------------------------------------------------------
    after = stale_fresh_divergence(split, eval_batches(), sampler)
    results = {
        "seed": args.seed,
        "steps_T": args.steps,
        "canvas_length": L,
        "eval_canvases": min(args.eval_canvases, len(eval_set)),
        "fusion_parameters": trainable,
        "pretrain_loss_first_last": first_last_loss(history),
        "posttrain_loss_first_last": [sum(losses[:10]) / max(1, len(losses[:10])), sum(losses[-25:]) / max(1, len(losses[-25:]))],
        "before_posttraining": {str(k): v for k, v in before.items()},
        "after_posttraining": {str(k): v for k, v in after.items()},
        "seconds": time.perf_counter() - wall,
    }
    (out / "demo_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(f"Held-out canvases: {results['eval_canvases']}, T = {args.steps}; stale steps only (cache age >= 1).")
    print(f"{'K':>2} {'KL naive':>10} {'KL fused':>10} {'agree naive':>12} {'agree fused':>12}")
    for K, r in after.items():
        print(f"{K:>2} {r['kl_naive']:>10.4f} {r['kl_fused']:>10.4f} {r['agreement_naive']:>12.3%} {r['agreement_fused']:>12.3%}")
    print(f"(before post-training the zero-initialised fusion equals naive reuse: "
          f"KL {before[2]['kl_fused']:.4f} vs {before[2]['kl_naive']:.4f} at K = 2)")
    print(f"total {results['seconds']:.0f}s; results in {out / 'demo_results.json'}")


if __name__ == "__main__":
    main()
