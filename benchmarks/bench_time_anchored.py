"""The anchor cache inside the model against transformers' own DiffusionGemma, side by side in one run (CPU).

A 30-layer random ``DiffusionGemmaForBlockDiffusion`` (split 2 / 20 / 8, as the paper splits the 26B model) and
its time-anchored copy (same weights, a random rank-32 fusion) generate the same prompt with transformers' own
``generate``, batch 1, every step run (no adaptive stopping). The three methods are timed in turns (the order
rotates every repeat) and the medians compared:

* ``tadm K=1`` / base: the cost of the cache machinery when every pass refreshes (goal: at most 1.03);
* base / ``tadm K=3``: the speed-up, against the analytic ratio of Transformer-layer calls (encoder included)
  (goal: at least 0.9 of it).

The ratios of medians are printed, and the ratios within each repeat (whose three runs are adjacent in time):
their geometric mean and its 95 % interval over repeats. A goal counts as met only when the whole interval meets
it.

At K = 1 the tokens must equal the base's; the script checks it. Run it with nothing else on the machine::

    python benchmarks/bench_time_anchored.py                 # about 10 minutes on two cores
    python benchmarks/bench_time_anchored.py --repeats 3 --steps 12 --hidden 64   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import scipy.stats
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from tadm.posttrain import FusionSpec
from tadm.posttrain.backbone import tiny_diffusion_gemma_config
from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma
from tadm.records import git_commit

SPLIT = (2, 20)  # shared, anchor; 8 denoiser layers of 30


def build(hidden: int, canvas: int, seed: int = 0) -> tuple[DiffusionGemmaForBlockDiffusion, TimeAnchoredDiffusionGemma]:
    config = tiny_diffusion_gemma_config(vocab_size=1024, hidden_size=hidden, num_layers=30, canvas_length=canvas,
                                         num_heads=4, head_dim=hidden // 4, sliding_window=64, num_experts=8,
                                         top_k_experts=2)
    torch.manual_seed(seed)
    base = DiffusionGemmaForBlockDiffusion(config).eval()
    anchored = TimeAnchoredDiffusionGemma.from_pretrained(copy.deepcopy(base), split=SPLIT,
                                                          fusion=FusionSpec(rank=max(8, hidden // 8), num_heads=4))
    with torch.no_grad():  # a fusion far from its identity initialisation costs what a trained one does
        generator = torch.Generator().manual_seed(1)
        for p in anchored.fusion.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return base, anchored


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-repeat ratios and its 95 % Student-t interval (on the log scale)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = scipy.stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def compiled_check() -> int:
    """transformers compiles its denoising step when given a static cache; at K = 1 tadm's model must compile and
    give the base's tokens (at K > 1 it refuses the compiled step in one line)."""
    config = tiny_diffusion_gemma_config(num_layers=6, canvas_length=8)
    torch.manual_seed(0)
    base = DiffusionGemmaForBlockDiffusion(config).eval()
    anchored = TimeAnchoredDiffusionGemma.from_pretrained(copy.deepcopy(base), split=(1, 3),
                                                          fusion=FusionSpec(rank=8, num_heads=2))
    prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=16, max_denoising_steps=6, stability_threshold=None, confidence_threshold=None,
                    eos_token_id=None, cache_implementation="static")
    out, seconds = {}, {}
    for name, model in (("base", base), ("tadm K=1", anchored)):
        torch.manual_seed(3)
        start = time.perf_counter()
        out[name] = model.generate(prompt, **settings).sequences
        seconds[name] = time.perf_counter() - start
    same = torch.equal(out["base"], out["tadm K=1"])
    print(f"compiled step (static cache), 6-layer model, K = 1: tokens equal the base's: {same}; first call (with the "
          f"compilation) {seconds['base']:.0f} s (base), {seconds['tadm K=1']:.0f} s (tadm)")
    return 0 if same else 1


def layer_calls(num_layers: int, steps: int, canvases: int, K: int) -> tuple[int, int]:
    """(decoder, encoder) Transformer-layer calls of a generation: Algorithm 1 per canvas, the encoder once per canvas."""
    shared, anchor = SPLIT
    denoiser = num_layers - shared - anchor
    per_canvas = steps * (shared + denoiser) + -(-steps // K) * anchor
    return canvases * per_canvas, canvases * num_layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=48, help="denoising steps per canvas (paper: 48)")
    p.add_argument("--canvases", type=int, default=1)
    p.add_argument("--canvas", type=int, default=64, help="canvas length")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    p.add_argument("--compiled-check", action="store_true",
                   help="instead: compare the compiled denoising step (a static cache) of the base and of tadm at K = 1 "
                        "on a 6-layer model (minutes on a CPU: torch.compile)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.compiled_check:
        return compiled_check()
    base, anchored = build(args.hidden, args.canvas)
    prompt = torch.randint(3, 1024, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=args.canvases * args.canvas, max_denoising_steps=args.steps,
                    stability_threshold=None, confidence_threshold=None, eos_token_id=None)
    runs = {"base": lambda: base.generate(prompt, **settings),
            "tadm K=1": lambda: anchored.generate(prompt, refresh_interval=1, **settings),
            "tadm K=3": lambda: anchored.generate(prompt, refresh_interval=3, **settings)}
    tokens, calls = {}, {}
    with torch.no_grad():
        for name, run in runs.items():  # warm-up, tokens and layer calls
            torch.manual_seed(11)
            tokens[name] = run().sequences
            if name != "base":
                record = anchored.last_generation
                calls[name] = (record.layer_calls.total, record.encoder_layer_calls)
        times = {name: [] for name in runs}
        order = list(runs)
        for r in range(args.repeats):
            for name in order[r % 3:] + order[:r % 3]:
                torch.manual_seed(11 + r)
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    base_calls = layer_calls(30, args.steps, args.canvases, 1)
    k3_calls = layer_calls(30, args.steps, args.canvases, 3)
    assert calls["tadm K=3"] == k3_calls and calls["tadm K=1"] == base_calls, (calls, base_calls, k3_calls)
    analytic = sum(base_calls) / sum(k3_calls)
    decoder_only = base_calls[0] / k3_calls[0]
    overhead = median["tadm K=1"] / median["base"]
    speedup = median["base"] / median["tadm K=3"]
    same = torch.equal(tokens["tadm K=1"], tokens["base"])
    print(f"30-layer random DiffusionGemma (hidden {args.hidden}, MoE 8x top-2, vocab 1024), split 2 / 20 / 8, batch 1, "
          f"prompt {args.prompt}, {args.canvases} canvas(es) of {args.canvas}, {args.steps} steps; "
          f"median of {args.repeats} interleaved runs, one thread")
    print("| method | median s | all runs (s) | layer calls (decoder + encoder) |")
    print("|---|---|---|---|")
    for name in runs:
        counted = sum(base_calls) if name == "base" else sum(calls[name])
        print(f"| {name} | {median[name]:.3f} | {', '.join(f'{t:.3f}' for t in times[name])} | {counted} |")
    paired_k1 = [a / b for a, b in zip(times["tadm K=1"], times["base"])]  # the runs of one repeat are adjacent
    paired_k3 = [b / a for a, b in zip(times["tadm K=3"], times["base"])]
    print(f"per repeat: tadm K=1 / base median {statistics.median(paired_k1):.3f} (range {min(paired_k1):.3f}-"
          f"{max(paired_k1):.3f}); base / tadm K=3 median {statistics.median(paired_k3):.3f} (range "
          f"{min(paired_k3):.3f}-{max(paired_k3):.3f})")
    k1 = interval(paired_k1)
    k3 = interval([v / analytic for v in paired_k3])
    print(f"K = 1 tokens equal the base's: {same}")
    print(f"tadm K=1 / base = {overhead:.3f} (ratio of medians); per-repeat geometric mean {k1[0]:.3f}, 95 % interval "
          f"[{k1[1]:.3f}, {k1[2]:.3f}] over {args.repeats} repeats; goal <= 1.03: "
          f"{'met' if k1[2] <= 1.03 else 'not shown (the interval reaches above 1.03)'}")
    print(f"base / tadm K=3 = {speedup:.3f}; analytic layer-call ratio {analytic:.3f} (decoder only {decoder_only:.3f}); "
          f"speed-up / analytic = {speedup / analytic:.3f} (ratio of medians); per-repeat geometric mean {k3[0]:.3f}, "
          f"95 % interval [{k3[1]:.3f}, {k3[2]:.3f}]; goal >= 0.9: "
          f"{'met' if k3[1] >= 0.9 else 'not shown (the interval reaches below 0.9)'}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "argv": sys.argv[1:], "commit": git_commit(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "times": times, "median": median, "layer_calls": calls,
            "analytic_ratio": analytic, "decoder_only_ratio": decoder_only, "k1_overhead": overhead,
            "k3_speedup": speedup, "k1_tokens_equal": same, "paired_k1_overhead": paired_k1,
            "paired_k3_speedup": paired_k3}, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
