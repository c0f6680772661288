"""Load MDLM-family checkpoints as their authors release them into tadm's :class:`~tadm.nn.MDLM`.

MDLM (kuleshov-group/mdlm, ``models/dit.py``; the Hub checkpoint ``kuleshov-group/mdlm-owt``) and the
code bases built on its DiT (DUO, BD3-LM) release one network layout, the ``DIT`` of ``models/dit.py``:

===========================================  =====================================  ===========================
released name (under ``backbone.``)          shape                                  tadm name
===========================================  =====================================  ===========================
``vocab_embed.embedding``                    (vocab_size, hidden)                   ``embed.weight``
``sigma_map.mlp.{0,2}.{weight,bias}``        (cond, 256), (cond,), (cond, cond) ..  ``time_embed.mlp.*``
``rotary_emb.inv_freq`` (a buffer)           (head_dim / 2,)                        checked, not stored
``blocks.N.norm1.weight``, ``norm2.weight``  (hidden,)                              ``blocks.blocks.N.norm*``
``blocks.N.attn_qkv.weight``                 (3 hidden, hidden)                     ``blocks.blocks.N.qkv.weight``
``blocks.N.attn_out.weight``                 (hidden, hidden)                       ``blocks.blocks.N.attn_out``
``blocks.N.mlp.{0,2}.{weight,bias}``         (4 hidden, hidden) ...                 ``blocks.blocks.N.mlp.*``
``blocks.N.adaLN_modulation.{weight,bias}``  (6 hidden, cond), (6 hidden,)          same name
``output_layer.norm_final.weight``           (hidden,)                              ``head.norm_final.weight``
``output_layer.linear.{weight,bias}``        (vocab_size, hidden), (vocab_size,)    ``head.linear.*``
``output_layer.adaLN_modulation.*``          (2 hidden, cond), (2 hidden,)          ``head.adaLN_modulation.*``
===========================================  =====================================  ===========================

The mask token is the last id (vocab_size 50258 = GPT-2's 50257 + mask for MDLM-OWT). The blocks
compute what tadm's :class:`~tadm.nn.dit.DiTBlock` computes (weight-only LayerNorm, adaLN shift /
scale / gate in the order msa, mlp; rotate-half rotary on q and k; GELU(tanh)); the one convention
that differs is the time input: the released code embeds the total noise sigma(t) = -log(1 - (1 -
1e-3) t) of its log-linear schedule, so a loaded model sets ``time_input="sigma-loglinear"``
(without time conditioning, MDLM-OWT's setting, it sees sigma = 0 either way).

Two container layouts are read:

* **Hub** (``save_pretrained`` of the released ``transformers`` wrapper): a directory (or Hub id) with
  ``config.json`` (``model_type`` "mdlm"; ``vocab_size``, ``model_length``, ``hidden_dim``,
  ``cond_dim``, ``n_blocks``, ``n_heads``, ``dropout``, ``time_conditioning``) and
  ``model.safetensors`` (or ``pytorch_model.bin``) with every name under ``backbone.``;
* **Lightning** (``Trainer.save_checkpoint`` of the training code): one ``.ckpt`` file whose
  ``state_dict`` holds the ``backbone.`` names, ``ema["shadow_params"]`` the EMA weights as a list in
  the network's parameter order (what the released Hub weights were made from, and the default here),
  and ``hyper_parameters["config"]`` the Hydra config (``model.hidden_size``, ``model.n_heads``, ...).
  The file is read with ``torch.load(weights_only=True)`` when it holds tensors and plain containers
  only; a checkpoint that also pickles its config and tokenizer objects is read by an unpickler that
  imports nothing outside torch's tensor-rebuilding functions and plain containers: every other
  object (OmegaConf nodes, the tokenizer) becomes an inert record of its pickled state, no code of
  the checkpoint runs. The config is read back from those records.

Every weight is mapped key by key with its shape asserted against the tadm model built from the
config; weights the layout needs but the checkpoint lacks, weights it holds that the layout does not
have, and a wrong shape are each a one-line ValueError naming them.
"""

from __future__ import annotations

import io
import math
import pickle
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from tadm.nn.baselines import MDLM, MDLMConfig
from tadm.nn.hub import CONFIG_NAME, WEIGHTS_NAME, read_config, register_layout, resolve_file

__all__ = ["HUB_CONFIG_KEYS", "LoadedCheckpoint", "is_released_mdlm_config", "is_released_mdlm_source",
           "load_released_mdlm", "released_config",
           "read_lightning_checkpoint", "released_parameter_names"]

PREFIX = "backbone."
ROTARY_KEY = "rotary_emb.inv_freq"
ROTARY_BASE = 10_000.0
HUB_CONFIG_KEYS = ("vocab_size", "model_length", "hidden_dim", "cond_dim", "n_blocks", "n_heads", "dropout",
                   "time_conditioning")
"""The config names of the released Hub checkpoints (``MDLMConfig`` of the released modeling code)."""
# keys every transformers config.json carries besides the model's own
_HF_GENERIC_KEYS = {"architectures", "auto_map", "return_dict", "torch_dtype", "dtype", "transformers_version",
                    "_name_or_path", "model_type", "var_min"}
_LEGACY_WEIGHTS = "pytorch_model.bin"
_EMA, _LIVE = "ema", "live"


# ----------------------------------------------------------------------------------------- names
def released_parameter_names(num_layers: int) -> list[tuple[str, str]]:
    """(released name without ``backbone.``, tadm name) for every parameter, in the released DIT's parameter
    order (the order of ``model.parameters()``, which the EMA's ``shadow_params`` list follows)."""
    names = [("vocab_embed.embedding", "embed.weight")]
    names += [(f"sigma_map.mlp.{i}.{p}", f"time_embed.mlp.{i}.{p}") for i in (0, 2) for p in ("weight", "bias")]
    for n in range(num_layers):
        block = [("norm1.weight", "norm1.weight"), ("attn_qkv.weight", "qkv.weight"),
                 ("attn_out.weight", "attn_out.weight"), ("norm2.weight", "norm2.weight")]
        block += [(f"mlp.{i}.{p}", f"mlp.{i}.{p}") for i in (0, 2) for p in ("weight", "bias")]
        block += [(f"adaLN_modulation.{p}", f"adaLN_modulation.{p}") for p in ("weight", "bias")]
        names += [(f"blocks.{n}.{r}", f"blocks.blocks.{n}.{t}") for r, t in block]
    names += [("output_layer.norm_final.weight", "head.norm_final.weight")]
    names += [(f"output_layer.{m}.{p}", f"head.{m}.{p}") for m in ("linear", "adaLN_modulation")
              for p in ("weight", "bias")]
    return names


def is_released_mdlm_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a released MDLM-family one (not a tadm one, whose names differ)."""
    return raw.get("model_type") in ("mdlm", "bd3lm") and "n_blocks" in raw and "hidden_dim" in raw


def is_released_mdlm_source(path: str | Path) -> bool:
    """Whether a local ``path`` is a released MDLM-family checkpoint: a ``.ckpt`` file, or a directory whose
    ``config.json`` is in the released layout (:func:`is_released_mdlm_config`). Hub ids are not looked up."""
    local = Path(path).expanduser()
    if local.is_file():
        return local.suffix == ".ckpt"
    config_file = local / CONFIG_NAME
    if not config_file.is_file():
        return False
    try:
        return is_released_mdlm_config(read_config(config_file))
    except ValueError:
        return False


# ------------------------------------------------------------------------------ Lightning files
class _Inert:
    """What a pickled object of an unknown class becomes: its constructor arguments and state, nothing run."""

    global_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, {}

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:  # e.g. a stubbed getattr(cls, name) called in turn
        return type(self)(*args, **kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def __repr__(self) -> str:
        return f"<inert {self.global_name}>"


_PLAIN_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "int", "float", "complex", "bool", "str", "bytes",
                   "bytearray", "slice"}
_TORCH_REBUILDERS = {"_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"}


def _allowed_global(module: str, name: str) -> Any:
    """The real object for the few globals a tensor checkpoint needs (tensor rebuilders, dtypes, plain
    containers), else None."""
    if module in ("builtins", "__builtin__") and name in _PLAIN_BUILTINS:
        return getattr(__import__("builtins"), name)
    if (module, name) == ("collections", "OrderedDict"):
        return OrderedDict
    if (module, name) == ("_codecs", "encode"):  # how protocol 2 pickles bytes
        return __import__("codecs").encode
    if module == "torch._utils" and name in _TORCH_REBUILDERS:
        return getattr(torch._utils, name)
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return None


class _InertUnpickler(pickle.Unpickler):
    """Resolves only :func:`_allowed_global` names; any other class or function becomes an :class:`_Inert`
    subclass named after it, so that reading a checkpoint never imports or calls code it names."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_global(module, name)
        if found is not None:
            return found
        return type(name, (_Inert,), {"global_name": f"{module}.{name}"})


_INERT_PICKLE = types.ModuleType("tadm_inert_pickle")
_INERT_PICKLE.Unpickler = _InertUnpickler  # type: ignore[attr-defined]
_INERT_PICKLE.load = lambda f, **kw: _InertUnpickler(f, **kw).load()  # type: ignore[attr-defined]
_INERT_PICKLE.loads = lambda b, **kw: _InertUnpickler(io.BytesIO(b), **kw).load()  # type: ignore[attr-defined]


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning ``.ckpt`` as a dict, read without running any code it pickles (module docstring)."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # it pickles objects beyond tensors: its config, its tokenizer
        try:
            raw = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_INERT_PICKLE)
        except Exception as err:  # a damaged archive raises many types; all mean "unreadable"
            raise ValueError(f"{path} is not a readable PyTorch checkpoint ({type(err).__name__}: {err})") from None
    except (RuntimeError, EOFError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a Lightning checkpoint (a dict with a state_dict)")
    return raw


def _plain(value: Any, depth: int = 0) -> Any:
    """Plain dicts, lists and scalars from inert OmegaConf records (a DictConfig's ``_content``, a node's
    ``_val``); anything else is returned as it is."""
    if depth > 50:
        return None
    if isinstance(value, _Inert):
        state = value.state[0] if isinstance(value.state, tuple) and value.state else value.state
        if isinstance(state, dict) and "_content" in state:
            return _plain(state["_content"], depth + 1)
        if isinstance(state, dict) and "_val" in state:
            return _plain(state["_val"], depth + 1)
        return value
    if isinstance(value, dict):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return value


def _lookup(tree: Any, *paths: str) -> Any:
    """The first of the dotted ``paths`` present in nested dicts ``tree``, else None."""
    for dotted in paths:
        node = tree
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    return None


# ------------------------------------------------------------------------------------- results
@dataclass
class LoadedCheckpoint:
    """A released checkpoint loaded into a tadm MDLM, and what was read to get there."""

    model: MDLM
    source: str
    layout: str  # "hub" (config.json + safetensors) or "lightning" (.ckpt)
    weights: str  # "ema", "live" (a .ckpt's training weights) or "as saved" (a Hub file)
    config_from: str
    mapped: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (released, tadm, shape)
    checked: list[str] = field(default_factory=list)  # released buffers verified, not stored

    def describe(self) -> list[str]:
        """What was loaded, as lines for a person (``tadm convert`` prints them)."""
        c = self.model.config
        layout = ("Hub layout: config.json + weights file" if self.layout == "hub"
                  else "Lightning checkpoint: state_dict + ema + hyper_parameters")
        count = sum(math.prod(shape) for _, _, shape in self.mapped)
        return [
            f"loaded {self.source} as a released MDLM DiT ({layout}); weights: {self.weights}; "
            f"config from {self.config_from}",
            f"  {c.num_layers} blocks, hidden {c.hidden_size}, {c.num_heads} heads, cond {c.cond_dim}, "
            f"vocab {c.vocab_size} (mask id {c.resolved_mask_token_id}), length {c.max_seq_len}, "
            f"time conditioning {'on (embeds sigma(t))' if c.time_conditioning else 'off'}",
            f"  {len(self.mapped)} tensors ({count:,} parameters) mapped key by key, shapes asserted"
            + (f"; checked {', '.join(self.checked)}" if self.checked else ""),
        ]

    def mapping_lines(self) -> list[str]:
        """One line per weight: released name -> tadm name, shape."""
        return [f"  {released} -> {tadm} {tuple(shape)}" for released, tadm, shape in self.mapped]


# ------------------------------------------------------------------------------------- config
def _int_field(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def _hub_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """tadm MDLMConfig fields from a released Hub ``config.json``."""
    if raw.get("model_type") == "bd3lm":
        raise ValueError(f"{source} is a BD3-LM checkpoint (model_type 'bd3lm'): its DiT attends block-causally over "
                         "[x_t, x_0] (cross_attn), which tadm's MDLM does not implement; tadm loads MDLM-layout "
                         "checkpoints (model_type 'mdlm')")
    unknown = sorted(set(raw) - set(HUB_CONFIG_KEYS) - _HF_GENERIC_KEYS)
    if unknown:
        raise ValueError(f"{source}: config keys {unknown} are not in the released MDLM layout "
                         f"(keys: {', '.join(HUB_CONFIG_KEYS)})")
    missing = [key for key in ("vocab_size", "hidden_dim", "cond_dim", "n_blocks", "n_heads") if key not in raw]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)} of the released MDLM config")
    out = {"vocab_size": _int_field(raw, "vocab_size", source), "hidden_size": _int_field(raw, "hidden_dim", source),
           "cond_dim": _int_field(raw, "cond_dim", source), "num_layers": _int_field(raw, "n_blocks", source),
           "num_heads": _int_field(raw, "n_heads", source),
           "time_conditioning": bool(raw.get("time_conditioning", False))}
    if "model_length" in raw:
        out["max_seq_len"] = _int_field(raw, "model_length", source)
    if "dropout" in raw:
        out["dropout"] = float(raw["dropout"])
    return out


def released_config(raw: dict[str, Any], source: str = "config.json") -> MDLMConfig:
    """The tadm :class:`~tadm.nn.MDLMConfig` of a released Hub ``config.json`` (no weights read)."""
    fields = _hub_config(raw, source)
    fields.setdefault("max_seq_len", 1024)
    return MDLMConfig(**fields, time_input="sigma-loglinear")


def _lightning_config(hparams: Any, state: dict[str, Tensor], source: str) -> tuple[dict[str, Any], str]:
    """tadm MDLMConfig fields from a Lightning checkpoint: its Hydra config where readable, and the shapes of
    ``state`` (released names without the prefix)."""
    config = _plain(hparams.get("config")) if isinstance(hparams, dict) else None
    config = config if isinstance(config, dict) else {}
    parameterization = _lookup(config, "parameterization", "algo.parameterization")
    if parameterization not in (None, "subs"):
        raise ValueError(f"{source} was trained with parameterization {parameterization!r} (e.g. DUO's uniform-state "
                         "'mean'); tadm's MDLM is the masked SUBS parameterization")
    backbone = _lookup(config, "backbone", "algo.backbone")
    if backbone not in (None, "dit"):
        raise ValueError(f"{source} has backbone {backbone!r}; tadm loads the released DiT ('dit') only")
    out: dict[str, Any] = {}
    embedding = state.get("vocab_embed.embedding")
    if embedding is not None and embedding.dim() == 2:
        out["vocab_size"], out["hidden_size"] = int(embedding.shape[0]), int(embedding.shape[1])
    sigma = state.get("sigma_map.mlp.0.weight")
    if sigma is not None and sigma.dim() == 2:
        out["cond_dim"] = int(sigma.shape[0])
    blocks = {int(parts[1]) for parts in (k.split(".") for k in state) if parts[0] == "blocks" and parts[1].isdigit()}
    if blocks:
        out["num_layers"] = max(blocks) + 1
    for key, dotted in (("num_heads", "model.n_heads"), ("max_seq_len", "model.length"),
                        ("num_layers", "model.n_blocks"), ("hidden_size", "model.hidden_size"),
                        ("cond_dim", "model.cond_dim")):
        value = _lookup(config, dotted)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    dropout = _lookup(config, "model.dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool):
        out["dropout"] = float(dropout)
    conditioning = _lookup(config, "time_conditioning", "algo.time_conditioning")
    if isinstance(conditioning, bool):
        out["time_conditioning"] = conditioning
    where = "hyper_parameters.config and the weights' shapes" if config else "the weights' shapes"
    return out, where


# ------------------------------------------------------------------------------------- weights
def _strip_prefix(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """The ``backbone.`` names without the prefix; a name outside it is an extra weight (one line)."""
    outside = sorted(k for k in state if not k.startswith(PREFIX))
    if outside:
        raise ValueError(f"{source} holds weights outside the released layout's 'backbone.' prefix: "
                         f"{', '.join(outside[:8])}{' ...' if len(outside) > 8 else ''}")
    return {k[len(PREFIX):]: v for k, v in state.items()}


def _check_rotary(inv_freq: Tensor, head_dim: int, source: str) -> None:
    expected = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if tuple(inv_freq.shape) != tuple(expected.shape):
        raise ValueError(f"{source}: {PREFIX}{ROTARY_KEY} has shape {tuple(inv_freq.shape)}, but n_heads gives head "
                         f"dimension {head_dim}, which needs ({head_dim // 2},); is n_heads right?")
    if not torch.allclose(inv_freq.float().cpu(), expected, rtol=1e-5, atol=0.0):
        raise ValueError(f"{source}: {PREFIX}{ROTARY_KEY} is not the base-{ROTARY_BASE:g} rotary table tadm's DiT "
                         "uses; this checkpoint's rotary embedding differs")


def _map_weights(state: dict[str, Tensor], model: MDLM, source: str) -> tuple[dict[str, Tensor], list, list[str]]:
    """tadm state dict from released names (without the prefix), every shape asserted; missing and extra
    weights are one line each."""
    names = released_parameter_names(model.config.num_layers)
    target = model.state_dict()
    released = set(state) - {ROTARY_KEY}
    missing = [PREFIX + r for r, _ in names if r not in state]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"{source} is missing {len(missing)} weight(s) of the released MDLM layout "
                         f"({model.config.num_layers} blocks): {', '.join(missing[:8])}{more}")
    extra = sorted(released - {r for r, _ in names})
    if extra:
        raise ValueError(f"{source} holds {len(extra)} weight(s) the released MDLM layout "
                         f"({model.config.num_layers} blocks) does not have: "
                         f"{', '.join(PREFIX + k for k in extra[:8])}{' ...' if len(extra) > 8 else ''}")
    out, mapped = {}, []
    for released_name, tadm_name in names:
        tensor, want = state[released_name], target[tadm_name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{source}: {PREFIX}{released_name} has shape {tuple(tensor.shape)}, but the config "
                             f"({_sizes(model.config)}) needs {tuple(want.shape)} for {tadm_name}")
        out[tadm_name] = tensor
        mapped.append((PREFIX + released_name, tadm_name, tuple(tensor.shape)))
    checked = []
    if ROTARY_KEY in state:
        _check_rotary(state[ROTARY_KEY], model.config.hidden_size // model.config.num_heads, source)
        checked.append(PREFIX + ROTARY_KEY)
    return out, mapped, checked


def _sizes(config: MDLMConfig) -> str:
    return (f"n_blocks={config.num_layers}, hidden_dim={config.hidden_size}, n_heads={config.num_heads}, "
            f"cond_dim={config.cond_dim}, vocab_size={config.vocab_size}")


def _ema_state(ema: Any, live: dict[str, Tensor], num_layers: int, source: str) -> dict[str, Tensor]:
    """The EMA weights under their released names: ``shadow_params`` follows the network's parameter order."""
    shadow = ema.get("shadow_params") if isinstance(ema, dict) else None
    if not isinstance(shadow, (list, tuple)) or not all(isinstance(t, Tensor) for t in shadow):
        raise ValueError(f"{source}: its 'ema' entry has no list of shadow_params tensors; load weights='live'")
    names = [r for r, _ in released_parameter_names(num_layers)]
    if len(shadow) != len(names):
        raise ValueError(f"{source}: ema.shadow_params holds {len(shadow)} tensors, but the released layout with "
                         f"{num_layers} blocks has {len(names)} parameters")
    state = {name: tensor for name, tensor in zip(names, shadow)}
    if ROTARY_KEY in live:
        state[ROTARY_KEY] = live[ROTARY_KEY]
    return state


def _read_weights_file(directory_or_id: str | Path, hub: dict[str, Any]) -> tuple[dict[str, Tensor], Path]:
    try:
        path = resolve_file(directory_or_id, WEIGHTS_NAME, **hub)
    except FileNotFoundError:
        local = Path(directory_or_id).expanduser()
        if not (local / _LEGACY_WEIGHTS).is_file():
            raise
        path = local / _LEGACY_WEIGHTS
        return torch.load(path, map_location="cpu", weights_only=True), path
    try:
        return load_file(str(path)), path
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); it may be truncated or corrupt") from None


def _config_overrides(fields: dict[str, Any], *, num_heads: int | None, time_conditioning: bool | None,
                      max_seq_len: int | None) -> dict[str, Any]:
    for key, value in (("num_heads", num_heads), ("time_conditioning", time_conditioning),
                       ("max_seq_len", max_seq_len)):
        if value is not None:
            fields[key] = value
    return fields


def load_released_mdlm(
    source: str | Path,
    *,
    weights: str | None = None,
    num_heads: int | None = None,
    time_conditioning: bool | None = None,
    max_seq_len: int | None = None,
    device: str | torch.device = "cpu",
    **hub: Any,
) -> LoadedCheckpoint:
    """Load a released MDLM-family checkpoint (a Hub-layout directory or id, or a Lightning ``.ckpt``).

    Args:
        source: a directory holding ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``), a
            Hub id of one, or a ``.ckpt`` file.
        weights: for a ``.ckpt``: "ema" (the default when it has EMA weights, as the released Hub weights
            are made) or "live" (the training weights); a Hub file holds one set ("as saved").
        num_heads, time_conditioning, max_seq_len: override what the config says (a ``.ckpt`` whose
            config cannot be read needs ``num_heads``: the weights' shapes do not fix it).
        device: where the model goes; ``hub``: Hub download options (revision, cache_dir, token, ...).

    Returns:
        the model in eval mode with ``time_input="sigma-loglinear"``, and what was read.
    """
    text = str(source)
    path = Path(source).expanduser()
    if weights not in (None, _EMA, _LIVE):
        raise ValueError(f"weights must be 'ema' or 'live', got {weights!r}")
    if path.is_file():
        if path.suffix != ".ckpt":
            raise ValueError(f"{path} is a file: pass a Lightning .ckpt, or the directory holding "
                             f"{CONFIG_NAME} and {WEIGHTS_NAME}")
        ckpt = read_lightning_checkpoint(path)
        live = ckpt.get("state_dict")
        if not isinstance(live, dict) or not all(isinstance(v, Tensor) for v in live.values()):
            raise ValueError(f"{path} has no 'state_dict' of tensors: not a Lightning checkpoint")
        live = _strip_prefix(live, text)
        fields, config_from = _lightning_config(ckpt.get("hyper_parameters"), live, text)
        has_ema = ckpt.get("ema") is not None
        chosen = weights or (_EMA if has_ema else _LIVE)
        if chosen == _EMA and not has_ema:
            raise ValueError(f"{path} holds no EMA weights (no 'ema' entry); load weights='live'")
        layout = "lightning"
    else:
        if weights is not None:
            raise ValueError(f"{text} is a Hub-layout checkpoint with one set of weights; choosing ema or live weights "
                             "applies to a Lightning .ckpt only")
        config_file = resolve_file(source, CONFIG_NAME, **hub)
        raw = read_config(config_file)
        if not is_released_mdlm_config(raw):
            raise ValueError(f"{config_file} is not a released MDLM config (model_type 'mdlm' with hidden_dim, "
                             f"n_blocks, ...); a tadm model directory loads with tadm.nn.load_model")
        fields, config_from = _hub_config(raw, str(config_file)), str(config_file)
        state, weights_path = _read_weights_file(source, hub)
        live, chosen, layout = _strip_prefix(state, str(weights_path)), "as saved", "hub"
        text = str(weights_path) if not path.is_dir() else text
    fields = _config_overrides(fields, num_heads=num_heads, time_conditioning=time_conditioning,
                               max_seq_len=max_seq_len)
    if "num_heads" not in fields:
        raise ValueError(f"{text}: the number of attention heads cannot be read from its config or weights; "
                         "pass num_heads (MDLM-OWT: 12; `tadm convert --num-heads N`)")
    fields.setdefault("max_seq_len", 1024)
    config = MDLMConfig(**fields, time_input="sigma-loglinear")
    model = MDLM(config)
    state = _ema_state(ckpt["ema"], live, config.num_layers, text) if chosen == _EMA and layout == "lightning" else live
    mapped_state, mapped, checked = _map_weights(state, model, text)
    model.load_state_dict(mapped_state, strict=True)
    return LoadedCheckpoint(model=model.to(device).eval(), source=str(source), layout=layout, weights=chosen,
                            config_from=config_from, mapped=mapped, checked=checked)


def _load_for_registry(source: str | Path, **kwargs: Any) -> MDLM:
    kwargs.pop("strict", None)  # always strict
    return load_released_mdlm(source, **kwargs).model


register_layout("released-mdlm", matches_config=is_released_mdlm_config,
                matches_file=lambda path: path.suffix == ".ckpt", load=_load_for_registry)
