"""Plan a post-training run before it runs: the model built on the meta device, and GPU memory per process.

:func:`plan_posttrain` takes a post-training config, resolves its base's architecture without
downloading weights (a local directory's ``config.json``, the Hugging Face cache, or an architecture
tadm knows: :data:`KNOWN_BASES`), builds the split model with its paired-attention fusion on the
``meta`` device (no weights, no memory) and reports

* total, frozen and trainable parameters and the layer split;
* an estimate of GPU memory per process for one training step (rollout + CE + KD at the configured
  micro-batch, prompt and canvas lengths) and for inference at batch 1 and 8, itemised:

  - weights: every backbone parameter in the base dtype (bf16: 2 bytes), the fusion in float32;
  - optimiser: the fusion's gradients and AdamW's two moments (float32);
  - prompt KV cache: per layer 2 x B x P_l x kv_heads_l x head_dim_l, where P_l is the prompt length
    on full-attention layers and min(prompt, sliding window) on sliding ones;
  - layer activations: the tensors a decoder layer keeps for the backward pass, per canvas token
    (8 of width d for norms, inputs and residuals; queries and outputs 3 x heads x head_dim; keys
    and values 2 x kv_heads x head_dim; the dense FFN 4 x its width; each of the top-k experts its
    input and 4 x its width), for the denoiser layers gradients flow through, or one layer's worth
    without gradients;
  - vocabulary tensors: float32 (B, L, V) tensors alive at once (training: student logits,
    soft-capped logits, log-softmax, its gradient, the teacher's logits, probabilities and
    log-probabilities, the KD term, and the self-conditioning logits: :data:`TRAIN_VOCAB_COPIES`;
    inference, at a step of the base's own entropy-bound sampler (``generate``): the raw and the
    temperature-scaled logits, the probabilities and the draw's temporaries, the entropy's normalised
    logits and terms, as measured: :data:`INFER_VOCAB_COPIES`) plus the self-conditioning logits (base dtype) carried between
    steps. At inference a denoiser pass and the sampler step do not overlap: a pass holds the raw
    logits and two self-conditioning logits (this step's and the previous pass's) beside one
    layer's working set, which counts only where it exceeds the sampler step's tensors.

It is an estimate: allocator overhead, fragmentation and the CUDA context (about 0.5-1 GB) come on
top; ``tests/posttrain/test_plan.py`` holds it against the measured peak of a tiny model.

Bases whose canvas is the whole sequence (LLaDA, Dream: base.backbone "llada" or "dream") are
planned analytically from their ``config.json`` (a local directory's, or tadm's record of the
released checkpoints, :data:`KNOWN_SEQUENCE_BASES`), one line per architecture in
:data:`SEQUENCE_FAMILIES`: their code ships with the checkpoint and tadm does not import it. They
have no KV cache: every pass runs over the sequence of S = prompt + canvas tokens, so the anchor
cache, the layer activations and the vocabulary tensors scale with S, and the sampler step holds
:attr:`SequenceFamily.sampler_bytes` bytes per (position, vocabulary entry) at temperature > 0,
the logits included (LLaDA: float32 logits and probabilities beside the float64 Gumbel draw's
logits, noise, powers and quotient; Dream with top-p: the logits, the masked rows, their softmax,
its renormalised copy and the sort), the peak of one step as measured on CPU (held within 25% by
``tests/posttrain/test_plan_families.py``).

A base of the MDLM family (``base.backbone: mdlm``: tadm's MDLM, a released checkpoint such as
MDLM-OWT, or :data:`KNOWN_MDLM_BASES` by name) is planned by :func:`plan_mdlm_posttrain` with the
same columns for its DiT: no prompt KV cache (the model is unconditional; a prompt lies inside its
canvas of ``data.canvas_length`` tokens), per denoiser block and canvas token :data:`DIT_TOKEN_ACTIVATIONS`
values of width d kept for backward, and the (B, L, V) float32 tensors of the SUBS output and the loss
(:data:`MDLM_TRAIN_VOCAB_COPIES`) or of a sampling step (:data:`MDLM_INFER_VOCAB_COPIES`, a block's
working set counted only where it exceeds them, as for DiffusionGemma).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tadm.devices import resolve_dtype
from tadm.nn.baselines import MDLM, MDLMConfig
from tadm.nn.hub import MODEL_TYPE_KEY, config_from_dict, read_config
from tadm.nn.released_mdlm import is_released_mdlm_config, released_config
from tadm.posttrain.backbone import (DIFFUSION_GEMMA_26B, DiffusionGemmaBackbone, MDLMBackbone, check_base,
                                     diffusion_gemma_26b_config)
from tadm.posttrain.backbones import DenseStackShape, dream_7b_config, llada_8b_config
from tadm.posttrain.backbones.dream import dream_shape
from tadm.posttrain.backbones.llada import llada_shape
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec

__all__ = ["GPU_SIZES_GB", "INFER_VOCAB_COPIES", "KNOWN_BASES", "KNOWN_MDLM_BASES", "KNOWN_SEQUENCE_BASES", "MDLM_OWT",
           "MemoryEstimate", "PosttrainPlan", "SEQUENCE_FAMILIES", "SequenceFamily", "TRAIN_VOCAB_COPIES",
           "estimate_dit_inference_memory", "estimate_dit_training_memory", "estimate_inference_memory",
           "estimate_sequence_inference_memory", "estimate_sequence_training_memory", "estimate_training_memory",
           "mdlm_owt_config", "plan_mdlm_posttrain", "plan_posttrain", "plan_sequence_posttrain", "resolve_base_config",
           "resolve_mdlm_config", "resolve_sequence_config"]

KNOWN_BASES: dict[str, Callable[[], Any]] = {DIFFUSION_GEMMA_26B: diffusion_gemma_26b_config}
"""Bases whose architecture tadm can build without their ``config.json`` (checkpoint id -> config builder)."""

COLUMNS = ("weights", "optimiser", "KV cache", "activations", "vocabulary tensors")
_COLUMN_ITEMS = {"weights": ("backbone weights", "fusion weights"), "optimiser": ("fusion gradients",),
                 "KV cache": ("prompt KV cache", "KV cache"),
                 "vocabulary tensors": ("vocabulary tensors", "sampler vocabulary", "self-conditioning logits")}
GPU_SIZES_GB = (80, 96, 189)  # H100 80 GB, H100 NVL / RTX PRO 6000 96 GB, GH200-class 189 GB
TRAIN_VOCAB_COPIES = 9
INFER_VOCAB_COPIES = 7  # measured peak of a step of the base's own sampler (tests/posttrain/test_plan.py), self-conditioning logits apart
_GB = 1e9
DIFFUSION_GEMMA_TYPE = "diffusion_gemma"  # config.json's model_type of a DiffusionGemma checkpoint


def resolve_base_config(path: str, backbone: str = "diffusion-gemma") -> tuple[Any, str]:
    """The base's ``transformers`` config without downloading anything, and where it came from.

    Order: a local checkpoint directory, the Hugging Face cache, :data:`KNOWN_BASES`. Raises a one-line
    FileNotFoundError naming ``path`` when none has it, ValueError for a backbone kind other than
    DiffusionGemma's and for a checkpoint whose ``model_type`` is not ``diffusion_gemma`` (or whose
    ``config.json`` is not a JSON object).
    """
    if backbone != "diffusion-gemma":
        valid = ", ".join(["diffusion-gemma", *SEQUENCE_FAMILIES])
        raise ValueError(f"a plan needs a base of a known architecture (base.backbone {valid}), got {backbone!r}")
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import AutoConfig

    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"base {path!r} is a directory without config.json")
        check_base(path, model_type=DIFFUSION_GEMMA_TYPE)  # as loading it would: one line naming its model type
        return AutoConfig.from_pretrained(str(local), trust_remote_code=False), f"{local / 'config.json'}"
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        config = None
    if config is not None:
        if config.model_type != DIFFUSION_GEMMA_TYPE:
            raise ValueError(f"base model {path!r} is a {config.model_type!r} checkpoint; a plan needs a "
                             f"{DIFFUSION_GEMMA_TYPE!r} one")
        return config, f"the Hugging Face cache ({path})"
    if path in KNOWN_BASES:
        return KNOWN_BASES[path](), f"tadm's record of {path} (tadm.posttrain.backbone.diffusion_gemma_26b_config)"
    known = ", ".join(KNOWN_BASES)
    raise FileNotFoundError(f"base {path!r} cannot be resolved offline: it is no local directory, its config.json "
                            f"is not in the Hugging Face cache, and tadm knows the architecture of {known} only")


@dataclass
class MemoryEstimate:
    """Bytes per process by item; ``total`` is their sum."""

    what: str
    items: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    def by_column(self) -> dict[str, float]:
        """Bytes per table column (:data:`COLUMNS`): the items grouped by what they are."""
        out = {c: 0.0 for c in COLUMNS}
        for name, value in self.items.items():
            column = next((c for c, prefixes in _COLUMN_ITEMS.items() if name.startswith(prefixes)), "activations")
            out[column] += value
        return out

    def fits(self, gigabytes: float) -> bool:
        return self.total <= gigabytes * _GB


@dataclass(frozen=True)
class _LayerShape:
    """What the memory estimate needs of one decoder layer, read off its modules (meta tensors will do)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # sliding window, None for full attention
    ffn: int  # dense FFN width
    experts: int  # 0 without MoE
    expert_width: int


def _layer_shapes(backbone: DiffusionGemmaBackbone) -> list[_LayerShape]:
    shapes = []
    for layer in backbone.decoder.layers:
        attn = layer.self_attn
        head_dim = int(attn.head_dim)
        experts = getattr(layer, "experts", None)
        gate_up = getattr(experts, "gate_up_proj", None)
        shapes.append(_LayerShape(
            heads=attn.q_proj.out_features // head_dim, kv_heads=attn.k_proj.out_features // head_dim,
            head_dim=head_dim, window=getattr(attn, "sliding_window", None) or None,
            ffn=layer.mlp.gate_proj.out_features if hasattr(layer, "mlp") else 0,
            experts=int(gate_up.shape[0]) if gate_up is not None else 0,
            expert_width=int(gate_up.shape[1]) // 2 if gate_up is not None else 0))
    return shapes


def _kv_cache_bytes(backbone: DiffusionGemmaBackbone, batch: int, context: int, element: int) -> float:
    total = 0.0
    for shape in _layer_shapes(backbone):
        length = context if shape.window is None else min(context, shape.window)
        total += 2 * batch * length * shape.kv_heads * shape.head_dim * element
    return total


def _layer_activation_bytes(backbone: DiffusionGemmaBackbone, shape: _LayerShape, tokens: int, element: int) -> float:
    """What one decoder layer keeps for backward over ``tokens`` canvas tokens (module docstring)."""
    d = backbone.hidden_size
    per_token = 8 * d + 3 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim + 4 * shape.ffn
    if shape.experts:
        per_token += int(getattr(backbone.text_config, "top_k_experts", None) or 0) * (d + 4 * shape.expert_width)
        per_token += 2 * shape.experts * 2  # router logits and weights, float32
    return tokens * per_token * element


def _weights(model: AnchoredBackbone, dtype: torch.dtype) -> dict[str, float]:
    backbone = sum(p.numel() for p in model.backbone.parameters())
    fusion = sum(p.numel() for p in model.fusion.parameters())
    return {"backbone weights": backbone * dtype.itemsize, "fusion weights": fusion * 4.0}


def estimate_training_memory(model: AnchoredBackbone, *, micro_batch: int, prompt: int, canvas: int,
                             dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """One post-training step per process (module docstring); ``model`` may live on the meta device."""
    backbone, element = model.backbone, dtype.itemsize
    tokens = micro_batch * canvas
    vocab = micro_batch * canvas * backbone.vocab_size
    shapes = _layer_shapes(backbone)[model.anchor_end:]  # the denoiser layers
    items = _weights(model, dtype)
    items.update({
        "fusion gradients + AdamW moments (float32)": items["fusion weights"] * 3,
        "prompt KV cache": _kv_cache_bytes(backbone, micro_batch, prompt, element),
        "anchor cache [H0, C0] and shallow state": 3 * tokens * backbone.hidden_size * element,
        "denoiser activations kept for backward": sum(_layer_activation_bytes(backbone, shape, tokens, element)
                                                      for shape in shapes),
        "fusion activations": 24 * tokens * int(model.fusion.rank) * 4.0,
        f"vocabulary tensors ({TRAIN_VOCAB_COPIES} x float32 (B, L, V))": TRAIN_VOCAB_COPIES * vocab * 4.0,
    })
    return MemoryEstimate(f"training step, micro-batch {micro_batch}, prompt {prompt}, canvas {canvas}", items)


def estimate_inference_memory(model: AnchoredBackbone, *, batch: int, prompt: int, canvas: int,
                              new_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """Generation at ``batch`` (no gradients): weights, the KV cache of prompt + generated canvases, the anchor
    cache, the sampler step's vocabulary tensors and the self-conditioning logits, and what one layer's working
    set during a denoiser pass adds beyond the sampler step's peak (module docstring)."""
    backbone, element = model.backbone, dtype.itemsize
    context = prompt + (new_tokens if new_tokens is not None else canvas)
    tokens = batch * canvas
    vocab = batch * canvas * backbone.vocab_size
    widest = max(_layer_activation_bytes(backbone, shape, tokens, element) for shape in _layer_shapes(backbone))
    self_conditioning = vocab * element
    # Beside the raw and self-conditioning logits, which live through both, a pass holds the previous pass's
    # self-conditioning logits and a layer's working set, the sampler step its other INFER_VOCAB_COPIES - 1 copies.
    pass_excess = max(0.0, self_conditioning + widest - (INFER_VOCAB_COPIES - 1) * vocab * 4.0)
    items = _weights(model, dtype)
    items.update({
        "KV cache (prompt + generated canvases)": _kv_cache_bytes(backbone, batch, context, element),
        "anchor cache [H0, C0] and shallow state": 3 * tokens * backbone.hidden_size * element,
        "one layer's working set (beyond the sampler step's peak)": pass_excess,
        f"sampler vocabulary tensors ({INFER_VOCAB_COPIES} x float32 (B, L, V))": INFER_VOCAB_COPIES * vocab * 4.0,
        f"self-conditioning logits ({str(dtype).removeprefix('torch.')} (B, L, V))": self_conditioning,
    })
    return MemoryEstimate(f"inference, batch {batch}, prompt {prompt}, canvas {canvas}", items)


@dataclass
class PosttrainPlan:
    """What :func:`plan_posttrain` found: counts, split and memory estimates."""

    base: str
    source: str
    total_parameters: int
    backbone_parameters: int
    fusion_parameters: int
    split: tuple[int, int, int]
    estimates: list[MemoryEstimate]

    def table(self, sizes: tuple[int, ...] = GPU_SIZES_GB) -> str:
        """The plan as Markdown: parameters, split, then one memory row per estimate (GB by column)."""
        lines = [
            f"base: {self.base} (architecture from {self.source})",
            f"parameters: {self.total_parameters:,} total; {self.backbone_parameters:,} frozen backbone; "
            f"{self.fusion_parameters:,} trainable (the fusion)",
            f"layer split: shared {self.split[0]} / anchor {self.split[1]} / denoiser {self.split[2]}",
            "",
            "| per process | " + " | ".join(COLUMNS) + " | total | " + " | ".join(f"fits {g} GB" for g in sizes) + " |",
            "|---|" + "---:|" * (len(COLUMNS) + 1 + len(sizes)),
        ]
        for estimate in self.estimates:
            by_column = estimate.by_column()
            cells = [f"{by_column[c] / _GB:.2f}" for c in COLUMNS]
            fits = ["yes" if estimate.fits(g) else "no" for g in sizes]
            lines.append(f"| {estimate.what} | " + " | ".join(cells) + f" | **{estimate.total / _GB:.1f}** | "
                         + " | ".join(fits) + " |")
        lines += ["", "GB = 1e9 bytes, estimated (tadm.posttrain.plan); the CUDA context (about 0.5-1 GB) and "
                  "allocator slack come on top."]
        return "\n".join(lines)


def build_meta_model(config: Any, split: SplitSpec, fusion: FusionSpec) -> AnchoredBackbone:
    """The split base with its fusion on the meta device: shapes and counts, no weights, no memory."""
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
        return AnchoredBackbone(DiffusionGemmaBackbone(model), split, fusion)


def plan_posttrain(config: Any, *, inference_batches: tuple[int, ...] = (1, 8),
                   inference_prompt: int | None = None) -> PosttrainPlan:
    """The plan of a :class:`~tadm.posttrain.trainer.PosttrainConfig` (module docstring)."""
    if config.base.backbone in SEQUENCE_FAMILIES:
        return plan_sequence_posttrain(config, inference_batches=inference_batches, inference_prompt=inference_prompt)
    if config.base.backbone == "mdlm":
        return plan_mdlm_posttrain(config, inference_batches=inference_batches)
    base_config, source = resolve_base_config(config.base.path, config.base.backbone)
    model = build_meta_model(base_config, SplitSpec(**asdict(config.split)), FusionSpec(**asdict(config.fusion)))
    dtype = resolve_dtype(config.base.dtype, "cuda")
    canvas = int(config.data.canvas_length if config.data.canvas_length is not None else model.backbone.canvas_length)
    prompt = int(config.data.max_prompt_tokens)
    estimates = [estimate_training_memory(model, micro_batch=int(config.train.micro_batch_size), prompt=prompt,
                                          canvas=canvas, dtype=dtype)]
    infer_prompt = int(inference_prompt if inference_prompt is not None else prompt)
    for batch in inference_batches:
        estimates.append(estimate_inference_memory(model, batch=batch, prompt=infer_prompt, canvas=canvas,
                                                   new_tokens=int(config.data.max_response_tokens), dtype=dtype))
    backbone = sum(p.numel() for p in model.backbone.parameters())
    trainable = sum(p.numel() for p in model.fusion.parameters())
    s = model.layer_split
    return PosttrainPlan(os.fspath(config.base.path), source, backbone + trainable, backbone, trainable,
                         (s.shared, s.anchor, s.denoiser), estimates)


# ------------------------------------------------------------------------ sequence bases (LLaDA, Dream)
@dataclass(frozen=True)
class SequenceFamily:
    """What a plan needs of an architecture whose canvas is the whole sequence (module docstring)."""

    model_type: str  # config.json's model_type
    shape: Callable[[Mapping[str, Any]], DenseStackShape]  # config.json fields -> dense-stack shape
    sampler_bytes: int  # bytes per (position, vocabulary entry) at the sampler step's peak, temperature > 0


SEQUENCE_FAMILIES: dict[str, SequenceFamily] = {
    "llada": SequenceFamily("llada", llada_shape, sampler_bytes=44),
    "dream": SequenceFamily("Dream", dream_shape, sampler_bytes=27),
}
"""base.backbone -> its architecture: one line per family."""

KNOWN_SEQUENCE_BASES: dict[str, Callable[[], dict[str, Any]]] = {
    "GSAI-ML/LLaDA-8B-Base": llada_8b_config, "GSAI-ML/LLaDA-8B-Instruct": llada_8b_config,
    "Dream-org/Dream-v0-Base-7B": dream_7b_config, "Dream-org/Dream-v0-Instruct-7B": dream_7b_config,
}
"""Checkpoints whose ``config.json`` fields tadm records (checkpoint id -> the fields)."""

SEQUENCE_TRAIN_VOCAB_COPIES = TRAIN_VOCAB_COPIES - 1  # no self-conditioning logits


def resolve_sequence_config(path: str, backbone: str) -> tuple[dict[str, Any], str]:
    """The ``config.json`` fields of a LLaDA or Dream base (a local directory's, or tadm's record), and where from.

    Only JSON is read: the checkpoint's code is never imported. Raises a one-line FileNotFoundError
    naming ``path`` when neither has it, ValueError for a ``model_type`` of another family.
    """
    family = SEQUENCE_FAMILIES[backbone]
    local = Path(path).expanduser()
    if local.is_dir():
        file = local / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"base {path!r} is a directory without config.json")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            raise ValueError(f"base model {path!r}: {file} is not a valid JSON object") from None
        if not isinstance(config, dict) or config.get("model_type") != family.model_type:
            found = config.get("model_type") if isinstance(config, dict) else None
            raise ValueError(f"base model {path!r} is a {found!r} checkpoint; base.backbone {backbone} plans "
                             f"{family.model_type!r} ones")
        return config, str(file)
    if path in KNOWN_SEQUENCE_BASES:
        builder = KNOWN_SEQUENCE_BASES[path]
        if builder().get("model_type") != family.model_type:
            raise ValueError(f"base {path!r} is no {family.model_type} checkpoint; set base.backbone to its family")
        return builder(), f"tadm's record of {path} (tadm.posttrain.backbones.{builder.__name__})"
    known = ", ".join(k for k, b in KNOWN_SEQUENCE_BASES.items() if b().get("model_type") == family.model_type)
    raise FileNotFoundError(f"base {path!r} cannot be resolved offline: it is no local directory with a config.json, "
                            f"and tadm records the architecture of {known} only")


def _dense_layer_bytes(shape: DenseStackShape, tokens: int, element: int) -> float:
    """What one layer keeps for backward over ``tokens`` positions (the module docstring's per-token count)."""
    d, h = shape.hidden, shape.head_dim
    return tokens * (8 * d + 3 * shape.heads * h + 2 * shape.kv_heads * h + 4 * shape.ffn) * element


def _sequence_weights(shape: DenseStackShape, fusion: int, dtype: torch.dtype) -> dict[str, float]:
    return {"backbone weights": shape.parameters() * dtype.itemsize, "fusion weights": fusion * 4.0}


def estimate_sequence_training_memory(shape: DenseStackShape, *, fusion_parameters: int, rank: int,
                                      denoiser_layers: int, micro_batch: int, sequence: int,
                                      dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """One post-training step of a sequence base over ``sequence`` = prompt + canvas positions (module docstring)."""
    element, tokens = dtype.itemsize, micro_batch * sequence
    items = _sequence_weights(shape, fusion_parameters, dtype)
    items.update({
        "fusion gradients + AdamW moments (float32)": items["fusion weights"] * 3,
        "anchor cache [H0, C0] and shallow state": 3 * tokens * shape.hidden * element,
        "denoiser activations kept for backward": denoiser_layers * _dense_layer_bytes(shape, tokens, element),
        "fusion activations": 24 * tokens * rank * 4.0,
        f"vocabulary tensors ({SEQUENCE_TRAIN_VOCAB_COPIES} x float32 (B, S, V))":
            SEQUENCE_TRAIN_VOCAB_COPIES * tokens * shape.vocab * 4.0,
    })
    return MemoryEstimate(f"training step, micro-batch {micro_batch}, sequence {sequence}", items)


def estimate_sequence_inference_memory(shape: DenseStackShape, family: SequenceFamily, *, fusion_parameters: int,
                                       batch: int, sequence: int, dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """Generation at ``batch`` over ``sequence`` = prompt + new tokens: weights, the anchor cache, one layer's
    working set during a pass and the sampler step's vocabulary tensors (which do not overlap the pass)."""
    element, tokens = dtype.itemsize, batch * sequence
    items = _sequence_weights(shape, fusion_parameters, dtype)
    sampler = family.sampler_bytes * tokens * shape.vocab
    logits = 4.0 * tokens * shape.vocab  # a pass ends holding its float32 logits
    items.update({
        "anchor cache [H0, C0] and shallow state": 3 * tokens * shape.hidden * element,
        "one layer's working set (beyond the sampler step's peak)":
            max(0.0, _dense_layer_bytes(shape, tokens, element) + logits - sampler),
        f"sampler vocabulary tensors ({family.sampler_bytes} bytes per (position, entry))": sampler,
    })
    return MemoryEstimate(f"inference, batch {batch}, sequence {sequence}", items)


def plan_sequence_posttrain(config: Any, *, inference_batches: tuple[int, ...] = (1, 8),
                            inference_prompt: int | None = None) -> PosttrainPlan:
    """The plan of a post-training config whose base is a LLaDA or Dream checkpoint (module docstring)."""
    family = SEQUENCE_FAMILIES[config.base.backbone]
    fields_, source = resolve_sequence_config(os.fspath(config.base.path), config.base.backbone)
    shape = family.shape(fields_)
    split = SplitSpec(**asdict(config.split)).resolve(shape.layers)
    with torch.device("meta"):
        fusion = FusionSpec(**asdict(config.fusion)).build(shape.hidden)
    trainable = sum(p.numel() for p in fusion.parameters())
    dtype = resolve_dtype(config.base.dtype, "cuda")
    canvas = int(config.data.canvas_length if config.data.canvas_length is not None else config.data.max_response_tokens)
    prompt = int(config.data.max_prompt_tokens)
    estimates = [estimate_sequence_training_memory(
        shape, fusion_parameters=trainable, rank=int(config.fusion.rank), denoiser_layers=split.denoiser,
        micro_batch=int(config.train.micro_batch_size), sequence=prompt + canvas, dtype=dtype)]
    infer_prompt = int(inference_prompt if inference_prompt is not None else prompt)
    for batch in inference_batches:
        estimates.append(estimate_sequence_inference_memory(
            shape, family, fusion_parameters=trainable, batch=batch,
            sequence=infer_prompt + int(config.data.max_response_tokens), dtype=dtype))
    backbone = shape.parameters()
    return PosttrainPlan(os.fspath(config.base.path), source, backbone + trainable, backbone, trainable,
                         (split.shared, split.anchor, split.denoiser), estimates)


# ======================================================================================= MDLM family
MDLM_OWT = "kuleshov-group/mdlm-owt"
DIT_TOKEN_ACTIVATIONS = 18
"""Values of width d one DiT block keeps for backward per canvas token: the inputs of its norms and linear maps,
q, k and v and the attention output, and the MLP's 4d before and after the GELU come to about 18 with the
backbone frozen (held against measured peaks in ``tests/posttrain/test_plan.py``)."""
MDLM_TRAIN_VOCAB_COPIES = 10  # student logits and its SUBS steps, teacher logits, the KD term's softmaxes, gradients
MDLM_INFER_VOCAB_COPIES = 4  # a sampling step: the logits, SUBS's fill, log-softmax and scatter (measured peak)


def mdlm_owt_config() -> MDLMConfig:
    """MDLM-OWT as released (``kuleshov-group/mdlm-owt``, ``configs/model/small.yaml`` of kuleshov-group/mdlm):
    12 DiT blocks, d = 768, 12 heads, conditioning 128, vocabulary 50258 (GPT-2 + the mask), length 1024, no time
    conditioning (its released config.json); the released time input sigma(t)."""
    return MDLMConfig(vocab_size=50258, hidden_size=768, num_heads=12, cond_dim=128, mlp_ratio=4, dropout=0.1,
                      max_seq_len=1024, num_layers=12, time_conditioning=False, time_input="sigma-loglinear")


KNOWN_MDLM_BASES: dict[str, Callable[[], MDLMConfig]] = {MDLM_OWT: mdlm_owt_config}
"""MDLM-family bases whose sizes tadm knows without their ``config.json`` (checkpoint id -> config builder)."""


def resolve_mdlm_config(path: str) -> tuple[MDLMConfig, str]:
    """An MDLM base's sizes without reading weights: a local directory's ``config.json`` (tadm's or the released
    layout) or :data:`KNOWN_MDLM_BASES`; else a one-line FileNotFoundError naming ``path``."""
    local = Path(path).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        config_file = local / "config.json"
        raw = read_config(config_file)
        if is_released_mdlm_config(raw):
            return released_config(raw, str(config_file)), str(config_file)
        if raw.get(MODEL_TYPE_KEY) != "mdlm":
            raise ValueError(f"base model {path!r} is a {raw.get(MODEL_TYPE_KEY)!r} checkpoint; base.backbone mdlm "
                             "plans an 'mdlm' one")
        return config_from_dict(MDLMConfig, raw, source=str(config_file)), str(config_file)
    if path in KNOWN_MDLM_BASES:
        return KNOWN_MDLM_BASES[path](), f"tadm's record of {path} (tadm.posttrain.plan.mdlm_owt_config)"
    raise FileNotFoundError(f"base {path!r} cannot be resolved offline: it is no local directory with a config.json, "
                            f"and tadm knows the MDLM-family sizes of {', '.join(KNOWN_MDLM_BASES)} only")


def estimate_dit_training_memory(model: AnchoredBackbone, *, micro_batch: int, canvas: int,
                                 dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """One post-training step of a split MDLM-family DiT per process (module docstring)."""
    d, element = model.backbone.hidden_size, dtype.itemsize
    tokens = micro_batch * canvas
    vocab = tokens * model.backbone.vocab_size
    denoiser = model.layer_split.denoiser
    items = _weights(model, dtype)
    items.update({
        "fusion gradients + AdamW moments (float32)": items["fusion weights"] * 3,
        "anchor cache [H0, C0] and shallow state": 3 * tokens * d * element,
        "denoiser activations kept for backward": denoiser * DIT_TOKEN_ACTIVATIONS * tokens * d * element,
        "fusion activations": 24 * tokens * int(model.fusion.rank) * 4.0,
        f"vocabulary tensors ({MDLM_TRAIN_VOCAB_COPIES} x float32 (B, L, V))": MDLM_TRAIN_VOCAB_COPIES * vocab * 4.0,
    })
    return MemoryEstimate(f"training step, micro-batch {micro_batch}, canvas {canvas}", items)


def estimate_dit_inference_memory(model: AnchoredBackbone, *, batch: int, canvas: int,
                                  dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """Sampling one canvas per row at ``batch`` with a masked sampler (no gradients) per process."""
    d, element = model.backbone.hidden_size, dtype.itemsize
    tokens = batch * canvas
    vocab = tokens * model.backbone.vocab_size
    # a block's pass and the output step do not overlap: a layer's working set counts beyond the logits only
    # where it exceeds the step's other copies
    pass_excess = max(0.0, DIT_TOKEN_ACTIVATIONS * tokens * d * element - (MDLM_INFER_VOCAB_COPIES - 1) * vocab * 4.0)
    items = _weights(model, dtype)
    items.update({
        "anchor cache [H0, C0] and shallow state": 3 * tokens * d * element,
        "one layer's working set (beyond the sampling step's peak)": pass_excess,
        f"sampler vocabulary tensors ({MDLM_INFER_VOCAB_COPIES} x float32 (B, L, V))":
            MDLM_INFER_VOCAB_COPIES * vocab * 4.0,
    })
    return MemoryEstimate(f"inference, batch {batch}, canvas {canvas}", items)


def build_meta_mdlm(config: MDLMConfig, split: SplitSpec, fusion: FusionSpec) -> AnchoredBackbone:
    """The split MDLM with its fusion on the meta device: shapes and counts, no weights, no memory."""
    with torch.device("meta"):
        return AnchoredBackbone(MDLMBackbone(MDLM(config)), split, fusion)


def plan_mdlm_posttrain(config: Any, *, inference_batches: tuple[int, ...] = (1, 8)) -> PosttrainPlan:
    """The plan of a post-training config whose base is of the MDLM family (``base.backbone: mdlm``)."""
    mdlm_config, source = resolve_mdlm_config(os.fspath(config.base.path))
    model = build_meta_mdlm(mdlm_config, SplitSpec(**asdict(config.split)), FusionSpec(**asdict(config.fusion)))
    dtype = resolve_dtype(config.base.dtype, "cuda")
    canvas = int(config.data.canvas_length if config.data.canvas_length is not None else mdlm_config.max_seq_len)
    if canvas > mdlm_config.max_seq_len:
        raise ValueError(f"data.canvas_length {canvas} exceeds the base's length {mdlm_config.max_seq_len}")
    estimates = [estimate_dit_training_memory(model, micro_batch=int(config.train.micro_batch_size), canvas=canvas,
                                              dtype=dtype)]
    estimates += [estimate_dit_inference_memory(model, batch=batch, canvas=canvas, dtype=dtype)
                  for batch in inference_batches]
    backbone = sum(p.numel() for p in model.backbone.parameters())
    trainable = sum(p.numel() for p in model.fusion.parameters())
    s = model.layer_split
    return PosttrainPlan(os.fspath(config.base.path), source, backbone + trainable, backbone, trainable,
                         (s.shared, s.anchor, s.denoiser), estimates)
