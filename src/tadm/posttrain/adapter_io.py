"""Saving, loading and sharing the post-trained fusion apart from the (large, unchanged) backbone.

An adapter directory (or Hugging Face Hub repository) holds

* ``adapter_model.safetensors``: the fusion's parameters (about 3.1M at DiffusionGemma-26B's size),
  under PEFT's file name; the older ``adapter.safetensors`` still loads;
* ``adapter_config.json``: the base model it was trained on, the backbone kind, the layer split,
  the fusion's sizes and the backbone's layer count and hidden size, checked when it is attached;
* ``README.md`` (written by :func:`save_adapter_pretrained`): a model card whose YAML front matter
  names the base model and ``library_name: tadm``, with a table of measured K when one is given.

A base model plus an adapter rebuilds the post-trained model:
``attach_adapter(load_backbone("diffusion-gemma", base), "runs/posttrain/adapter")``. Every loader
takes a local directory or a Hub id (``"org/name"``), which :func:`resolve_adapter` fetches with
``huggingface_hub.snapshot_download``, so a copy in the local Hub cache also loads offline
(``HF_HUB_OFFLINE=1``). :func:`push_adapter_to_hub` uploads exactly the three files above.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from tadm.hf import first_line, is_connection_error, is_repo_id
from tadm.nn.hub import read_config
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec
from tadm.records import replace_atomically, write_text
from tadm.sampling.refresh import parse_refresh

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_FORMAT", "ADAPTER_WEIGHTS_NAME", "CARD_TAGS", "LEGACY_ADAPTER_WEIGHTS_NAME",
           "MODEL_CARD_NAME", "AdapterConfig", "CardResults", "adapter_weights_file", "attach_adapter",
           "load_adapter_config", "load_adapter_state", "load_fusion_state", "model_card", "push_adapter_to_hub", "resolve_adapter",
           "results_table", "save_adapter", "save_adapter_pretrained", "write_model_card"]

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's name, so Hub tooling recognises an adapter
LEGACY_ADAPTER_WEIGHTS_NAME = "adapter.safetensors"  # written before the rename; still read
ADAPTER_CONFIG_NAME = "adapter_config.json"
MODEL_CARD_NAME = "README.md"
ADAPTER_FORMAT = 1
# weights files of other libraries' adapters that hold pickles: named when found, never loaded
_PICKLE_WEIGHTS_NAMES = ("adapter_model.bin", "adapter.bin", "adapter_model.pt", "adapter.pt", "adapter_model.pth")
CARD_TAGS = ("tadm", "time-anchored-diffusion", "diffusion-language-model", "text-diffusion", "adapter")
"""Tags of every adapter's model card."""
_HUB_FILES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, LEGACY_ADAPTER_WEIGHTS_NAME, MODEL_CARD_NAME)


@dataclass
class AdapterConfig:
    """What an adapter was trained on and how it is shaped."""

    base_model: str
    backbone: str  # the architecture: "diffusion-gemma", "llada", "dream" or "mdlm"
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
    refresh_policy: dict[str, Any] | None = None  # the default refresh policy it is served with (None: K = 1)

    @property
    def split(self) -> SplitSpec:
        return SplitSpec(self.shared_layers, self.anchor_layers, self.denoiser_layers)

    @property
    def fusion(self) -> FusionSpec:
        return FusionSpec(rank=self.rank, num_heads=self.num_heads, eps=self.eps, gate_bias=self.gate_bias)


_BACKBONE_KINDS = {"DiffusionGemmaBackbone": "diffusion-gemma", "MDLMBackbone": "mdlm", "LLaDABackbone": "llada",
                   "DreamBackbone": "dream"}
"""Backbone adapter class -> the architecture name an adapter records (tadm.posttrain.architectures)."""


def _backbone_kind(model: AnchoredBackbone) -> str:
    name = type(model.backbone).__name__
    return _BACKBONE_KINDS.get(name, name)


def resolve_adapter(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> Path:
    """The local directory of an adapter given as a directory or a Hub id (``"org/name"``).

    A Hub id is fetched with ``huggingface_hub.snapshot_download`` (the adapter's files only), which
    answers from the local Hub cache when the Hub cannot be reached or ``HF_HUB_OFFLINE=1`` is set.
    A directory wins over a Hub id of the same spelling. Raises a one-line FileNotFoundError naming
    ``source`` when it is neither an existing directory nor a fetchable repository.
    """
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"adapter {text!r} is a file; pass the directory holding {ADAPTER_CONFIG_NAME}")
    if not is_repo_id(text):
        raise FileNotFoundError(f"adapter {text!r} does not exist (neither a directory nor a Hub id 'org/name')")
    try:
        folder = snapshot_download(repo_id=text, allow_patterns=list(_HUB_FILES), revision=revision,
                                   cache_dir=None if cache_dir is None else os.fspath(cache_dir), token=token,
                                   local_files_only=local_files_only)
    except Exception as err:  # the Hub raises many error types; every one means "not available here"
        raise FileNotFoundError(f"adapter {text!r} is not a local directory and could not be fetched from the "
                                f"Hugging Face Hub or found in its local cache: {first_line(err)}") from None
    return Path(folder)


def adapter_weights_file(directory: str | os.PathLike[str]) -> Path:
    """``adapter_model.safetensors`` in ``directory``, or the older ``adapter.safetensors`` when only that exists."""
    directory = Path(directory)
    for name in (ADAPTER_WEIGHTS_NAME, LEGACY_ADAPTER_WEIGHTS_NAME):
        if (directory / name).is_file():
            return directory / name
    pickled = next((directory / name for name in _PICKLE_WEIGHTS_NAMES if (directory / name).is_file()), None)
    if pickled is not None:
        raise FileNotFoundError(f"{directory} has no {ADAPTER_WEIGHTS_NAME} but {pickled}: tadm loads adapter weights "
                                "only from safetensors (loading a pickle can run any code); save the adapter with "
                                "tadm (save_adapter or save_pretrained)")
    raise FileNotFoundError(f"{directory} has no {ADAPTER_WEIGHTS_NAME} (nor the older {LEGACY_ADAPTER_WEIGHTS_NAME})")


def save_adapter(
    directory: str | os.PathLike[str],
    model: AnchoredBackbone,
    *,
    base_model: str,
    extra: dict[str, Any] | None = None,
    refresh_policy: dict[str, Any] | None = None,
) -> Path:
    """Write the fusion weights and ``adapter_config.json`` into ``directory`` (atomically per file).

    ``refresh_policy`` (a policy's ``config()`` mapping) is the default policy a loaded model serves with.

    An ``adapter.safetensors`` left there by an older save is removed, so that one weights file is read.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec, split = model.fusion_spec, model.layer_split
    config = AdapterConfig(
        base_model=str(base_model), backbone=_backbone_kind(model), num_layers=split.total,
        hidden_size=model.hidden_size, shared_layers=split.shared, anchor_layers=split.anchor,
        denoiser_layers=split.denoiser, rank=spec.rank, num_heads=spec.num_heads, eps=float(spec.eps),
        gate_bias=float(spec.gate_bias), extra=dict(extra or {}), refresh_policy=refresh_policy,
    )
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.fusion.state_dict().items()}
    weights = save(tensors, metadata={"format": "pt", "adapter_type": config.adapter_type})
    replace_atomically(directory / ADAPTER_WEIGHTS_NAME, lambda f: f.write(weights), fsync=False)
    (directory / LEGACY_ADAPTER_WEIGHTS_NAME).unlink(missing_ok=True)
    write_text(directory / ADAPTER_CONFIG_NAME, json.dumps(asdict(config), indent=2, sort_keys=True) + "\n")
    return directory


_POSITIVE_KEYS = ("num_layers", "hidden_size", "rank", "num_heads")  # integers >= 1
_COUNT_KEYS = ("shared_layers", "anchor_layers", "denoiser_layers")  # integers >= 0
_TEXT_KEYS = ("base_model", "backbone", "adapter_type")  # non-empty strings


def _check_adapter_values(path: Path, payload: dict[str, Any]) -> None:
    """Raise a one-line ValueError naming ``path`` and the key whose value an :class:`AdapterConfig` cannot hold."""
    def bad(key: str, valid: str) -> ValueError:
        return ValueError(f"{path}: {key!r} must be {valid}, got {payload[key]!r}")

    for key in _TEXT_KEYS:
        if not isinstance(payload[key], str) or not payload[key].strip():
            raise bad(key, "a non-empty string")
    for key, minimum in [(k, 1) for k in _POSITIVE_KEYS] + [(k, 0) for k in _COUNT_KEYS]:
        value = payload[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise bad(key, f"an integer >= {minimum}")
    for key, positive in (("eps", True), ("gate_bias", False)):
        value = payload[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                positive and value <= 0):
            raise bad(key, "a finite number > 0" if positive else "a finite number")
    if not isinstance(payload["extra"], dict):
        raise bad("extra", "a JSON object")
    if payload["refresh_policy"] is not None:
        try:
            parse_refresh(payload["refresh_policy"])
        except ValueError as err:
            raise ValueError(f"{path}: 'refresh_policy' is not a refresh policy ({err})") from None
    if payload["rank"] % payload["num_heads"]:
        raise ValueError(f"{path}: 'rank' {payload['rank']} must be divisible by 'num_heads' {payload['num_heads']}")
    layers = sum(payload[key] for key in _COUNT_KEYS)
    if layers != payload["num_layers"]:
        raise ValueError(f"{path}: 'shared_layers' + 'anchor_layers' + 'denoiser_layers' = {layers} must equal "
                         f"'num_layers' {payload['num_layers']}")


def load_adapter_config(directory: str | os.PathLike[str]) -> AdapterConfig:
    """Read ``adapter_config.json`` of a directory or Hub id.

    Invalid JSON, a payload that is not an object, an unknown or missing key and a value of the wrong
    type or range (counts and sizes are integers, ``eps`` a finite number > 0, ...) are one-line
    ValueErrors naming the file and the key.
    """
    path = resolve_adapter(directory) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_CONFIG_NAME}: not a tadm adapter directory")
    payload = read_config(path)
    if payload.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path}: unsupported adapter format {payload.get('format')!r} (expected {ADAPTER_FORMAT})")
    fields = AdapterConfig.__dataclass_fields__
    unknown = sorted(set(payload) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid keys: {sorted(fields)}")
    required = {name for name, f in fields.items() if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(payload))
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    values = {name: f.default for name, f in fields.items() if f.default is not MISSING}
    values = {**values, "extra": {}, "refresh_policy": None, **payload}  # the optional keys' defaults, checked too
    _check_adapter_values(path, values)
    return AdapterConfig(**values)


def load_adapter_state(directory: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The fusion's state dict from ``adapter_model.safetensors`` (or the older ``adapter.safetensors``) of
    ``directory``, a directory or Hub id.

    Only safetensors is read, so nothing is ever unpickled: a truncated or corrupt file, or one in
    another format (a pickle renamed ``.safetensors``), is a one-line ValueError naming the file.
    """
    path = adapter_weights_file(resolve_adapter(directory))
    try:
        return load_file(str(path), device=str(device))
    except SafetensorError as err:
        detail = first_line(err).removeprefix("Error while deserializing header: ")
        raise ValueError(f"adapter weights {path} is not a readable safetensors file ({detail}): it is truncated, "
                         "corrupt or in another format; save or download the adapter again") from None


def load_fusion_state(fusion: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Load an adapter's weights into ``fusion`` (in its dtype, on its device); missing or unexpected weights
    and wrong shapes are a one-line ValueError naming the adapter, and leave ``fusion`` unchanged."""
    directory = resolve_adapter(directory)
    expected = fusion.state_dict()
    state = load_adapter_state(directory, device=next(iter(expected.values())).device)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter {directory}: missing weights {missing}, unexpected weights {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"adapter {directory}: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)}")
    fusion.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def attach_adapter(
    backbone: nn.Module, directory: str | os.PathLike[str], *, fusion_mode: str = "paired"
) -> AnchoredBackbone:
    """Split ``backbone`` as the adapter in ``directory`` (a directory or Hub id) says and load its fusion
    weights (strict, shape-checked)."""
    directory = resolve_adapter(directory)
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


# ------------------------------------------------------------------------------------ model card
CardResults = str | Sequence[Mapping[str, Any]]
"""Measured results for a model card: a Markdown string, or rows such as
``[{"K": 1, "accuracy": 0.62, "tokens/s": 41.0}, {"K": 2, "accuracy": 0.61, "tokens/s": 63.5}]``."""


def _cell(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def results_table(card_results: CardResults) -> str:
    """Markdown for ``card_results``: a string as given; rows (mappings) as a table whose columns are
    the rows' keys in order of first appearance (a row without a key gets an empty cell)."""
    if isinstance(card_results, str):
        return card_results.strip()
    rows = list(card_results) if isinstance(card_results, Sequence) else None
    if not rows or not all(isinstance(row, Mapping) and row for row in rows):
        raise ValueError(f"card_results must be a Markdown string or a non-empty list of mappings such as "
                         f"{{'K': 2, 'accuracy': 0.61, 'tokens/s': 63.5}}; got {card_results!r}")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def model_card(
    config: AdapterConfig,
    *,
    num_parameters: int | None = None,
    card_results: CardResults | None = None,
    license: str | None = None,
    repo_id: str | None = None,
) -> str:
    """The ``README.md`` of an adapter: YAML front matter (``base_model`` when it is a Hub id,
    ``library_name: tadm``, :data:`CARD_TAGS`, ``license`` only when given), what the adapter is,
    how to use it, and the measured results table when ``card_results`` is given.

    A base recorded as a local path is no Hub id, even when spelled like one (``runs/base`` is an
    existing directory): the Hub would link the card to a repository of that name.
    """
    base = config.base_model
    front = ["---"]
    if is_repo_id(base) and not Path(base).expanduser().exists():
        front.append(f"base_model: {base}")
    front.append("library_name: tadm")
    if license:
        front.append(f"license: {license}")
    front += ["tags:"] + [f"- {tag}" for tag in CARD_TAGS] + ["---", ""]
    size = "" if num_parameters is None else f" ({num_parameters:,} parameters)"
    adapter = repo_id or "PATH_OR_HUB_ID_OF_THIS_ADAPTER"
    body = [
        f"# Time-anchored fusion adapter for {base}",
        "",
        (f"A paired-attention fusion{size} trained with TADM:Post-train on the frozen base `{base}` "
         f"({config.backbone}). The base's {config.num_layers} layers are split into {config.shared_layers} shared, "
         f"{config.anchor_layers} anchor and {config.denoiser_layers} denoiser layers: while generating, the anchor "
         "layers run only every K denoising steps and the fusion corrects their cached (stale) output with the "
         "current state. At K = 1 the output is the base model's own. Fusion: rank "
         f"{config.rank}, {config.num_heads} heads; its gate's bias was initialised at {config.gate_bias:g} before "
         "training."),
        "",
        "## Use it",
        "",
        "```python",
        "from tadm.posttrain import TimeAnchoredDiffusionGemma",
        "",
        f'model = TimeAnchoredDiffusionGemma.from_pretrained("{base}", adapter="{adapter}", refresh_interval=2)',
        "out = model.generate(**inputs)  # inputs from the base's tokenizer or processor",
        "```",
        "",
        (f"Files: `{ADAPTER_CONFIG_NAME}` (base, split, fusion sizes) and `{ADAPTER_WEIGHTS_NAME}` (the fusion "
         "only; the base is loaded from its own repository)."),
    ]
    if card_results is not None:
        body += ["", "## Results", "", results_table(card_results)]
    return "\n".join(front + body) + "\n"


def write_model_card(
    directory: str | os.PathLike[str],
    *,
    card_results: CardResults | None = None,
    license: str | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write ``README.md`` (:func:`model_card`) into a saved adapter directory; returns its path."""
    directory = Path(directory)
    config = load_adapter_config(directory)
    state = load_adapter_state(directory)
    text = model_card(config, num_parameters=sum(t.numel() for t in state.values()), card_results=card_results,
                      license=license, repo_id=repo_id)
    return write_text(directory / MODEL_CARD_NAME, text)


def save_adapter_pretrained(
    directory: str | os.PathLike[str],
    model: AnchoredBackbone,
    *,
    base_model: str,
    extra: dict[str, Any] | None = None,
    refresh_policy: dict[str, Any] | None = None,
    card_results: CardResults | None = None,
    license: str | None = None,
    repo_id: str | None = None,
) -> Path:
    """:func:`save_adapter` plus the model card ``README.md``: a folder ready for the Hub.

    ``card_results``: measured results for the card (see :data:`CardResults`), e.g. one row per K
    with accuracy and tokens/s; ``license``: written to the card only when given.
    """
    directory = save_adapter(directory, model, base_model=base_model, extra=extra, refresh_policy=refresh_policy)
    write_model_card(directory, card_results=card_results, license=license, repo_id=repo_id)
    return directory


def push_adapter_to_hub(
    repo_id: str,
    directory: str | os.PathLike[str],
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    card_results: CardResults | None = None,
    license: str | None = None,
    commit_description: str | None = None,
    create_pr: bool = False,
) -> Any:
    """Upload a saved adapter to the Hub repository ``repo_id`` (created if missing); returns the commit info.

    Exactly ``adapter_config.json``, ``adapter_model.safetensors`` and ``README.md`` are uploaded
    (an older ``adapter.safetensors`` goes up under the new name; training state and other files
    in ``directory`` stay local). The directory's ``README.md`` is used unless it has none or
    ``card_results``/``license`` are given, in which case the card is written afresh. A ``revision``
    branch is created first when missing (as ``transformers``' ``push_to_hub`` does). When the Hub
    cannot be reached (no network, ``HF_HUB_OFFLINE``), an OSError names ``repo_id`` and the endpoint.
    """
    source = Path(directory)
    config = load_adapter_config(source)  # refuses a folder that is no adapter before anything is created
    weights = adapter_weights_file(source)
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="tadm-adapter-") as staging:
        folder = Path(staging)
        shutil.copyfile(source / ADAPTER_CONFIG_NAME, folder / ADAPTER_CONFIG_NAME)
        shutil.copyfile(weights, folder / ADAPTER_WEIGHTS_NAME)
        card = source / MODEL_CARD_NAME
        if card.is_file() and card_results is None and license is None:
            shutil.copyfile(card, folder / MODEL_CARD_NAME)
        else:
            write_model_card(folder, card_results=card_results, license=license, repo_id=repo_id)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision is not None and not revision.startswith("refs/pr"):  # upload_folder needs the branch
                api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
            return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                                     commit_message=commit_message or f"Upload tadm adapter for {config.base_model}",
                                     commit_description=commit_description, create_pr=create_pr)
        except Exception as err:  # the Hub client raises many types; only "could not connect" is reworded here
            if not is_connection_error(err):
                raise
            raise OSError(f"could not push adapter {repo_id!r}: the Hugging Face Hub at {api.endpoint} cannot be "
                          f"reached ({first_line(err)})") from None
