"""Saving and loading the post-trained fusion apart from the (large, unchanged) backbone.

An adapter directory holds

* ``adapter.safetensors``: the fusion's parameters (about 3.1M at DiffusionGemma-26B's size);
* ``adapter_config.json``: the base model it was trained on, the backbone kind, the layer split,
  the fusion's sizes and the backbone's layer count and hidden size, checked when it is attached.

A base model plus an adapter directory rebuilds the post-trained model:
``attach_adapter(load_backbone("diffusion-gemma", base), "runs/posttrain/adapter")``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tadm.posttrain.backbone import load_backbone
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_FORMAT",
    "ADAPTER_WEIGHTS_NAME",
    "AdapterConfig",
    "attach_adapter",
    "load_adapter_config",
    "load_adapter_state",
    "save_adapter",
]

ADAPTER_WEIGHTS_NAME = "adapter.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_FORMAT = 1


@dataclass
class AdapterConfig:
    """What an adapter was trained on and how it is shaped."""

    base_model: str
    backbone: str  # "diffusion-gemma" or "mdlm"
    num_layers: int
    hidden_size: int
    shared_layers: int
    anchor_layers: int
    denoiser_layers: int
    rank: int
    num_heads: int
    eps: float
    gate_bias: float
    format: int = ADAPTER_FORMAT
    adapter_type: str = "paired-attention-fusion"
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. training step, config

    @property
    def split(self) -> SplitSpec:
        return SplitSpec(self.shared_layers, self.anchor_layers, self.denoiser_layers)

    @property
    def fusion(self) -> FusionSpec:
        return FusionSpec(rank=self.rank, num_heads=self.num_heads, eps=self.eps, gate_bias=self.gate_bias)


def _backbone_kind(model: AnchoredBackbone) -> str:
    name = type(model.backbone).__name__
    return {"DiffusionGemmaBackbone": "diffusion-gemma", "MDLMBackbone": "mdlm"}.get(name, name)


def save_adapter(
    directory: str | os.PathLike[str],
    model: AnchoredBackbone,
    *,
    base_model: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the fusion weights and ``adapter_config.json`` into ``directory`` (atomically per file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = model.fusion_spec
    split = model.layer_split
    config = AdapterConfig(
        base_model=str(base_model),
        backbone=_backbone_kind(model),
        num_layers=split.total,
        hidden_size=model.hidden_size,
        shared_layers=split.shared,
        anchor_layers=split.anchor,
        denoiser_layers=split.denoiser,
        rank=spec.rank,
        num_heads=spec.num_heads,
        eps=float(spec.eps),
        gate_bias=float(spec.gate_bias),
        extra=dict(extra or {}),
    )
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.fusion.state_dict().items()}
    tmp_weights = directory / (ADAPTER_WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt", "adapter_type": config.adapter_type})
    os.replace(tmp_weights, directory / ADAPTER_WEIGHTS_NAME)
    tmp_config = directory / (ADAPTER_CONFIG_NAME + ".tmp")
    tmp_config.write_text(json.dumps(asdict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp_config, directory / ADAPTER_CONFIG_NAME)
    return directory


def load_adapter_config(directory: str | os.PathLike[str]) -> AdapterConfig:
    """Read ``adapter_config.json``; unknown or missing keys are errors naming them."""
    path = Path(directory) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_CONFIG_NAME}: not a tadm adapter directory")
    payload = json.loads(path.read_text())
    if payload.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path}: unsupported adapter format {payload.get('format')!r} (expected {ADAPTER_FORMAT})")
    names = {f for f in AdapterConfig.__dataclass_fields__}
    unknown = sorted(set(payload) - names)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    try:
        return AdapterConfig(**payload)
    except TypeError as err:
        raise ValueError(f"{path}: {err}") from None


def load_adapter_state(directory: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The fusion's state dict from ``adapter.safetensors``."""
    path = Path(directory) / ADAPTER_WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_WEIGHTS_NAME}")
    return load_file(str(path), device=str(device))


def attach_adapter(
    backbone: nn.Module, directory: str | os.PathLike[str], *, fusion_mode: str = "paired"
) -> AnchoredBackbone:
    """Split ``backbone`` as the adapter says and load its fusion weights (strict, shape-checked)."""
    config = load_adapter_config(directory)
    num_layers = getattr(backbone, "num_layers", None)
    hidden = getattr(backbone, "hidden_size", None)
    if (num_layers, hidden) != (config.num_layers, config.hidden_size):
        raise ValueError(
            f"adapter {directory} was trained on a {config.num_layers}-layer backbone of hidden size "
            f"{config.hidden_size} ({config.base_model}); this backbone has {num_layers} layers of size {hidden}"
        )
    model = AnchoredBackbone(backbone, config.split, config.fusion, fusion_mode=fusion_mode)
    device = next(model.backbone.parameters()).device
    model.fusion.to(device)
    state = load_adapter_state(directory, device=device)
    expected = model.fusion.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter {directory}: missing weights {missing}, unexpected weights {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"adapter {directory}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    model.fusion.load_state_dict(state, strict=True)
    return model


def load_anchored(
    base: str | os.PathLike[str],
    *,
    backbone: str = "diffusion-gemma",
    adapter: str | os.PathLike[str] | None = None,
    split: SplitSpec | None = None,
    naive: bool = False,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
) -> tuple[AnchoredBackbone, str | None]:
    """A base model (Hub id or directory) split into stages, with the fusion of ``adapter`` if given.

    Without an adapter the base is split by ``split`` with an untrained fusion (useful with
    ``naive=True``: naive reuse of the cached anchor, no fusion). Returns the model in eval mode and
    a note when the adapter was trained on a base of another name (None otherwise).
    """
    loaded = load_backbone(backbone, base, dtype=dtype, device=device)
    mode = "naive" if naive else "paired"
    note = None
    if adapter is not None:
        config = load_adapter_config(adapter)
        if Path(config.base_model).name != Path(str(base)).name:
            note = f"adapter was trained on {config.base_model!r}, sampling on {str(base)!r}"
        model = attach_adapter(loaded, adapter, fusion_mode=mode)
    else:
        model = AnchoredBackbone(loaded, split if split is not None else SplitSpec(), fusion_mode=mode).to(device)
    return model.eval(), note

