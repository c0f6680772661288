"""Saving, loading and naming models: ``save_pretrained`` / ``from_pretrained`` and the registries.

A saved model is a directory (or a Hugging Face Hub repository) holding

* ``config.json``: the model's config dataclass as JSON plus ``"model_type"`` ("tadm", "mdlm",
  "adlm" or "ar"), so that :func:`load_model` can rebuild the right class;
* ``model.safetensors``: the state dict;
* ``tokenizer.json`` and ``tadm_tokenizer.json`` (:data:`TADM_TOKENIZER_FILES`) when the model is saved with its
  tokenizer, so that a shared model can be sampled as text.

Every network in :mod:`tadm.nn` inherits :class:`HubMixin` (a thin layer over
``huggingface_hub.PyTorchModelHubMixin``, which also provides ``push_to_hub``) and gets a model card
(``README.md``: what the model is, its size, and how to load it)
and declares its ``model_type`` in the class statement, which files it in :data:`MODEL_CLASSES`.
Size presets ("tadm-small", "mdlm-tiny", ...) are plain builder functions filed in
:data:`MODEL_BUILDERS` with :func:`register_builder`; :func:`build_model` picks one by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_model as _load_safetensors
from safetensors.torch import save_model as _save_safetensors
from torch import nn

from tadm.hf import is_repo_id, local_parent

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TADM_TOKENIZER_FILES = ("tokenizer.json", "tadm_tokenizer.json")
"""A tadm tokenizer as ``TextTokenizer.save`` writes it (``tadm.training.tokenization``), kept beside the weights."""
MODEL_TYPE_KEY = "model_type"
HUB_OPTIONS = ("revision", "cache_dir", "token", "local_files_only", "force_download")  # go to hf_hub_download

MODEL_CLASSES: dict[str, type[HubMixin]] = {}
"""``model_type`` -> model class; filled by each class statement that names a ``model_type``."""

MODEL_BUILDERS: dict[str, Callable[..., nn.Module]] = {}
"""Preset name ("tadm-small", "mdlm-tiny", ...) -> builder ``f(**overrides) -> model``."""

_MODEL_MODULES = ("tadm.nn.tadm", "tadm.nn.baselines", "tadm.nn.released_mdlm")


@dataclass(frozen=True)
class ForeignLayout:
    """A checkpoint layout of another code base that :func:`load_model` reads (e.g. released MDLM checkpoints)."""

    name: str
    matches_config: Callable[[dict[str, Any]], bool]  # a parsed config.json in this layout?
    matches_file: Callable[[Path], bool]  # a single checkpoint file in this layout?
    load: Callable[..., nn.Module]  # f(name_or_path, device=..., Hub options) -> model


FOREIGN_LAYOUTS: dict[str, ForeignLayout] = {}
"""Layout name -> :class:`ForeignLayout`; filled by :func:`register_layout` when the reading module is imported."""


def register_layout(name: str, *, matches_config: Callable[[dict[str, Any]], bool],
                    matches_file: Callable[[Path], bool], load: Callable[..., nn.Module]) -> None:
    """File a foreign checkpoint layout that :func:`load_model` recognises and converts on load."""
    FOREIGN_LAYOUTS[name] = ForeignLayout(name, matches_config, matches_file, load)

TINY_SIZES: dict[str, Any] = dict(vocab_size=65, hidden_size=32, num_heads=2, cond_dim=16, dropout=0.0, max_seq_len=64)
"""Sizes shared by the "*-tiny" presets: 64 tokens + mask, d = 32, 2 heads, cond_dim 16, no dropout."""

MODEL_CARD_TEMPLATE = """---
{{ card_data }}
---

# A tadm `{{ model_type }}` model

{{ description }} with {{ num_parameters }} parameters, saved by tadm: `config.json` holds its
architecture and sizes, `model.safetensors` its weights. A model saved with its tokenizer holds it too
(`tokenizer.json`, `tadm_tokenizer.json`), and one trained by `tadm train` the config it was trained with
(`train_config.yaml`).

Load it with tadm (a directory or a Hub id):

```python
from tadm.nn import load_model

model = load_model("path/to/this/model")
```

or sample from it with `tadm sample --model path/to/this/model --prompt "Some text"`.
"""
MODEL_DESCRIPTIONS = {
    "tadm": "A time-anchored masked diffusion language model (an anchor network whose output is cached and reused "
            "for K reverse steps, fused with a denoiser that runs at every step)",
    "mdlm": "A masked diffusion language model",
    "adlm": "An anchored masked diffusion language model (anchor network and denoiser run at every step)",
    "ar": "An autoregressive Transformer language model",
}

M = TypeVar("M", bound="HubMixin")
F = TypeVar("F", bound=Callable[..., nn.Module])


class HubMixin(PyTorchModelHubMixin):
    """``save_pretrained`` / ``from_pretrained`` for a module whose ``__init__`` takes one config dataclass.

    Subclasses are declared as ``class TADM(nn.Module, HubMixin, model_type="tadm")``, set
    ``config_class`` to their config dataclass and store the config as ``self.config``.
    Loading is strict: unknown config keys, a different ``model_type``, and missing or unexpected
    weights are errors.

    The tokenizer travels with the model: ``save_pretrained(dir, tokenizer=tok)`` and
    ``push_to_hub(repo, tokenizer=tok)`` write it beside the weights, ``from_pretrained`` records where the
    saved one lies (``tokenizer_dir``, None without one) and a loaded model is saved or pushed with it
    unless another is given.
    """

    model_type: ClassVar[str]
    config_class: ClassVar[type]
    config: Any
    tokenizer_dir: Path | None = None  # the tokenizer saved with the checkpoint this model was loaded from

    def __init_subclass__(cls, *, model_type: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("library_name", "tadm")
        kwargs.setdefault("model_card_template", MODEL_CARD_TEMPLATE)
        if model_type is not None:
            kwargs.setdefault("tags", ["tadm", model_type])
        super().__init_subclass__(**kwargs)
        if model_type is not None:
            cls.model_type = model_type
            MODEL_CLASSES[model_type] = cls

    def generate_model_card(self, *args: Any, **kwargs: Any) -> Any:
        """The README.md that ``save_pretrained`` writes (unless one is there): what the model is and how to load it."""
        kwargs.setdefault("model_type", self.model_type)
        kwargs.setdefault("description", MODEL_DESCRIPTIONS.get(self.model_type, "A model"))
        count = sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]
        kwargs.setdefault("num_parameters", f"{count:,}")
        return super().generate_model_card(*args, **kwargs)

    def save_pretrained(self, save_directory: str | Path, *, tokenizer: Any = None, **kwargs: Any) -> str | None:
        """Write the model into ``save_directory`` (``huggingface_hub``'s ``save_pretrained``: ``push_to_hub=True``,
        ``repo_id``, ``model_card_kwargs``, ...), with ``tokenizer`` (anything with ``save(directory)``, such as
        a ``TextTokenizer``) or else the tokenizer it was loaded with, if any."""
        with self._saving(tokenizer):
            return super().save_pretrained(save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, *, tokenizer: Any = None, **kwargs: Any) -> Any:
        """Upload the model to the Hub repository ``repo_id`` (``huggingface_hub``'s ``push_to_hub``), with
        ``tokenizer`` or else the tokenizer it was loaded with, if any (see :meth:`save_pretrained`)."""
        with self._saving(tokenizer):
            return super().push_to_hub(repo_id, **kwargs)

    @contextmanager
    def _saving(self, tokenizer: Any) -> Iterator[None]:
        """Hold ``tokenizer`` for the ``_save_pretrained`` calls inside (push_to_hub saves in a nested call)."""
        if tokenizer is None:
            yield
            return
        if not callable(getattr(tokenizer, "save", None)):
            raise TypeError(f"tokenizer must have save(directory), as tadm's TextTokenizer has; got "
                            f"{type(tokenizer).__name__}")
        self._check_tokenizer_vocabulary(tokenizer)
        held = self.__dict__.get("_tokenizer_to_save")
        self.__dict__["_tokenizer_to_save"] = tokenizer
        try:
            yield
        finally:
            self.__dict__["_tokenizer_to_save"] = held

    def _check_tokenizer_vocabulary(self, tokenizer: Any) -> None:
        """A tokenizer whose ids the model cannot read is refused (the AR model's vocabulary may lack the mask)."""
        size, vocab = getattr(tokenizer, "vocab_size", None), int(getattr(self.config, "vocab_size"))
        fits = size is None or vocab == size or (getattr(self, "mask_token_id", 0) is None and vocab == size - 1)
        if not fits:
            raise ValueError(f"the tokenizer has {size} ids but the model's vocabulary has {vocab}: save the model "
                             "with the tokenizer it was trained with")

    def _save_pretrained(self, save_directory: Path) -> None:
        """Write ``model.safetensors``, ``config.json`` and the tokenizer, if any (called by ``save_pretrained``)."""
        save_directory = Path(save_directory)
        _save_safetensors(self, str(save_directory / WEIGHTS_NAME))  # type: ignore[arg-type]
        payload = {MODEL_TYPE_KEY: self.model_type, **dataclasses.asdict(self.config)}
        (save_directory / CONFIG_NAME).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        tokenizer, source = self.__dict__.get("_tokenizer_to_save"), self.tokenizer_dir
        if tokenizer is not None:
            tokenizer.save(save_directory)
        elif source is not None and Path(source).resolve() != save_directory.resolve():
            for name in TADM_TOKENIZER_FILES:
                shutil.copyfile(Path(source) / name, save_directory / name)

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls: type[M],
        pretrained_model_name_or_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        strict: bool = True,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
    ) -> M:
        """Load a model saved by ``save_pretrained`` from a local directory or a Hub repository id.

        Raises FileNotFoundError when neither a local directory nor a downloadable repository holds
        ``config.json`` and ``model.safetensors``; ValueError when ``config.json`` describes another
        model type or carries unknown keys. The model is returned in eval mode on ``device``.
        """
        hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                   force_download=force_download)
        config_file = resolve_file(pretrained_model_name_or_path, CONFIG_NAME, **hub)
        raw = read_config(config_file)
        found = raw.get(MODEL_TYPE_KEY)
        if found != cls.model_type:
            raise ValueError(
                f"{config_file} describes a model of type {found!r}, but {cls.__name__} loads "
                f"{cls.model_type!r}; use tadm.nn.load_model to pick the class from config.json"
            )
        config = config_from_dict(cls.config_class, raw, source=str(config_file))
        weights_file = resolve_file(pretrained_model_name_or_path, WEIGHTS_NAME, **hub)
        model = cls(config).to(device)  # type: ignore[call-arg]
        missing, unexpected = _load_weights(model, weights_file, device)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"{weights_file} does not match {cls.__name__}({config}): "
                f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}"
            )
        model.tokenizer_dir = saved_tokenizer_dir(pretrained_model_name_or_path, **hub)  # type: ignore[attr-defined]
        model.eval()  # type: ignore[attr-defined]
        return model


def saved_tokenizer_dir(name_or_path: str | Path, **hub: Any) -> Path | None:
    """The directory holding the tokenizer saved with a model (:data:`TADM_TOKENIZER_FILES`), or None without one.

    A local directory is looked into; from a Hub repository the files are downloaded (``hub``: as for
    :func:`resolve_file`) and their folder in the Hub cache is returned.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path if all((path / name).is_file() for name in TADM_TOKENIZER_FILES) else None
    if path.exists() or not is_repo_id(str(name_or_path)):
        return None
    try:  # the repository was reached for the weights: a file it lacks is "no tokenizer", not an error
        files = [Path(hf_hub_download(repo_id=str(name_or_path), filename=name, **hub)) for name in TADM_TOKENIZER_FILES]
    except EntryNotFoundError:
        return None
    return files[0].parent


def resolve_file(name_or_path: str | Path, filename: str, **hub: Any) -> Path:
    """Path of ``filename`` inside a saved-model directory, downloading it if a Hub id is given.

    ``hub``: ``huggingface_hub.hf_hub_download`` options (``revision``, ``cache_dir``, ``token``,
    ``local_files_only``, ``force_download``).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        found = path / filename
        if not found.is_file():
            raise FileNotFoundError(
                f"{found} does not exist; a saved model directory holds {CONFIG_NAME} and {WEIGHTS_NAME}"
            )
        return found
    if path.exists():
        raise FileNotFoundError(
            f"{path} is a file; pass the directory that holds {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    name = str(name_or_path)
    parent = local_parent(name)
    if parent is not None:  # "runs/typo" when runs/ is here: a path, not the Hub repository of user "runs"
        raise FileNotFoundError(f"model directory {name!r} does not exist (its folder {parent!r} does, so this is "
                                "a local path, not a Hub id)")
    if not is_repo_id(name):
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    try:
        downloaded = hf_hub_download(repo_id=name, filename=filename, **hub)
    except Exception as err:  # the Hub raises many error types; all mean "not available"
        raise FileNotFoundError(
            f"{name!r} is not a local directory, and {filename} could not be fetched from the "
            f"Hugging Face Hub repository {name!r}: {err}"
        ) from err
    return Path(downloaded)


def _load_weights(model: nn.Module, weights_file: str | Path, device: str | torch.device) -> tuple[Any, Any]:
    """Load ``model.safetensors`` into ``model`` (not strict); a truncated or corrupt file is a ValueError naming it."""
    try:
        return _load_safetensors(model, str(weights_file), strict=False, device=str(device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights_file} is not a readable safetensors file ({err}); it may be truncated or "
                         "corrupt: save or download the model again") from None


def read_config(config_file: str | Path) -> dict[str, Any]:
    """Parse a ``config.json``; invalid JSON or a non-object payload is a ValueError naming the file."""
    try:
        raw = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err.msg} at line {err.lineno}, "
                         f"column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{config_file} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def config_from_dict(config_class: type, raw: dict[str, Any], *, source: str = "config") -> Any:
    """Build ``config_class`` from a parsed ``config.json`` (``model_type`` dropped), rejecting unknown keys."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    values = {k: v for k, v in raw.items() if k != MODEL_TYPE_KEY}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(
            f"{source}: unknown {config_class.__name__} keys {unknown}; valid keys: {sorted(fields)}"
        )
    return config_class(**values)


def _import_models() -> None:
    # The model modules file their classes and builders when first imported.
    for module in _MODEL_MODULES:
        importlib.import_module(module)


def register_builder(name: str) -> Callable[[F], F]:
    """Decorator filing a size preset ``f(**overrides) -> model`` under ``name`` in MODEL_BUILDERS."""

    def decorate(builder: F) -> F:
        MODEL_BUILDERS[name] = builder
        return builder

    return decorate


def size_preset(name: str, model_class: type, doc: str, **preset: Any) -> Callable[..., nn.Module]:
    """File a builder ``f(**overrides) -> model_class(config_class(**preset, **overrides))`` under ``name``;
    an unknown override is a ValueError that lists the valid keys."""

    def builder(**overrides: Any) -> nn.Module:
        return model_class(config_from_dict(model_class.config_class, {**preset, **overrides}, source=name))

    builder.__name__ = builder.__qualname__ = name.replace("-", "_")
    builder.__doc__ = doc
    return register_builder(name)(builder)


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build the preset ``name`` (e.g. "tadm-small", "mdlm-tiny") with config ``overrides``."""
    _import_models()
    if name not in MODEL_BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODEL_BUILDERS))}")
    return MODEL_BUILDERS[name](**overrides)


def load_model(name_or_path: str | Path, **kwargs: Any) -> nn.Module:
    """Load any saved tadm model, choosing the class from ``config.json["model_type"]``.

    A checkpoint in a layout of another code base that tadm reads (:data:`FOREIGN_LAYOUTS`: released
    MDLM checkpoints, a Hub-layout directory or a Lightning ``.ckpt``) is converted on load.
    ``kwargs`` go to the class's ``from_pretrained`` (``device``, ``strict``, Hub options).
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not os.fspath(name_or_path):
        raise TypeError(f"load_model needs a checkpoint directory or a Hub id (owner/name), got {name_or_path!r}")
    _import_models()
    if os.fspath(name_or_path) in MODEL_BUILDERS and not Path(name_or_path).expanduser().exists():
        raise ValueError(f"{os.fspath(name_or_path)!r} is a size preset, not a saved model: build it with "
                         f"tadm.nn.build_model({os.fspath(name_or_path)!r}) (random weights), or load a checkpoint "
                         "directory or Hub id (owner/name)")
    local = Path(name_or_path).expanduser()
    for layout in FOREIGN_LAYOUTS.values():
        if local.is_file() and layout.matches_file(local):
            return layout.load(name_or_path, **kwargs)
    config_file = resolve_file(name_or_path, CONFIG_NAME, **{k: kwargs[k] for k in HUB_OPTIONS if k in kwargs})
    raw = read_config(config_file)
    for layout in FOREIGN_LAYOUTS.values():
        if layout.matches_config(raw):
            return layout.load(name_or_path, **kwargs)
    model_type = raw.get(MODEL_TYPE_KEY)
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"{config_file} names model_type {model_type!r}; valid model types: "
            f"{', '.join(sorted(MODEL_CLASSES))}"
        )
    return MODEL_CLASSES[model_type].from_pretrained(name_or_path, **kwargs)  # type: ignore[return-value]
