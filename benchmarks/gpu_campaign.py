"""Every GPU number tadm lacks, from one short GPU allocation: four resumable stages of under 9 minutes each.

    python benchmarks/gpu_campaign.py --plan                  # what each stage runs, and its minutes on one H100
    python benchmarks/gpu_campaign.py --stage a               # environment and `pytest -m cuda`
    python benchmarks/gpu_campaign.py --stage b               # the paper's Table 2 layout (224M TADM, 12-block MDLM)
    python benchmarks/gpu_campaign.py --stage c               # post-training throughput at DiffusionGemma-26B size
    python benchmarks/gpu_campaign.py --stage d               # the staleness study on GPU (run it twice or three times)
    python benchmarks/gpu_campaign.py --stage e               # optional: the MDLM-OWT post-training recipe
    python benchmarks/gpu_campaign.py --goals                 # the cells that decide the goals: one command, ~9 min
    python benchmarks/gpu_campaign.py --device cpu --tiny     # every stage end to end at tiny sizes (CI does this)

Built for an allocation where each command may run 10 minutes, 15 to 30 minutes of GPU time in all
(the machine's start included), state survives between commands only if they follow within 30
seconds, nothing can be downloaded, and at most 8 result files of 16 MB come back. So:

* each stage stops itself before ``--budget-minutes`` (default 8.5), saving what it measured: a
  rerun continues with the cells not yet done (a stage is *complete* when all its cells are);
* each stage writes ``stage-X.json`` and ``stage-X.md`` (8 files for the 4 stages) into ``--results``
  (default ``runs/gpu-campaign``) and into ``$OUT`` when it is set;
* ``--goals`` fits the shortest allocation (15 minutes, one command after a start of a minute or more): it
  measures first the cells that decide the goals (stage b: TADM at T = 1024, K = 1 and 8, bf16 weights, then
  compiled; stage c: batch 1, transformers' ``generate`` and tadm at K = 1, 2, 3), within one
  ``--budget-minutes`` for the whole command. They are stored in ``stage-b``/``stage-c``'s records with the full
  stages' settings, so a later ``--stage b c`` continues with the other cells instead of measuring them again;
* nothing is downloaded: random weights (speed does not depend on them), the 26B architecture from
  :func:`tadm.posttrain.backbone.diffusion_gemma_26b_config`, the bundled corpus, the study's own
  AR model as its evaluator.

The GPU machine has no network and its own torch (2.11) and transformers (5.17), but neither omegaconf (a core
requirement) nor mauve-text. ``bash benchmarks/gpu_wheels.sh`` downloads those wheels here into ``.whl/``; carry it
and, there, ``python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl`` and
``export PYTHONPATH=$PWD/.site:$PWD/src`` before this script (it starts tadm as ``python -m tadm``). To install tadm
itself there instead, ``pip install --no-deps --no-build-isolation -e .``: without network pip cannot fetch the
build's setuptools (>= 77) into an isolated environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tadm.eval.compute import generation_flops, layer_calls
from tadm.records import git_commit
from tadm.nn import mdlm_small, mdlm_tiny, tadm_small, tadm_tiny
from tadm.sampling import generate, get_sampler

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "runs/gpu-campaign"
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "A100": 312.0}  # dense tensor-core peaks from the vendor data sheets
HBM_TB_PER_S = {"H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35, "H200": 4.8, "GH200": 4.0, "A100": 2.0}


# ============================================================================================ records
@dataclass
class Stage:
    """One stage: what it runs, its estimated minutes on one H100, and the function that runs it."""

    key: str
    title: str
    plan: str
    minutes: float
    run: Callable[[Any], None]


class StageRecord:
    """A stage's results, saved after every cell (JSON + Markdown, in each results folder)."""

    def __init__(self, key: str, title: str, spec: dict[str, Any], folders: list[Path]) -> None:
        self.key, self.title, self.spec, self.folders = key, title, spec, folders
        stored = _read(folders[0] / f"stage-{key}.json")
        same = isinstance(stored, dict) and stored.get("spec") == json.loads(json.dumps(spec))
        self.data: dict[str, Any] = stored if same else {"stage": key, "title": title, "spec": spec, "cells": {},
                                                        "invocations": []}
        self.data["invocations"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                         "command": " ".join(shlex.quote(a) for a in sys.argv), **git_commit()})
        self.started = time.perf_counter()
        self.markdown: Callable[[dict[str, Any]], str] = lambda data: ""

    @property
    def complete(self) -> bool:
        """A previous invocation measured every cell (with the same settings)."""
        return bool(self.data.get("complete"))

    def done(self, cell: str) -> bool:
        return cell in self.data["cells"]

    def get(self, cell: str) -> Any:
        return self.data["cells"].get(cell)

    def record(self, cell: str, value: Any) -> None:
        self.data["cells"][cell] = value
        self.save()

    def save(self, complete: bool | None = None) -> None:
        if complete is not None:
            self.data["complete"] = complete
        self.data["invocations"][-1]["seconds"] = round(time.perf_counter() - self.started, 1)
        text = json.dumps(self.data, indent=1, default=str) + "\n"
        page = self.markdown(self.data)
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
            for name, payload in ((f"stage-{self.key}.json", text), (f"stage-{self.key}.md", page)):
                tmp = folder / f".{name}.tmp"
                tmp.write_text(payload)
                os.replace(tmp, folder / name)


def open_stage(ctx: Any, key: str, title: str, spec: dict[str, Any], body: Callable[[dict[str, Any]], str],
               **extra: Any) -> StageRecord | None:
    """The stage's record with the environment and ``extra`` noted; None (after re-rendering) if already complete."""
    record = StageRecord(key, title, spec, ctx.folders)
    record.data["env"] = environment(ctx.device)
    record.data.update(extra)
    record.markdown = lambda data: _page(data, body(data))
    if record.complete:
        record.save()
        return None
    return record


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Budget:
    """The stage's time budget: a cell starts only if its estimated seconds still fit."""

    def __init__(self, minutes: float, deadline: float | None = None) -> None:
        self.deadline = min(time.perf_counter() + 60.0 * minutes, deadline or float("inf"))

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, as every stage records them."""
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
           "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                   capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lookup(table: dict[str, float], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(table.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def _table(rows: list[list[Any]], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _page(data: dict[str, Any], body: str) -> str:
    last = data["invocations"][-1]
    env = data.get("env", {})
    head = [f"# Stage {data['stage']}: {data['title']}", "",
            f"- Status: {'complete' if data.get('complete') else 'partial (rerun the command to continue)'}",
            f"- Command: `{last['command']}`",
            f"- Commit: `{last.get('commit', '?')}`" + (" (local changes)" if last.get("dirty") else ""),
            f"- Device: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
            f"transformers {env.get('transformers')}",
            f"- Wall time of this invocation: {last.get('seconds', 0):.0f} s "
            f"({len(data['invocations'])} invocation(s) so far)", ""]
    return "\n".join(head) + body + "\n"


# ========================================================================== (a) environment + CUDA tests
def stage_a(ctx: Any) -> None:
    record = open_stage(ctx, "a", "environment and CUDA tests", {"tiny": ctx.tiny}, _stage_a_body)
    if record is None:
        return
    if not record.done("pytest-cuda"):
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(ROOT / "tests")]
        start = time.perf_counter()
        try:
            run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                 timeout=max(30.0, ctx.budget.left() - 20))
            output, code = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as err:
            output, code = f"{err.stdout or ''}\n(timed out)", None
        summary = next((line for line in reversed(output.splitlines())
                        if " in " in line and any(w in line for w in ("passed", "failed", "skipped", "error"))), "")
        record.record("pytest-cuda", {"command": " ".join(command[1:]), "returncode": code, "summary": summary.strip("= "),
                                      "seconds": round(time.perf_counter() - start, 1), "tail": output[-4000:]})
    record.save(complete=True)


def _stage_a_body(data: dict[str, Any]) -> str:
    env = data.get("env", {})
    rows = [[k, v] for k, v in env.items()]
    test = data["cells"].get("pytest-cuda", {})
    return (_table(rows, ["what", "value"]) + "\n\n## `pytest -m cuda`\n\n"
            f"- `{test.get('command', '')}`: exit {test.get('returncode')}, {test.get('summary', '')} "
            f"({test.get('seconds', 0)} s)\n\n```\n{test.get('tail', '')[-1500:]}\n```\n")


# ================================================================================ (b) Table 2 layout
TABLE2 = {"steps": [128, 256, 512, 1024], "refresh": [1, 2, 4, 8], "length": 1024, "batches": [1, 8, 32, 64]}
TABLE2_TINY = {"steps": [8, 16], "refresh": [1, 2, 4], "length": 32, "batches": [1, 4]}
VARIANTS = ("eager-autocast", "bf16-weights", "compiled")
GOAL_VARIANTS = ("bf16-weights", "compiled")  # --goals: the sure one first, then the one that may fail to compile


def _table2_models(ctx: Any, variant: str) -> dict[str, Any]:
    """TADM (12 + 6) and MDLM (12) of the paper, or tiny ones, in the variant's precision and compilation."""
    torch.manual_seed(0)
    build = {"tadm": (lambda: tadm_tiny()) if ctx.tiny else (lambda: tadm_small(dropout=0.0)),
             "mdlm": (lambda: mdlm_tiny()) if ctx.tiny else (lambda: mdlm_small(dropout=0.0))}
    models = {}
    for name, make in build.items():
        model = make().to(ctx.device).eval()
        if variant in ("bf16-weights", "compiled") and ctx.device.type == "cuda":
            model = model.to(torch.bfloat16)
        if variant == "compiled":
            # CUDA graphs on a GPU; on CPU (tiny rehearsal) the same torch.compile path with the eager backend
            options = {"mode": "reduce-overhead"} if ctx.device.type == "cuda" else {"backend": "eager"}
            model.compile_stacks(**options)
        models[name] = model
    return models


def _timed_generation(model: Any, *, B: int, L: int, T: int, K: int, device: torch.device, autocast: bool,
                      seed: int) -> tuple[float, int]:
    """Seconds of one generation and the rows the output head computed."""
    rows = [0]
    handle = model.head.register_forward_hook(lambda m, a, out: rows.__setitem__(0, rows[0] + out.numel() // out.shape[-1]))
    try:
        sampler = get_sampler("remdm-loop", model.mask_token_id)
        g = torch.Generator(device=device).manual_seed(seed)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
            generate(model, sampler, batch_size=B, seq_len=L, num_steps=T, refresh_interval=K, generator=g,
                     device=device)
        _sync(device)
        return time.perf_counter() - start, rows[0]
    finally:
        handle.remove()


def _measure_cells(ctx: Any, record: StageRecord, models: dict[str, Any], cells: list[dict[str, Any]],
                   autocast: bool) -> bool:
    """Time ``cells`` (interleaved, shuffled rounds: one warm-up, then ``ctx.repeats``); False if the budget ran out."""
    todo = [c for c in cells if not record.done(c["id"])]
    if not todo:
        return True
    per_round = None
    samples: dict[str, list[float]] = {c["id"]: [] for c in todo}
    head_rows: dict[str, int] = {}
    for r in range(1 + ctx.repeats):
        if per_round is not None and not ctx.budget.allows(per_round * 1.2 + 10):
            return False
        start = time.perf_counter()
        order = list(todo)
        random.Random(r).shuffle(order)
        for cell in order:
            seconds, rows = _timed_generation(models[cell["model"]], B=cell["B"], L=cell["L"], T=cell["T"], K=cell["K"],
                                              device=ctx.device, autocast=autocast, seed=r)
            if r > 0:
                samples[cell["id"]].append(seconds)
                head_rows[cell["id"]] = rows
        per_round = time.perf_counter() - start
    for cell in todo:
        model = models[cell["model"]]
        seconds = statistics.median(samples[cell["id"]])
        flops = generation_flops(model, batch_size=cell["B"], seq_len=cell["L"], num_steps=cell["T"],
                                 refresh_interval=cell["K"], head_rows=head_rows[cell["id"]])
        record.data["cells"][cell["id"]] = {
            **{k: cell[k] for k in ("model", "variant", "B", "L", "T", "K")},
            "seconds": seconds, "seconds_all": samples[cell["id"]], "tokens_per_second": cell["B"] * cell["L"] / seconds,
            "layer_calls": layer_calls(model.layer_split, cell["T"], cell["K"]), "flops": flops.total,
            "tflops_per_second": flops.total / seconds / 1e12}
    record.save()
    return True


def _profile(ctx: Any, model: Any, *, L: int, T: int, K: int, steps: int, autocast: bool) -> dict[str, float]:
    """Milliseconds per reverse step by part (torch.profiler; device time on CUDA), first ``steps`` steps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_sampling as ps

    ps.instrument(model)
    ps.instrument_functions()
    args = argparse.Namespace(sampler="remdm-loop", steps=T, batch_size=1, length=L, refresh=K, profile_steps=steps,
                              dtype="bfloat16" if autocast else "float32")
    return ps.breakdown(model, args, ctx.device, full_output=False)


def stage_b(ctx: Any) -> None:
    sizes = TABLE2_TINY if ctx.tiny else TABLE2
    record = open_stage(ctx, "b", "Table 2 layout: 224M TADM and 12-block MDLM",
                        {"tiny": ctx.tiny, **sizes, "repeats": ctx.repeats}, _stage_b_body,
                        peak_bf16_tflops=_lookup(PEAK_BF16_TFLOPS, ctx.device))
    if record is None:
        return
    L = sizes["length"]
    complete = True
    for variant in GOAL_VARIANTS if ctx.goals else VARIANTS:
        cells = [{"id": f"{variant}/{name}/B1/T{T}/K{K}", "model": name, "variant": variant, "B": 1, "L": L, "T": T,
                  "K": K} for name in ("tadm", "mdlm") for T in sizes["steps"]
                 for K in (sizes["refresh"] if name == "tadm" else [1])]
        if ctx.goals:  # the goals: TADM at the largest T, K = 1 and the largest K
            cells = [c for c in cells if c["model"] == "tadm" and c["T"] == max(sizes["steps"])
                     and c["K"] in (1, max(sizes["refresh"]))]
        if all(record.done(c["id"]) for c in cells):
            continue
        if not ctx.budget.allows(60):
            complete = False
            break
        start = time.perf_counter()
        try:
            models = _table2_models(ctx, variant)
            complete &= _measure_cells(ctx, record, models, cells, autocast=variant == "eager-autocast")
        except Exception as err:  # a variant that fails (e.g. compilation) is recorded, the others still run
            for c in cells:
                record.data["cells"].setdefault(c["id"], {**c, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            record.save()
        record.data.setdefault("variant_seconds", {})[variant] = round(time.perf_counter() - start, 1)
    if ctx.goals:
        record.save(complete=False)
        return
    best = "compiled" if not any("error" in c for k, c in record.data["cells"].items() if k.startswith("compiled/")) \
        else "bf16-weights"
    T = max(sizes["steps"])
    if complete and ctx.budget.allows(60):
        cells = [{"id": f"batch/{best}/{name}/B{B}/T{T}/K{K}", "model": name, "variant": best, "B": B, "L": L, "T": T,
                  "K": K} for name in ("tadm", "mdlm") for B in sizes["batches"]
                 for K in ((1, max(sizes["refresh"])) if name == "tadm" else (1,))]
        if not all(record.done(c["id"]) for c in cells):
            complete &= _measure_cells(ctx, record, _table2_models(ctx, best), cells, autocast=False)
    else:
        complete = False
    if complete and not record.done("profile") and ctx.budget.allows(60):
        model = _table2_models(ctx, "bf16-weights")["tadm"]
        steps = 4 if ctx.tiny else 32
        record.record("profile", {f"K{K}": _profile(ctx, model, L=L, T=T, K=K, steps=steps, autocast=False)
                                  for K in (1, max(sizes["refresh"]))})
    record.save(complete=complete and record.done("profile"))


def _stage_b_body(data: dict[str, Any]) -> str:
    cells = data["cells"]
    peak = data.get("peak_bf16_tflops")
    out = []
    for variant in VARIANTS:
        rows = []
        for key, c in sorted(cells.items(), key=lambda kv: (kv[1].get("model", ""), kv[1].get("T", 0), kv[1].get("K", 0))
                             if isinstance(kv[1], dict) else ("", 0, 0)):
            if not key.startswith(f"{variant}/"):
                continue
            if "error" in c:
                rows.append([c["model"], c["T"], c["K"], "error: " + c["error"], "", "", "", "", ""])
                continue
            base = cells.get(f"{variant}/{c['model']}/B1/T{c['T']}/K1", {})
            speedup = base.get("seconds", float("nan")) / c["seconds"] if "seconds" in base else float("nan")
            analytic = base.get("flops", float("nan")) / c["flops"] if "flops" in base else float("nan")
            rows.append([c["model"], c["T"], c["K"], f"{c['tokens_per_second']:,.1f}", c["layer_calls"],
                         f"{speedup:.2f}x", f"{analytic:.2f}x", f"{100 * speedup / analytic:.0f}%",
                         f"{c['tflops_per_second']:.1f}" + (f" ({100 * c['tflops_per_second'] / peak:.0f}%)" if peak else "")])
        if rows:
            out += [f"\n## {variant} (L = {data['spec']['length']}, batch 1, ReMDM-loop)\n",
                    _table(rows, ["model", "T", "K", "tokens/s", "layer calls", "speedup vs K=1", "analytic FLOP ratio",
                                  "of analytic", "TFLOP/s (of bf16 peak)"])]
    batch = [c for k, c in cells.items() if k.startswith("batch/") and "seconds" in c]
    if batch:
        rows = [[c["model"], c["B"], c["T"], c["K"], f"{c['tokens_per_second']:,.0f}", f"{c['tflops_per_second']:.1f}",
                 f"{100 * c['tflops_per_second'] / peak:.0f}%" if peak else "-"] for c in batch]
        out += [f"\n## Batch sweep ({batch[0]['variant']})\n",
                _table(rows, ["model", "B", "T", "K", "tokens/s", "TFLOP/s", "of the bf16 roofline"])]
    prof = cells.get("profile")
    if prof:
        parts = list(next(iter(prof.values())))
        rows = [[part] + [f"{prof[k][part]:.2f}" for k in prof] for part in parts]
        out += ["\n## Where a reverse step's time goes (ms per step, bf16 weights)\n",
                _table(rows, ["part", *prof.keys()])]
    return "\n".join(out)


# ====================================================================== (c) post-training at 26B size
def _diffusion_gemma(ctx: Any) -> tuple[Any, Any]:
    """DiffusionGemma-26B-A4B with random bf16 weights built on the device (or a tiny one), and its config."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain.backbone import diffusion_gemma_26b_config, tiny_diffusion_gemma_config

    config = (tiny_diffusion_gemma_config(vocab_size=512, hidden_size=64, num_layers=30, canvas_length=16,
                                          num_heads=2, head_dim=32, sliding_window=32)
              if ctx.tiny else diffusion_gemma_26b_config())
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    with torch.device(ctx.device):  # weights initialised where they live (about 52 GB at full size)
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    return model.eval(), config


STAGE_C_SPLIT, STAGE_C_FUSION = (2, 20, 8), {"rank": 256, "num_heads": 4}  # the paper's split of the 30 layers


def _full_size_refusal(device: torch.device, goals: bool) -> str | None:
    """Why stage c cannot run at full size on ``device`` (None on a GPU): its model in the dtype it would take
    there (float32 off CUDA) needs over 100 GB, by the plan's estimate (tadm.posttrain.plan) at batch 1."""
    if device.type == "cuda":
        return None
    from tadm.posttrain import FusionSpec, SplitSpec
    from tadm.posttrain.backbone import diffusion_gemma_26b_config
    from tadm.posttrain.plan import build_meta_model, estimate_inference_memory

    model = build_meta_model(diffusion_gemma_26b_config(), SplitSpec(*STAGE_C_SPLIT), FusionSpec(**STAGE_C_FUSION))
    estimate = estimate_inference_memory(model, batch=1, prompt=512, canvas=256, dtype=torch.float32)
    weights = estimate.items["backbone weights"]
    instead = "run --goals on a GPU" if goals else "run it on a GPU (--device cuda), leave it out (--stage a b d)"
    return (f"stage c builds DiffusionGemma-26B-A4B at full size, which needs about {estimate.total / 1e9:.0f} GB on "
            f"{device} (float32 weights {weights / 1e9:.0f} GB; tadm posttrain plan's estimate at batch 1); {instead}, "
            f"or add --tiny to rehearse every stage at tiny sizes on the CPU")


def _time_anchored(model: Any) -> Any:
    """``model`` time-anchored in place (the anchor cache inside the model): split 2 / 20 / 8, a rank-256 fusion."""
    from tadm.posttrain import FusionSpec
    from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma

    anchored = TimeAnchoredDiffusionGemma.from_pretrained(model, split=STAGE_C_SPLIT[:2],
                                                        fusion=FusionSpec(**STAGE_C_FUSION))
    with torch.no_grad():  # random weights: the fusion is not the identity, so it costs what a trained one does
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
        for p in anchored.fusion.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    return anchored


@contextmanager
def _plain_base(model: Any) -> Any:
    """transformers' own ``DiffusionGemmaForBlockDiffusion`` for the baseline cells: the time-anchored model with its
    class and its anchor layers' classes as they were before (the same weights, no second copy)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain.layer_cache import install_layer_cache, remove_layer_cache

    cls, layers = type(model), model.model.decoder.layers
    remove_layer_cache(layers)
    model.__class__ = DiffusionGemmaForBlockDiffusion
    try:
        yield model
    finally:
        model.__class__ = cls
        install_layer_cache(layers, model.anchor_cache)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def stage_c(ctx: Any) -> None:
    prompt_len, canvas, steps = (24, 16, 6) if ctx.tiny else (512, 256, 48)
    batches = (1, 2) if ctx.tiny else (1, 8)
    record = open_stage(ctx, "c", "post-training throughput at DiffusionGemma-26B-A4B size",
                        {"tiny": ctx.tiny, "prompt": prompt_len, "canvas": canvas, "steps": steps, "batches": batches,
                         "repeats": ctx.repeats}, _stage_c_body, hbm_tb_per_s=_lookup(HBM_TB_PER_S, ctx.device))
    if record is None:
        return
    start = time.perf_counter()
    model, config = _diffusion_gemma(ctx)
    model = _time_anchored(model)
    record.data["build_seconds"] = round(time.perf_counter() - start, 1)
    fusion = list(model.fusion.parameters())
    base = [p for name, p in model.named_parameters() if not name.startswith("fusion.")]
    record.data["parameters"] = {"backbone": sum(p.numel() for p in base), "fusion": sum(p.numel() for p in fusion),
                                 "bytes": sum(p.numel() * p.element_size() for p in base)}
    V = int(config.text_config.vocab_size)
    methods = [("base (transformers generate)", "hf", 1), ("tadm K=1", "paired", 1), ("tadm K=2", "paired", 2),
               ("tadm K=3", "paired", 3), ("naive K=2", "naive", 2), ("naive K=3", "naive", 3)]
    complete = not ctx.goals
    cells = [(B, label, mode, K) for B in batches for label, mode, K in methods
             if not ctx.goals or (B == 1 and mode != "naive")]  # the goals: batch 1, base and tadm
    for B, label, mode, K in cells:
        cell = f"B{B}/{label}"
        if record.done(cell):
            continue
        if not ctx.budget.allows(90):
            complete = False
            break
        prompt = torch.randint(3, V, (B, prompt_len), generator=torch.Generator().manual_seed(B)).to(ctx.device)
        _peak_reset(ctx.device)
        _generate_26b(ctx, model, prompt, mode, K, canvas, steps, seed=0)  # warm-up
        times, calls = [], 0
        for r in range(ctx.repeats):
            seconds, calls = _generate_26b(ctx, model, prompt, mode, K, canvas, steps, seed=r + 1)
            times.append(seconds)
        seconds = statistics.median(times)
        record.record(cell, {"method": label, "B": B, "K": K, "seconds": seconds, "seconds_all": times,
                             "tokens_per_second": B * canvas / seconds, "decoder_layer_calls": calls,
                             "peak_memory_gb": _peak_gb(ctx.device)})
    if complete and not record.done("posttrain step") and ctx.budget.allows(120):
        record.record("posttrain step", _posttrain_step(ctx, model.stage_view(), V, prompt_len, canvas, steps))
    record.save(complete=complete and record.done("posttrain step"))


def _generate_26b(ctx: Any, model: Any, prompt: torch.Tensor, mode: str, K: int, canvas: int, steps: int, *,
                  seed: int) -> tuple[float, int]:
    """Seconds of one canvas after ``prompt`` and the decoder layer calls of one row's denoising passes.

    ``mode`` "hf" is transformers' own ``generate`` on its own class (every layer at every step); "paired" and
    "naive" are the same ``generate`` on the time-anchored model (the anchor cache inside the model), with the
    fusion or with naive reuse of the stale anchor.
    """
    _sync(ctx.device)
    start = time.perf_counter()
    settings = dict(max_new_tokens=canvas, max_denoising_steps=steps, stability_threshold=None,
                    confidence_threshold=None)
    with torch.no_grad():
        if mode == "hf":
            with _plain_base(model):
                torch.manual_seed(seed)
                model.generate(prompt, **settings)
            calls = len(model.config.text_config.layer_types) * steps
        else:
            model.generate(prompt, refresh_interval=K, naive=mode == "naive",
                           generator=torch.Generator(device=ctx.device).manual_seed(seed), **settings)
            calls = model.last_generation.layer_calls.total
    _sync(ctx.device)
    return time.perf_counter() - start, calls


def _posttrain_step(ctx: Any, split: Any, V: int, prompt_len: int, canvas: int, steps: int) -> dict[str, Any]:
    """Time and peak memory of one post-training step (on-policy rollout + CE + KD) at micro-batch 1."""
    from tadm.posttrain import PosttrainTrainer, load_posttrain_config
    from tadm.posttrain.data import CanvasBatch

    # the paper's on-policy rollout: k sampler steps of the frozen model before the loss (the costlier step)
    config = load_posttrain_config(None, [f"rollout.sampler.num_steps={steps}", "train.grad_accum_steps=1",
                                          "rollout.mode=on-policy",
                                          f"train.precision={'bf16' if ctx.device.type == 'cuda' else 'fp32'}"])
    split.fusion_mode = "paired"  # the generations above may have left naive reuse on
    trainer = PosttrainTrainer(split, config, device=ctx.device)
    g = torch.Generator().manual_seed(2)
    batch = CanvasBatch(torch.randint(3, V, (1, prompt_len), generator=g), torch.ones(1, prompt_len, dtype=torch.bool),
                        torch.randint(3, V, (1, canvas), generator=g), torch.ones(1, canvas, dtype=torch.bool))
    trainer.train_step([batch])  # warm-up: AdamW state
    _peak_reset(ctx.device)
    times = []
    for _ in range(ctx.repeats):
        _sync(ctx.device)
        t0 = time.perf_counter()
        metrics = trainer.train_step([batch])
        _sync(ctx.device)
        times.append(time.perf_counter() - t0)
    split.eval()
    return {"seconds": statistics.median(times), "seconds_all": times, "peak_memory_gb": _peak_gb(ctx.device),
            "loss": metrics["loss"], "micro_batch": 1, "prompt": prompt_len, "canvas": canvas}


def _weight_limit(data: dict[str, Any], K: int, B: int) -> float | None:
    """tokens/s if every reverse step had to read the weights it uses once from HBM (batch 1: every expert)."""
    bw = data.get("hbm_tb_per_s")
    if not bw:
        return None
    total = data["parameters"]["bytes"]
    anchor_share = 20 / 30
    per_canvas_bytes = data["spec"]["steps"] * total * ((1 - anchor_share) + anchor_share / K)
    return B * data["spec"]["canvas"] / (per_canvas_bytes / (bw * 1e12))


def _stage_c_body(data: dict[str, Any]) -> str:
    cells = data["cells"]
    rows = []
    for B in data["spec"]["batches"]:
        base = cells.get(f"B{B}/base (transformers generate)", {})
        for key, c in cells.items():
            if not key.startswith(f"B{B}/"):
                continue
            ratio = base["seconds"] / c["seconds"] if base else float("nan")
            limit = _weight_limit(data, c["K"], B)
            rows.append([c["method"], B, f"{c['tokens_per_second']:,.1f}", f"{ratio:.2f}x", c["decoder_layer_calls"],
                         f"{c['peak_memory_gb']:.1f}" if c.get("peak_memory_gb") is not None else "-",
                         f"{limit:,.0f}" if limit else "-"])
    p = data.get("parameters", {})
    step = cells.get("posttrain step")
    out = [f"\n{p.get('backbone', 0):,} backbone parameters ({p.get('bytes', 0) / 1e9:.1f} GB), "
           f"{p.get('fusion', 0):,} fusion parameters; built with random weights in {data.get('build_seconds')} s. "
           f"Split 2 / 20 / 8, entropy-bound sampler, canvas {data['spec']['canvas']}, {data['spec']['steps']} steps, "
           f"{data['spec']['prompt']}-token prompt, adaptive stopping off.\n",
           _table(rows, ["method", "B", "tokens/s", "vs base", "decoder layer calls", "peak GB",
                         "weight-read limit tok/s"])]
    if step:
        out.append(f"\nOne post-training step (rollout + CE + KD), micro-batch 1: {step['seconds']:.2f} s, peak "
                   + (f"{step['peak_memory_gb']:.1f} GB" if step.get("peak_memory_gb") is not None else "- (CPU)") + ".")
    return "\n".join(out)


# ====================================================================== (d) the staleness study on GPU
STUDY_GPU_CAMPAIGN = ["sampling.evaluators=[ar]", "seeds=[0]", "train.max_steps=1000", "sampling.num_samples=128",
                      "sampling.steps=[128,512]", "staleness.eval_seeds=[0]", "sampling.throughput_generations=5"]
STUDY_TINY_CAMPAIGN = ["seeds=[0]", "sampling.steps=[8]", "staleness.eval_seeds=[0]"]


def stage_d(ctx: Any) -> None:
    preset, overrides = ("study-tiny", list(STUDY_TINY_CAMPAIGN)) if ctx.tiny else ("study-gpu", list(STUDY_GPU_CAMPAIGN))
    # absolute paths: the study runs with the repository as its working directory, and its token cache
    # (data.cache_dir, relative by default) would otherwise land there too
    results = Path(ctx.results).resolve()
    out_dir = results / "study"
    overrides = [*overrides, f"out_dir={out_dir}", f"data.cache_dir={results / '.tadm-cache'}"]
    overrides += [] if ctx.device.type == "cuda" else ["train.device=cpu", "sampling.device=cpu"]
    page = out_dir / "report.md"
    record = open_stage(ctx, "d", f"the staleness study on GPU ({preset})",
                        {"tiny": ctx.tiny, "preset": preset, "overrides": overrides},
                        lambda data: "\n" + (page.read_text() if page.is_file() else "(no report yet)\n\n```\n"
                                             + str(data["cells"].get("run", {}).get("tail", "")) + "\n```"))
    if record is None:
        return
    command = [sys.executable, "-m", "tadm", "study", preset, *overrides, "--no-progress",
               "--stages", "train", "likelihood", "sample", "score", "throughput"]
    start = time.perf_counter()
    try:
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=max(30.0, ctx.budget.left() - 45))
        finished, tail = run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        finished, tail = False, "(stopped at the stage's time budget; rerun to continue: finished units are kept)"
    report = subprocess.run([sys.executable, "-m", "tadm", "study", preset, *overrides, "--no-progress", "--stages",
                             "report"], capture_output=True, text=True, cwd=ROOT)
    record.data["cells"]["run"] = {"command": " ".join(shlex.quote(a) for a in command[2:]), "finished": finished,
                                   "seconds": round(time.perf_counter() - start, 1), "tail": tail,
                                   "report_returncode": report.returncode}
    record.data["cells"]["results"] = _read(out_dir / "results.json")
    record.save(complete=finished and report.returncode == 0)


# =============================================== (e, optional) the MDLM-OWT post-training recipe
MDLM_OWT_STAGE = {"canvas": 1024, "steps": 128, "batches": [1, 8], "micro_batch": 8, "train_steps": 20}
MDLM_OWT_TINY = {"canvas": 32, "steps": 8, "batches": [1, 2], "micro_batch": 2, "train_steps": 3}


def _mdlm_owt(ctx: Any, sizes: dict[str, Any]) -> tuple[Any, Any, Any]:
    """MDLM-OWT's size (or a tiny MDLM) with random weights, split as posttrain-mdlm-owt says, its config and plan."""
    from tadm.nn import MDLM
    from tadm.posttrain import AnchoredBackbone, FusionSpec, MDLMBackbone, SplitSpec, load_posttrain_config
    from tadm.posttrain.plan import mdlm_owt_config, plan_mdlm_posttrain

    overrides = [f"rollout.sampler.num_steps={sizes['steps']}", f"train.micro_batch_size={sizes['micro_batch']}",
                 f"data.canvas_length={sizes['canvas']}", "train.grad_accum_steps=1",
                 f"train.precision={'bf16' if ctx.device.type == 'cuda' else 'fp32'}"]
    if ctx.tiny:
        overrides += ["split.shared_layers=1", "split.anchor_layers=2", "split.denoiser_layers=1", "fusion.rank=16"]
    config = load_posttrain_config("posttrain-mdlm-owt", overrides)
    mdlm_config = (mdlm_tiny(num_layers=4, max_seq_len=sizes["canvas"]).config if ctx.tiny
                   else mdlm_owt_config())
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    with torch.device(ctx.device):
        mdlm = MDLM(mdlm_config).to(dtype).eval()
    with torch.no_grad():  # random weights: adaLN-zero and the zeroed output layer would make every block the identity
        generator = torch.Generator(device=ctx.device).manual_seed(1)
        for p in mdlm.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    split = AnchoredBackbone(MDLMBackbone(mdlm), SplitSpec(**asdict(config.split)),
                             FusionSpec(rank=config.fusion.rank, num_heads=config.fusion.num_heads))
    split.fusion.to(ctx.device)
    with torch.no_grad():  # not the identity: it costs what a trained fusion does
        for p in split.fusion.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    plan = None
    if not ctx.tiny:
        plan = plan_mdlm_posttrain(config)
    return split, config, plan


def stage_e(ctx: Any) -> None:
    from tadm.posttrain import PosttrainTrainer
    from tadm.posttrain.data import CanvasBatch
    from tadm.sampling import MDLMSampler

    sizes = MDLM_OWT_TINY if ctx.tiny else MDLM_OWT_STAGE
    record = open_stage(ctx, "e", "the MDLM-OWT post-training recipe (optional)",
                        {"tiny": ctx.tiny, **sizes, "repeats": ctx.repeats}, _stage_e_body)
    if record is None:
        return
    split, config, plan = _mdlm_owt(ctx, sizes)
    V, mask_id = split.vocab_size, int(split.mask_token_id)
    record.data["parameters"] = {"backbone": sum(p.numel() for p in split.backbone.parameters()),
                                 "fusion": sum(p.numel() for p in split.fusion.parameters()),
                                 "split": [split.layer_split.shared, split.layer_split.anchor,
                                           split.layer_split.denoiser]}
    if plan is not None:
        record.data["plan_gb"] = {e.what: round(e.total / 1e9, 2) for e in plan.estimates}
    complete = True
    for B in sizes["batches"]:
        for label, mode, K in (("tadm K=1", "paired", 1), ("tadm K=2", "paired", 2), ("tadm K=3", "paired", 3),
                               ("naive K=3", "naive", 3)):
            cell = f"B{B}/{label}"
            if record.done(cell):
                continue
            if not ctx.budget.allows(60):
                complete = False
                break
            split.fusion_mode = mode
            run = lambda seed: generate(split, MDLMSampler(mask_id), batch_size=B, seq_len=sizes["canvas"],
                                        num_steps=sizes["steps"], refresh_interval=K, device=ctx.device,
                                        generator=torch.Generator(device=ctx.device).manual_seed(seed))
            run(0)  # warm-up
            _peak_reset(ctx.device)
            times, calls = [], 0
            for r in range(ctx.repeats):
                _sync(ctx.device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    calls = run(r + 1).layer_calls.total
                _sync(ctx.device)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            record.record(cell, {"method": label, "B": B, "K": K, "seconds": seconds, "seconds_all": times,
                                 "tokens_per_second": B * sizes["canvas"] / seconds, "layer_calls": calls,
                                 "peak_memory_gb": _peak_gb(ctx.device)})
    split.fusion_mode = "paired"
    if complete and not record.done("posttrain") and ctx.budget.allows(120):
        trainer = PosttrainTrainer(split, config, device=ctx.device)
        g = torch.Generator().manual_seed(2)
        B, L = sizes["micro_batch"], sizes["canvas"]
        batch = lambda: CanvasBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
                                    torch.randint(0, V - 1, (B, L), generator=g), torch.ones(B, L, dtype=torch.bool))
        trainer.train_step([batch()])  # warm-up: AdamW state
        _peak_reset(ctx.device)
        losses, times = [], []
        for _ in range(sizes["train_steps"]):
            if not ctx.budget.allows(30):
                break
            _sync(ctx.device)
            t0 = time.perf_counter()
            losses.append(trainer.train_step([batch()])["loss"])
            _sync(ctx.device)
            times.append(time.perf_counter() - t0)
        split.eval()
        record.record("posttrain", {"steps": len(times), "seconds_per_step": statistics.median(times),
                                    "canvas_tokens_per_second": B * L / statistics.median(times),
                                    "losses": losses, "micro_batch": B, "canvas": L,
                                    "peak_memory_gb": _peak_gb(ctx.device)})
    record.save(complete=complete and record.done("posttrain"))


def _stage_e_body(data: dict[str, Any]) -> str:
    cells, spec = data["cells"], data["spec"]
    rows = []
    for B in spec["batches"]:
        base = cells.get(f"B{B}/tadm K=1", {}).get("seconds")
        for key, c in cells.items():
            if key.startswith(f"B{B}/"):
                rows.append([c["method"], B, f"{c['tokens_per_second']:,.1f}",
                             f"{base / c['seconds']:.2f}x" if base else "-", c["layer_calls"],
                             f"{c['peak_memory_gb']:.2f}" if c.get("peak_memory_gb") is not None else "-"])
    p = data.get("parameters", {})
    out = [f"\n{p.get('backbone', 0):,} backbone parameters (random weights), {p.get('fusion', 0):,} fusion "
           f"parameters, split {' / '.join(map(str, p.get('split', [])))}; tadm's MDLM sampler, canvas {spec['canvas']}, "
           f"{spec['steps']} steps.\n", _table(rows, ["method", "B", "tokens/s", "vs K=1", "layer calls", "peak GB"])]
    step = cells.get("posttrain")
    if step:
        peak = f"{step['peak_memory_gb']:.2f} GB" if step.get("peak_memory_gb") is not None else "- (CPU)"
        losses = f"; loss {step['losses'][0]:.3f} -> {step['losses'][-1]:.3f}" if step.get("losses") else ""
        out.append(f"\nPost-training (on-policy MDLM rollouts, CE + KD), micro-batch {step['micro_batch']}: "
                   f"{step['steps']} steps, {step['seconds_per_step']:.3f} s per step, peak {peak}{losses}.")
    if data.get("plan_gb"):
        out.append("\n`tadm posttrain plan posttrain-mdlm-owt` estimates (GB, per process): "
                   + "; ".join(f"{k}: {v}" for k, v in data["plan_gb"].items()) + ".")
    return "\n".join(out)


# ============================================================================================ driver
STAGES = {s.key: s for s in (
    Stage("a", "environment and CUDA tests", "versions, the GPU, then `pytest -m cuda` (compiled = eager tokens, "
          "bf16 paths, decoded rows on CUDA, one synchronisation per step)", 3.0, stage_a),
    Stage("b", "the paper's Table 2 layout", "224M TADM (12 + 6) and 12-block MDLM, L = 1024, batch 1, ReMDM-loop, "
          "T in {128, 256, 512, 1024}, K in {1, 2, 4, 8}: eager (bf16 autocast), bf16 weights, compiled (CUDA graphs); "
          "analytic FLOP ratio and TFLOP/s; batch 1/8/32/64 at T = 1024 against the bf16 roofline; profile per step",
          8.5, stage_b),
    Stage("c", "post-training at DiffusionGemma-26B-A4B size", "random bf16 26B model split 2 / 20 / 8 with the paired "
          "fusion; transformers' generate vs tadm K = 1, 2, 3 and naive reuse, batch 1 and 8, 512-token prompt, canvas "
          "256, 48 steps: tokens/s, layer calls, peak memory, the weight-read limit; one post-training step", 7.0, stage_c),
    Stage("d", "the staleness study on GPU", "study-gpu with the study's own AR as evaluator, one seed, 1,000 steps per "
          "model; about 15 minutes: run the stage twice (it resumes its units)", 8.5, stage_d),
)}


OPTIONAL_STAGES = {s.key: s for s in (
    Stage("e", "the MDLM-OWT post-training recipe", "MDLM-OWT's size (12 blocks, d = 768, vocabulary 50258) with "
          "random bf16 weights split 1 / 8 / 3 with the paired fusion (rank 256): tadm's MDLM sampler, canvas 1024, "
          "128 steps, K = 1, 2, 3 and naive reuse at batch 1 and 8; 20 post-training steps at micro-batch 8 "
          "(on-policy MDLM rollouts); peaks beside `tadm posttrain plan posttrain-mdlm-owt`", 5.0, stage_e),
)}
"""Stages run only when named (``--stage e``): the four of :data:`STAGES` fill the 8 result files."""

GOALS_STAGES = ("b", "c")
GOALS_SHARE = {"b": 0.4, "c": 1.0}  # --goals: stage b may use 40 % of the budget, stage c whatever is left


@dataclass
class Context:
    device: torch.device
    tiny: bool
    repeats: int
    results: str
    folders: list[Path]
    budget: Budget
    goals: bool = False


def goals_page(folder: Path) -> str:
    """The GPU goals (issue "Run where it matters") beside what stages b and c measured so far, in Markdown."""
    b = (_read(folder / "stage-b.json") or {}).get("cells", {})
    c = (_read(folder / "stage-c.json") or {}).get("cells", {})
    rows = []
    tadm = [v for v in b.values() if isinstance(v, dict) and v.get("model") == "tadm" and v.get("B") == 1
            and "seconds" in v]
    T = max((v["T"] for v in tadm), default=None)
    Ks = sorted({v["K"] for v in tadm if v["T"] == T})
    for variant in dict.fromkeys(v["variant"] for v in tadm):
        cell = {v["K"]: v for v in tadm if v["variant"] == variant and v["T"] == T}
        if 1 not in cell or len(Ks) < 2 or Ks[-1] not in cell:
            continue
        k1, kmax = cell[1], cell[Ks[-1]]
        speedup, analytic = k1["seconds"] / kmax["seconds"], k1["flops"] / kmax["flops"]
        rows += [[f"T = {T}, K = {Ks[-1]}, {variant}", ">= 1,000 tokens/s", f"{kmax['tokens_per_second']:,.1f}",
                  "met" if kmax["tokens_per_second"] >= 1000 else "missed"],
                 [f"T = {T}, K = 1, {variant}", ">= 500 tokens/s", f"{k1['tokens_per_second']:,.1f}",
                  "met" if k1["tokens_per_second"] >= 500 else "missed"],
                 [f"K = {Ks[-1]} / K = 1 speedup, {variant}", ">= 90 % of the analytic ratio",
                  f"{speedup:.2f}x of {analytic:.2f}x ({100 * speedup / analytic:.0f} %)",
                  "met" if speedup >= 0.9 * analytic else "missed"]]
    base = c.get("B1/base (transformers generate)", {}).get("seconds")
    for label, goal in (("tadm K=1", 1.0), ("tadm K=2", 1.45), ("tadm K=3", 1.7)):
        seconds = c.get(f"B1/{label}", {}).get("seconds")
        if base and seconds:
            rows.append([f"26B size, batch 1, {label}", f">= {goal:.2f}x transformers' generate",
                         f"{base / seconds:.2f}x", "met" if base / seconds >= goal else "missed"])
    if not rows:
        return "No goal cell has been measured yet.\n"
    return _table(rows, ["goal", "target", "measured", ""]) + "\n"


def print_plan() -> None:
    total = 0.0
    print("| stage | what it runs | minutes on one H100 (estimate) |\n|---|---|---:|")
    for s in STAGES.values():
        total += s.minutes
        print(f"| {s.key} | {s.plan} | {s.minutes:.1f} |")
    for s in OPTIONAL_STAGES.values():
        print(f"| {s.key} (optional, run with --stage {s.key}) | {s.plan} | {s.minutes:.1f} |")
    print(f"\nabout {total:.0f} minutes of stages, plus the machine's start; each stops itself before "
          f"--budget-minutes and resumes when run again. Every stage writes stage-X.json and stage-X.md "
          f"(8 files for four stages) to --results and $OUT.\n\n"
          f"For a 15-minute allocation: --goals, one command within --budget-minutes (default 8.5) in all: stage b's "
          f"TADM at T = 1024, K = 1 and 8, bf16 weights then compiled (at most 40 % of the budget), then stage c at "
          f"batch 1 (transformers' generate, tadm K = 1, 2, 3). A later --stage b c continues from those cells.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print what each stage runs and its minutes, then stop")
    p.add_argument("--stage", nargs="+", default=["all"], metavar="STAGE",
                   help="a, b, c, d or all (default); e (optional) only when named")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the whole campaign in minutes on a CPU")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (default 3; 1 with --tiny)")
    p.add_argument("--goals", action="store_true",
                   help="only the cells that decide the goals (stages b and c), in one command for a 15-minute "
                        "allocation; --budget-minutes then bounds the whole command")
    p.add_argument("--budget-minutes", type=float, default=8.5,
                   help="each stage stops before this; with --goals, the whole command (default 8.5)")
    p.add_argument("--results", default=RESULTS, help=f"results folder (default {RESULTS}); also $OUT when set")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print_plan()
        return 0
    if "all" in args.stage and len(args.stage) > 1:
        print(f"gpu_campaign: error: --stage all runs every stage; give it alone, or name stages "
              f"({', '.join(STAGES)}), got {' '.join(args.stage)}", file=sys.stderr)
        return 2
    if args.goals and args.stage != ["all"]:
        print(f"gpu_campaign: error: --goals runs stages {' and '.join(GOALS_STAGES)} itself; drop --stage "
              f"{' '.join(args.stage)}", file=sys.stderr)
        return 2
    stages = list(GOALS_STAGES) if args.goals else list(STAGES) if args.stage == ["all"] else args.stage
    unknown = [s for s in stages if s not in STAGES and s not in OPTIONAL_STAGES]
    if unknown:
        print(f"gpu_campaign: error: unknown stage {', '.join(map(repr, unknown))}; valid: {', '.join(STAGES)} or all, "
              f"and the optional {', '.join(OPTIONAL_STAGES)}", file=sys.stderr)
        return 2
    if not args.budget_minutes > 0:
        print(f"gpu_campaign: error: --budget-minutes must be > 0, got {args.budget_minutes}", file=sys.stderr)
        return 2
    try:
        from tadm.specs import resolve_device

        device = resolve_device(args.device)
    except ValueError as err:
        print(f"gpu_campaign: error: {err}", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print(f"gpu_campaign: error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    refusal = None if args.tiny or "c" not in stages else _full_size_refusal(device, args.goals)
    if refusal is not None:
        print(f"gpu_campaign: error: {refusal}", file=sys.stderr)
        return 2
    results = Path(args.results).resolve()  # stage d's study runs in the repository: one meaning for a relative path
    folders = [results] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    deadline = time.perf_counter() + 60.0 * args.budget_minutes if args.goals else None
    for key in stages:
        stage = STAGES[key] if key in STAGES else OPTIONAL_STAGES[key]
        minutes = (deadline - time.perf_counter()) / 60.0 * GOALS_SHARE[key] if args.goals else args.budget_minutes
        ctx = Context(device=device, tiny=args.tiny, repeats=args.repeats or (1 if args.tiny else 3),
                      results=str(results), folders=folders, budget=Budget(minutes, deadline), goals=args.goals)
        start = time.perf_counter()
        print(f"[gpu_campaign] stage {key}: {stage.title} ...", flush=True)
        stage.run(ctx)
        status = _read(folders[0] / f"stage-{key}.json") or {}
        print(f"[gpu_campaign] stage {key}: {'complete' if status.get('complete') else 'partial'} in "
              f"{time.perf_counter() - start:.0f} s -> {folders[0] / f'stage-{key}.md'}", flush=True)
    if args.goals:
        page = ("# GPU goals" + (": a tiny rehearsal, not the goals' sizes" if args.tiny else "") + f" ({device})\n\n"
                + goals_page(folders[0]))
        for folder in folders:
            (folder / "goals.md").write_text(page)
        print(page, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
