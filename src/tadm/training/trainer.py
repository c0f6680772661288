"""The pretraining loop: ``train(cfg) -> TrainResult`` (appendix "TADM:Pretrain", training details).

One call runs a whole experiment described by an :class:`~tadm.config.ExperimentConfig`:

1. tokenizer: a byte-level BPE trained on the corpus into ``out_dir/tokenizer`` (``data.tokenizer:
   bpe``, reused when present), GPT-2's (``gpt2``) or a saved one (a directory);
2. data: the corpus packed into blocks of ``data.seq_len`` (:mod:`tadm.training.data`), cached;
3. model: ``model.arch``-``model.preset`` with ``model.overrides``; the vocabulary comes from the
   tokenizer and ``max_seq_len`` defaults to ``data.seq_len``;
4. optimisation: AdamW, linear warmup then constant or cosine learning rate, gradient clipping,
   gradient accumulation up to ``train.global_batch_size`` (none when ``train.micro_batch_size`` is
   unset: each rank then takes global / world size sequences at once), bf16 autocast on CUDA, an EMA
   copy of the weights;
5. validation NELBO per token (and its perplexity bound ``exp``; for ``ar`` the exact NLL and perplexity)
   of the EMA model on ``train.eval_batches`` batches of ``train.eval_batch_size`` held-out blocks
   (default: the global batch size) at the start, every ``train.eval_every`` steps and at the end;
   the same weights give the same number whatever the world size and micro-batch size;
6. files in ``out_dir``: ``metrics.jsonl`` (and TensorBoard / W&B files, see ``train.loggers``),
   ``training_state.pt`` (every ``train.save_every`` steps and at the end; ``train(cfg,
   resume=True)`` continues from it), ``final/`` (EMA model, tokenizer, config) and optionally
   ``best/``.

The run directory is locked for the whole call (:class:`~tadm.training.rundir.RunDirLock`): a
second run on the same ``out_dir`` is refused, naming the holder. Leftovers of saves killed
midway are removed at start-up. A tokenizer found in ``out_dir/tokenizer`` is reused only if its
provenance record fits ``data`` (:mod:`tadm.training.provenance`); otherwise a resumed run stops, and a
fresh one (whose ``out_dir`` holds no run) trains a new one. Ctrl-C (SIGINT) on a single
process stops the run after the current step, saves the training state and raises
:class:`TrainingInterrupted`; a second Ctrl-C interrupts at once.

Randomness. The model is initialised from ``train.seed`` on every rank; afterwards the global
RNGs (dropout) are reseeded with ``seed + rank``. The diffusion noise of micro-batch ``j`` of a step
is drawn from its own generator seeded by ``(seed, step, global micro-batch index)``. With an explicit
``train.micro_batch_size`` it therefore does not depend on the number of processes; a derived one
(global / world size) changes the micro-batches, and so the noise, with the world size. A resumed
run draws exactly what an uninterrupted one does. Validation noise is keyed by the validation batch
alone (see :func:`evaluate`).
On CPU a resumed run reproduces the uninterrupted run's losses bit for bit.

Under ``torchrun`` the run is data-parallel (:mod:`tadm.training.distributed`): each rank takes its
slice of every global batch, only rank 0 writes files and prints.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from tadm.config import ConfigError, ExperimentConfig, check_resumable, short_run_warnings
from tadm.diffusion import get_schedule
from tadm.nn import TADM, build_model
from tadm.records import replace_atomically
from tadm.training.checkpoint import (STATE_FILENAME, STATE_FORMAT, capture_rng_state, load_training_state,
                                      restore_rng_state, save_model_dir, save_training_state)
from tadm.training.data import BlockSampler, PackedSplits, PackedTokens, build_packed_dataset, hashed_seed
from tadm.training.distributed import (DistInfo, all_gather_objects, all_reduce_mean, all_reduce_sum, barrier, cleanup,
                                       init_distributed, main_process_first, split_global_batch, wrap_model)
from tadm.training.ema import EMA
from tadm.training.lr import build_lr_scheduler
from tadm.training.metrics import METRICS_FILENAME, TENSORBOARD_DIRNAME, MetricsLogger
from tadm.training.objectives import LossOutput, ObjectiveConfig, get_objective, rare_token_mask, validation_config
from tadm.training.precision import autocast_context, uses_bf16
from tadm.training.provenance import TokenizerMismatchError, check_provenance, train_recorded_tokenizer
from tadm.training.rundir import claim_run_dir
from tadm.training.tokenization import META_FILENAME, TextTokenizer, check_vocab_compatible, load_tokenizer

__all__ = ["DataPreparationError", "NonFiniteLossError", "TrainResult", "TrainingInterrupted", "build_training_model",
           "evaluate", "objective_config", "prepare_tokenizer", "train"]

FINAL_DIRNAME = "final"
BEST_DIRNAME = "best"
TOKENIZER_DIRNAME = "tokenizer"
# Parts of the config a resumed run must share with the run it continues (the rest, e.g.
# train.max_steps, eval_every or log_every, may change between invocations).
_RESUME_FIXED = ("model", "data.source", "data.text_field", "data.tokenizer", "data.tokenizer_vocab_size",
                 "data.seq_len", "data.val_fraction", "objective", "optim", "train.global_batch_size",
                 "train.seed", "train.ema")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the step was not applied."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after a finished step, whose training state was saved (``--resume`` continues)."""

    def __init__(self, message: str, step: int, state_path: Path) -> None:
        super().__init__(message)
        self.step = step
        self.state_path = state_path


class DataPreparationError(ValueError):
    """The corpus or tokenizer could not be prepared (missing file or package, offline hub, ...)."""


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    out_dir: Path
    model_dir: Path  # out_dir/final: EMA model + tokenizer + train_config.yaml
    state_path: Path  # out_dir/training_state.pt
    start_step: int  # steps already done when this call began (0 unless resumed)
    step: int  # steps done at the end
    losses: list[float] = field(default_factory=list)  # train loss of steps start_step + 1, ..., step
    val_history: list[tuple[int, float]] = field(default_factory=list)  # (step, val NELBO per token)
    best_val_nelbo: float | None = None
    tokens_seen: int = 0
    wall_time_s: float = 0.0
    num_parameters: int = 0

    @property
    def val_nelbo(self) -> float | None:
        """Validation NELBO per token (nats) at the end of the run."""
        return self.val_history[-1][1] if self.val_history else None

    @property
    def val_ppl(self) -> float | None:
        """Perplexity bound exp(val NELBO) at the end of the run."""
        return math.exp(self.val_history[-1][1]) if self.val_history else None


# ================================================================================ building blocks
def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _noise_seed(seed: int, step: int, chunk: int, split: str = "train") -> int:
    """Seed of the diffusion noise of micro-batch ``chunk`` (global index) of optimizer step ``step``."""
    return hashed_seed("tadm-noise", split, seed, step, chunk)


def _noise_generator(seed: int, step: int, chunk: int, split: str = "train") -> torch.Generator:
    # A CPU generator: the diffusion functions draw on it and move the draws to the batch's device,
    # so CPU and CUDA runs see the same noise.
    return torch.Generator().manual_seed(_noise_seed(seed, step, chunk, split))


def prepare_tokenizer(cfg: ExperimentConfig, out_dir: Path, *, resume: bool = False,
                      notice: Callable[[str], None] | None = None) -> TextTokenizer:
    """The run's tokenizer (see the module docstring); a BPE tokenizer is trained once and reused.

    In a fresh run ``out_dir`` holds no run (:func:`train` checks this first), so a tokenizer found
    there that does not fit ``data`` is a leftover of a run that failed before its first save: it is
    replaced, with a ``notice``. A resumed run keeps its own tokenizer or stops, advising to resume on
    the corpus the tokenizer was trained on or to start a new run (``data.tokenizer`` may not change
    on a resume).

    Raises:
        TokenizerMismatchError: resuming, and ``out_dir/tokenizer`` was trained on another corpus or
            vocabulary size.
    """
    data = cfg.data
    if data.tokenizer != "bpe":
        return load_tokenizer(data.tokenizer)
    tok_dir = out_dir / TOKENIZER_DIRNAME
    if (tok_dir / META_FILENAME).is_file():
        if resume:  # the run's model was trained with this tokenizer, and data.* may not change on a resume
            advice = ("the run was trained with this tokenizer: resume on the corpus it was trained on, or start a new "
                      "run (train.overwrite=true, or another train.out_dir)")
        else:
            advice = (f"delete {tok_dir} to train a new one, start afresh with train.overwrite=true, or set "
                      f"data.tokenizer={tok_dir} to use it as it is")
        try:
            check_provenance(tok_dir, data.source, data.tokenizer_vocab_size, text_field=data.text_field,
                             advice=advice, missing_ok=resume)  # a run saved before provenance records existed
            return TextTokenizer.load(tok_dir)
        except TokenizerMismatchError as err:
            if resume:
                raise
            (notice or print)(f"{str(err).split('; ')[0]}: it was left by a run that saved nothing, "
                              "so a new one is trained")
            shutil.rmtree(tok_dir)
    return train_recorded_tokenizer(data.source, data.tokenizer_vocab_size, tok_dir, text_field=data.text_field)


def _token_counts(packed: PackedTokens, vocab_size: int) -> torch.Tensor:
    """(V,) int64 counts of every id in the packed blocks, cached beside them."""
    cache = packed.sidecar.with_name(f"{packed.meta['split']}.counts.npy")
    if cache.is_file():
        counts = np.load(cache)
        if counts.shape == (vocab_size,):
            return torch.from_numpy(counts)
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = 1 << 14
    for lo in range(0, len(packed), rows):
        counts += np.bincount(np.asarray(packed.array[lo : lo + rows]).ravel(), minlength=vocab_size)[:vocab_size]
    replace_atomically(cache, lambda f: np.save(f, counts))
    return torch.from_numpy(counts)


def objective_config(cfg: ExperimentConfig, anchor_token_mask: torch.Tensor | None = None) -> ObjectiveConfig:
    """The objective's own settings from the experiment config."""
    o = cfg.objective
    try:
        get_schedule(o.schedule)
    except ValueError as err:
        raise ConfigError(f"objective.schedule: {err}") from None
    return ObjectiveConfig(
        schedule=o.schedule,
        eps=o.eps,
        antithetic=o.antithetic,
        gamma=o.gamma,
        refresh_intervals=tuple(int(k) for k in o.refresh_intervals),
        step_budgets=tuple(int(T) for T in o.step_budgets),
        anchor_token_mask=anchor_token_mask,
    )


def build_training_model(cfg: ExperimentConfig, tokenizer: TextTokenizer) -> nn.Module:
    """``model.arch``-``model.preset`` with the tokenizer's vocabulary and ``max_seq_len >= data.seq_len``.

    Raises:
        ConfigError: an explicit ``vocab_size``/``mask_token_id``/``max_seq_len`` override that
            does not fit the tokenizer or ``data.seq_len``, an unknown override key, or an anchor
            loss (``objective.gamma > 0``) for a TADM without its anchor LM head.
    """
    arch = cfg.model.arch
    overrides = dict(cfg.model.overrides)
    vocab = tokenizer.vocab_size
    if overrides.get("vocab_size", vocab) != vocab:
        raise ConfigError(
            f"model.overrides.vocab_size={overrides['vocab_size']} does not match the tokenizer's "
            f"{vocab} tokens (mask included); drop the override to take the tokenizer's size"
        )
    overrides["vocab_size"] = vocab
    seq_len = cfg.data.seq_len
    if overrides.get("max_seq_len", seq_len) < seq_len:
        raise ConfigError(f"model.overrides.max_seq_len={overrides['max_seq_len']} < data.seq_len={seq_len}")
    overrides.setdefault("max_seq_len", seq_len)
    if arch == "tadm":
        # The anchor LM head serves only the anchor loss; without it every parameter gets a gradient.
        overrides.setdefault("anchor_lm_head", cfg.objective.gamma > 0)
        if cfg.objective.gamma > 0 and not overrides["anchor_lm_head"]:
            raise ConfigError("objective.gamma > 0 needs model.overrides.anchor_lm_head=true")
    name = f"{arch}-{cfg.model.preset}"
    try:
        model = build_model(name, **overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model {name} with overrides {dict(cfg.model.overrides)}: {err}") from None
    if arch != "ar":
        try:
            check_vocab_compatible(tokenizer, model.vocab_size, model.mask_token_id)  # type: ignore[arg-type]
        except ValueError as err:
            raise ConfigError(f"model.overrides: {err}") from None
    return model


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: PackedTokens,
    objective: Callable[..., LossOutput],
    cfg: ObjectiveConfig,
    *,
    batch_size: int,
    num_batches: int,
    seed: int,
    info: DistInfo | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    max_rows: int | None = None,
) -> float:
    """Loss per token over the first ``batch_size * num_batches`` blocks of ``data`` (fewer if it has fewer).

    Batch ``i`` always sees the same noise (a generator seeded by ``(seed, i)``), so successive
    evaluations differ only through the model. Under DDP whole batches are shared out round-robin
    and the sums reduced, so the result does not depend on the number of processes. ``max_rows``
    bounds the blocks run through the model at once: a larger batch is scored in pieces, its noise
    still drawn for the whole batch, so it changes the result only by float rounding. Returns nats
    per token.
    """
    info = info or DistInfo()
    device = next(model.parameters()).device
    n_blocks = min(len(data), batch_size * num_batches)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    was_training = model.training
    model.eval()
    try:
        for i, lo in enumerate(range(0, n_blocks, batch_size)):
            if i % info.world_size != info.rank:
                continue
            x = data.get_batch(range(lo, min(lo + batch_size, n_blocks))).to(device)  # (B, L)
            piece = x.shape[0] if max_rows is None else max_rows
            for start in range(0, x.shape[0], piece):
                rows = None if piece >= x.shape[0] else slice(start, start + piece)
                with autocast():
                    out = objective(model, x, _noise_generator(seed, 0, i, "val"), cfg, rows=rows)
                totals[0] += out.loss.double() * out.num_tokens
                totals[1] += out.num_tokens
    finally:
        model.train(was_training)
    totals = all_reduce_sum(totals, info)
    return (totals[0] / totals[1]).item()


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


# ====================================================================================== the loop
def train(cfg: ExperimentConfig, *, resume: bool = False) -> TrainResult:
    """Run (or, with ``resume``, continue) the experiment ``cfg``; see the module docstring.

    Raises:
        ConfigError: settings that do not fit together (batch sizes vs world size, vocabulary,
            an ``out_dir`` that already holds a run without ``resume``/``train.overwrite``, that is
            a file or read-only, a resumed run whose fixed settings changed, ``train.overwrite=true``
            where ``data.tokenizer`` or ``data.source`` lies in what it would delete). Subclasses:
            ``RunDirLockedError`` (another run holds ``out_dir``), ``TokenizerMismatchError``.
        CorruptStateError: the training state to resume from is truncated or corrupt.
        DataPreparationError: the corpus or tokenizer could not be loaded.
        NonFiniteLossError: the loss or gradient norm became NaN/inf; nothing of that step was
            applied or saved, and ``training_state.pt`` still holds the last good state.
        TrainingInterrupted: Ctrl-C; the state of the last finished step was saved.
    """
    info = init_distributed(cfg.train.device)
    try:
        # a batch-geometry error comes before anything touches out_dir
        micro, accum = split_global_batch(cfg.train.global_batch_size, info.world_size, cfg.train.micro_batch_size)
        with _claim_out_dir(cfg, resume, info):
            return _train(cfg, resume, info, micro, accum)
    finally:
        cleanup(info)


def _nothing_to_resume(state_path: Path) -> ConfigError:
    return ConfigError(f"nothing to resume: no training state at {state_path}")


@contextlib.contextmanager
def _claim_out_dir(cfg: ExperimentConfig, resume: bool, info: DistInfo) -> Iterator[None]:
    """Rank 0 checks ``train.out_dir`` (a directory, writable), holds its lock for the body and removes leftovers
    of killed saves; if it cannot, every rank raises its error (:func:`~tadm.training.rundir.claim_run_dir`)."""
    out_dir = Path(cfg.train.out_dir)

    def check() -> None:
        if resume and not out_dir.is_dir():
            raise _nothing_to_resume(out_dir / STATE_FILENAME)

    with claim_run_dir(out_dir, info, check=check) as cleaned:
        if cleaned:
            tqdm.write(f"removed {len(cleaned)} leftover(s) of interrupted saves: "
                       f"{', '.join(p.name for p in cleaned)}", file=sys.stdout)
        yield


@dataclass
class _Run:
    """One call of :func:`train`: its settings, data and model, and what changes from step to step."""

    cfg: ExperimentConfig
    info: DistInfo
    micro: int  # micro-batch size per rank (train.micro_batch_size, or derived from the world size)
    accum: int  # micro-batches per rank and optimizer step
    tokenizer: TextTokenizer
    splits: PackedSplits
    sampler: BlockSampler
    raw_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA | None
    objective: Callable[..., LossOutput]
    obj_cfg: ObjectiveConfig
    val_cfg: ObjectiveConfig
    start_step: int = 0
    best_val: float | None = None
    last_saved: int | None = None  # step of the newest training state on disk
    # set once the state is restored: the DDP-wrapped raw_model, the metrics files, the result
    model: nn.Module = field(init=False)
    metrics: MetricsLogger = field(init=False)
    result: TrainResult = field(init=False)

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.train.out_dir)

    @property
    def state_path(self) -> Path:
        return self.out_dir / STATE_FILENAME

    @property
    def eval_model(self) -> nn.Module:
        return self.ema.model if self.ema is not None else self.raw_model

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_context(self.info.device, self.cfg.train.precision)

    def say(self, message: str) -> None:
        """A rank-0 message that does not break the progress bar."""
        _Run.say_on(self.info)(message)

    @staticmethod
    def say_on(info: DistInfo) -> Callable[[str], None]:
        """:meth:`say` before the run is built."""
        return lambda message: tqdm.write(message, file=sys.stdout) if info.is_main else None


@dataclass
class _StepStats:
    """What one optimizer step reports."""

    loss: float
    lr: float
    grad_norm: float
    parts: dict[str, torch.Tensor]  # () rank-averaged loss parts, read (synchronised) only when logged


def _previous_state(cfg: ExperimentConfig, resume: bool) -> dict[str, Any] | None:
    """The state to continue from (``resume``), after checking that ``out_dir`` fits the request."""
    out_dir = Path(cfg.train.out_dir)
    state_path = out_dir / STATE_FILENAME
    if resume and cfg.train.overwrite:
        raise ConfigError("--resume continues the run in train.out_dir and train.overwrite=true deletes it; "
                          "give one of them")
    if resume and not state_path.is_file():
        raise _nothing_to_resume(state_path)
    if not resume and cfg.train.overwrite:
        _check_overwrite_keeps_inputs(cfg)
    if not resume and (state_path.exists() or (out_dir / FINAL_DIRNAME).exists()) and not cfg.train.overwrite:
        raise ConfigError(
            f"train.out_dir {str(out_dir)!r} already holds a run; pass --resume to continue it, "
            "train.overwrite=true to start afresh, or choose another train.out_dir"
        )
    if not resume:
        return None
    state = load_training_state(state_path)
    check_resumable(state["config"], cfg.to_dict(), _RESUME_FIXED, state_path)
    if int(state["step"]) > cfg.train.max_steps:
        raise ConfigError(
            f"the run in {str(out_dir)!r} has done {int(state['step'])} steps, more than train.max_steps="
            f"{cfg.train.max_steps}; its model is in {out_dir / FINAL_DIRNAME} (to continue, raise train.max_steps)"
        )
    return state


def _previous_run_paths(out_dir: Path) -> list[Path]:
    """What ``train.overwrite=true`` deletes in ``out_dir``: the files and folders of the run it held."""
    return [out_dir / name for name in (STATE_FILENAME, METRICS_FILENAME, FINAL_DIRNAME, BEST_DIRNAME,
                                        TOKENIZER_DIRNAME, TENSORBOARD_DIRNAME)]


def _check_overwrite_keeps_inputs(cfg: ExperimentConfig) -> None:
    """Refuse ``train.overwrite=true`` when ``data.tokenizer`` or ``data.source`` lies in what it would delete
    (e.g. ``data.tokenizer=OUT_DIR/final``), before anything is deleted."""
    out_dir = Path(cfg.train.out_dir)
    doomed = [p for p in _previous_run_paths(out_dir) if p.exists()]
    for key, value in (("data.tokenizer", cfg.data.tokenizer), ("data.source", cfg.data.source)):
        path = Path(value).expanduser()
        if not path.exists():
            continue
        holder = next((p for p in doomed if path.resolve().is_relative_to(p.resolve())), None)
        if holder is not None:
            raise ConfigError(
                f"{key}={value!r} lies in {holder}, which train.overwrite=true deletes with the previous run in "
                f"train.out_dir {str(out_dir)!r}; copy it out of {out_dir} first, or choose another train.out_dir"
            )


def _remove_previous_run(out_dir: Path) -> None:
    for stale in _previous_run_paths(out_dir):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _prepare_data(
    cfg: ExperimentConfig, info: DistInfo, resume: bool
) -> tuple[TextTokenizer, PackedSplits, torch.Tensor | None]:
    """Tokenizer, packed splits and (ADLM with an anchor loss) the anchor token mask; rank 0 first."""
    out_dir = Path(cfg.train.out_dir)
    anchor_mask = None
    with main_process_first(info):
        if info.is_main and not resume and cfg.train.overwrite:
            _remove_previous_run(out_dir)
        try:
            tokenizer = prepare_tokenizer(cfg, out_dir, resume=resume, notice=_Run.say_on(info))
            splits = build_packed_dataset(
                cfg.data.source,
                tokenizer,
                cfg.data.seq_len,
                cfg.data.cache_dir,
                cfg.data.val_fraction,
                seed=0,  # the held-out documents do not depend on train.seed
                text_field=cfg.data.text_field,
                progress=None if info.is_main else False,
            )
        except (ImportError, OSError, RuntimeError) as err:
            raise DataPreparationError(str(err).splitlines()[0] if str(err) else repr(err)) from err
        if cfg.model.arch == "adlm" and cfg.objective.gamma > 0:
            counts = _token_counts(splits.train, tokenizer.vocab_size)
            exclude = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id}
            anchor_mask = rare_token_mask(counts, cfg.objective.anchor_common_mass, sorted(exclude))
    return tokenizer, splits, anchor_mask


def _initial_model(cfg: ExperimentConfig, tokenizer: TextTokenizer, info: DistInfo) -> nn.Module:
    """The model with identical initial weights on every rank; afterwards the global RNGs follow the rank."""
    _seed_everything(cfg.train.seed)
    model = build_training_model(cfg, tokenizer).to(info.device)
    anchor_head = model.anchor_head if isinstance(model, TADM) else None
    if anchor_head is not None and cfg.objective.gamma == 0:
        # An anchor LM head kept on request (model.overrides.anchor_lm_head) gets no loss without
        # gamma; freezing it keeps it out of the optimizer and out of DDP's gradient reduction.
        anchor_head.requires_grad_(False)
    _seed_everything(cfg.train.seed + info.rank)
    return model


def _build_run(cfg: ExperimentConfig, resume: bool, info: DistInfo, micro: int, accum: int) -> _Run:
    """Data, sampler, model, objective, optimizer, learning-rate schedule and EMA of a fresh run."""
    tc, oc = cfg.train, cfg.optim
    tokenizer, splits, anchor_mask = _prepare_data(cfg, info, resume)
    try:
        sampler = BlockSampler(len(splits.train), tc.global_batch_size, seed=tc.seed, rank=info.rank,
                               world_size=info.world_size)
    except ValueError as err:
        raise ConfigError(f"train.global_batch_size={tc.global_batch_size} does not fit the data: {err}") from None
    raw_model = _initial_model(cfg, tokenizer, info)
    obj_cfg = objective_config(cfg, anchor_mask)
    optimizer = torch.optim.AdamW(
        [p for p in raw_model.parameters() if p.requires_grad],
        lr=oc.lr,
        betas=(oc.betas[0], oc.betas[1]),
        eps=oc.eps,
        weight_decay=oc.weight_decay,
    )
    scheduler = build_lr_scheduler(
        optimizer, warmup_steps=oc.warmup_steps, max_steps=tc.max_steps, schedule=oc.lr_schedule,
        min_lr_ratio=oc.min_lr_ratio,
    )
    return _Run(
        cfg=cfg, info=info, micro=micro, accum=accum, tokenizer=tokenizer,
        splits=splits, sampler=sampler, raw_model=raw_model, optimizer=optimizer, scheduler=scheduler,
        ema=EMA(raw_model, tc.ema) if tc.ema > 0 else None, objective=get_objective(cfg.model.arch),
        obj_cfg=obj_cfg, val_cfg=validation_config(obj_cfg),
    )


def _restore(run: _Run, state: dict[str, Any]) -> None:
    """Weights, optimizer, schedule, EMA, sampler, step and this rank's RNG streams from ``state``."""
    run.raw_model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["lr_scheduler"])
    if run.ema is not None:
        run.ema.load_state_dict(state["ema"])
    saved_blocks = int(state["sampler"]["num_blocks"])
    if saved_blocks != run.sampler.num_blocks:  # seed and global batch are fixed settings (_RESUME_FIXED)
        data = run.cfg.data
        raise ConfigError(
            f"cannot resume from {run.state_path}: the corpus {data.source!r} changed since the run was saved "
            f"({saved_blocks:,} -> {run.sampler.num_blocks:,} training blocks of {data.seq_len} tokens); resume on "
            "the corpus as it was, or start a new run (train.overwrite=true, or another train.out_dir)"
        )
    run.sampler.load_state_dict(state["sampler"])
    run.start_step = run.last_saved = int(state["step"])
    run.best_val = state["best_val_nelbo"]
    rng_states, info = state["rng"], run.info
    if len(rng_states) == info.world_size:
        restore_rng_state(rng_states[info.rank])
    else:  # a different world size: exact continuation is impossible, fresh streams per rank
        _seed_everything(run.cfg.train.seed + info.rank + 7919 * run.start_step)
        run.say(f"resuming on {info.world_size} ranks a run saved on {len(rng_states)}: dropout RNG streams reseeded")


def _report_setup(run: _Run, num_parameters: int) -> None:
    cfg, tc, info = run.cfg, run.cfg.train, run.info
    precision = "bf16 autocast" if uses_bf16(info.device, tc.precision) else "fp32"
    run.say(
        f"tadm train: {cfg.model.arch}-{cfg.model.preset} ({num_parameters / 1e6:.2f}M parameters, vocab "
        f"{run.tokenizer.vocab_size}) on {cfg.data.source!r}: {len(run.splits.train):,} train / "
        f"{len(run.splits.val):,} val blocks of {cfg.data.seq_len} tokens; global batch {tc.global_batch_size} = "
        f"{run.micro} x {info.world_size} rank(s) x {run.accum} accumulation"
        f"{' (micro-batch derived: global / world size)' if tc.micro_batch_size is None else ''}; {info.device}, "
        f"{precision}; out_dir {run.out_dir}"
    )
    for line in short_run_warnings(cfg.optim, tc):
        run.say(f"tadm train: warning: {line}")
    if run.start_step:
        run.say(f"resuming from step {run.start_step} ({run.state_path})")


def _record_val(run: _Run, step: int) -> None:
    """Validation NELBO of the evaluated (EMA) model at ``step``; the best model is saved on request."""
    tc, info = run.cfg.train, run.info
    nelbo = evaluate(run.eval_model, run.splits.val, run.objective, run.val_cfg,
                     batch_size=tc.eval_batch_size or tc.global_batch_size, num_batches=tc.eval_batches,
                     seed=tc.seed, info=info, autocast=run.autocast, max_rows=run.micro)
    run.result.val_history.append((step, nelbo))
    if not run.metrics.holds(step, "val"):  # a run resumed at its last step evaluates it again: log it once
        run.metrics.log(step, "val", {"nelbo": nelbo, "ppl": math.exp(min(nelbo, 700.0))})
    run.say(f"step {step}: {_val_text(run.cfg.model.arch, nelbo, math.exp(min(nelbo, 700.0)))}")
    if run.best_val is None or nelbo < run.best_val:
        run.best_val = run.result.best_val_nelbo = nelbo
        if tc.save_best and step > 0:
            if info.is_main:
                save_model_dir(run.eval_model, run.out_dir / BEST_DIRNAME, tokenizer=run.tokenizer, config=run.cfg)
            barrier(info)


def _save_state(run: _Run, step: int) -> None:
    """``training_state.pt`` at ``step`` (rank 0 writes, with every rank's RNG streams)."""
    info = run.info
    rng = all_gather_objects(capture_rng_state(), info)  # every rank's streams, for exact resumption
    if info.is_main:
        save_training_state(
            {
                "format": STATE_FORMAT,
                "step": step,
                "model": run.raw_model.state_dict(),
                "optimizer": run.optimizer.state_dict(),
                "lr_scheduler": run.scheduler.state_dict(),
                "ema": run.ema.state_dict() if run.ema is not None else None,
                "rng": rng,
                "sampler": run.sampler.state_dict(),
                "best_val_nelbo": run.best_val,
                "world_size": info.world_size,
                "config": run.cfg.to_dict(),
            },
            run.state_path,
        )
    barrier(info)
    run.last_saved = step


def _accumulate_gradients(run: _Run, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of this rank's micro-batches of ``step``; returns the summed loss and loss parts."""
    tc, info, micro, accum = run.cfg.train, run.info, run.micro, run.accum
    x_local = run.splits.train.get_batch(run.sampler.batch_indices(step)).to(info.device)  # (B_local, L)
    loss_sum = torch.zeros((), device=info.device)
    part_sums: dict[str, torch.Tensor] = {}
    for j in range(accum):
        x = x_local[j * micro : (j + 1) * micro]  # (micro, L)
        generator = _noise_generator(tc.seed, step, info.rank * accum + j)
        sync = contextlib.nullcontext() if (j == accum - 1 or not info.distributed) else run.model.no_sync()
        with sync:
            with run.autocast():
                out = run.objective(run.model, x, generator, run.obj_cfg)
            (out.loss / accum).backward()
        loss_sum += out.loss.detach().float()
        for k, v in out.parts.items():
            part_sums[k] = part_sums.get(k, 0.0) + v.float()
    return loss_sum, part_sums


def _non_finite(run: _Run, what: str, done: int) -> NonFiniteLossError:
    if run.last_saved is not None:
        hint = (f"the last good training state is {run.state_path} (step {run.last_saved}); continue with "
                "--resume after fixing the cause (e.g. a lower optim.lr)")
    else:
        hint = "no training state had been saved yet"
    return NonFiniteLossError(f"{what} at step {done}; stopped before applying it; {hint}", done)


def _train_step(run: _Run, step: int) -> _StepStats:
    """Optimizer step ``step + 1``: gradients, rank-averaged loss, clipping, update, schedule and EMA."""
    done, oc = step + 1, run.cfg.optim
    loss_sum, part_sums = _accumulate_gradients(run, step)
    stats = all_reduce_mean(torch.stack([loss_sum, *part_sums.values()]) / run.accum, run.info)
    loss = stats[0].item()
    if not math.isfinite(loss):
        raise _non_finite(run, f"training loss is {loss}", done)
    max_norm = oc.grad_clip if oc.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), max_norm).item()
    if not math.isfinite(grad_norm):
        raise _non_finite(run, f"gradient norm is {grad_norm}", done)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.raw_model)
    run.sampler.step = done
    run.result.step = done
    run.result.losses.append(loss)
    return _StepStats(loss=loss, lr=lr, grad_norm=grad_norm, parts=dict(zip(part_sums, stats[1:])))


def _log_step(run: _Run, done: int, stats: _StepStats, tokens_per_s: float, quiet_bar: bool, wall_start: float) -> None:
    tc = run.cfg.train
    run.metrics.log(done, "train", {"loss": stats.loss, **stats.parts, "lr": stats.lr, "grad_norm": stats.grad_norm,
                                    "tokens_per_s": tokens_per_s, "tokens_seen": done * run.tokens_per_step,
                                    "elapsed_s": time.perf_counter() - wall_start})
    if quiet_bar:
        eta = (tc.max_steps - done) * run.tokens_per_step / max(tokens_per_s, 1e-9)
        run.say(f"step {done}/{tc.max_steps} | loss {stats.loss:.4f} | lr {stats.lr:.2e} | {tokens_per_s:,.0f} tok/s | "
                f"eta {_fmt_time(eta)}")


@contextlib.contextmanager
def _stop_request(enabled: bool) -> Iterator[threading.Event]:
    """While active, the first Ctrl-C (SIGINT) sets the event, asking the loop to stop after the current step; a
    second one interrupts at once. Inactive (Ctrl-C interrupts at once) off the main thread and when ``enabled``
    is False (a distributed run, whose ranks would not agree on the step to stop at)."""
    requested = threading.Event()

    def handle(signum: int, frame: Any) -> None:
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        tqdm.write("Ctrl-C: stopping after this step and saving the training state (Ctrl-C again to abort now)",
                   file=sys.stderr)

    active = enabled and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, handle) if active else None
    try:
        yield requested
    finally:
        if active:
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def _run_steps(run: _Run, fresh: bool, wall_start: float) -> None:
    """The steps from ``run.start_step`` to ``train.max_steps`` with their logs, evaluations and saves; then
    validation and training state at the last step unless just done, and ``final/`` (rank 0)."""
    tc = run.cfg.train
    bar = tqdm(total=tc.max_steps, initial=run.start_step, unit="step", desc="train", dynamic_ncols=True,
               disable=None if run.info.is_main else True)
    try:
        if fresh:
            _record_val(run, 0)
        run.model.train()
        window_start, window_steps = time.perf_counter(), 0  # tokens/s are over the steps since the last log line
        last_eval = run.start_step if fresh else -1
        with _stop_request(enabled=not run.info.distributed) as stop:
            for done in range(run.start_step + 1, tc.max_steps + 1):
                stats = _train_step(run, done - 1)
                window_steps += 1
                tokens_per_s = window_steps * run.tokens_per_step / max(time.perf_counter() - window_start, 1e-9)
                bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
                bar.update(1)
                if done % tc.log_every == 0 or done == tc.max_steps:
                    _log_step(run, done, stats, tokens_per_s, bool(bar.disable), wall_start)
                    window_start, window_steps = time.perf_counter(), 0
                if done % tc.eval_every == 0:
                    _record_val(run, done)
                    last_eval = done
                if done % tc.save_every == 0:
                    _save_state(run, done)
                if stop.is_set() and done < tc.max_steps:
                    if run.last_saved != done:
                        _save_state(run, done)
                    raise TrainingInterrupted(f"interrupted at step {done}/{tc.max_steps}; training state saved to "
                                              f"{run.state_path}", done, run.state_path)
        bar.close()
        end = run.result.step
        if last_eval != end:
            _record_val(run, end)
        if run.last_saved != end:
            _save_state(run, end)
        if run.info.is_main:
            save_model_dir(run.eval_model, run.out_dir / FINAL_DIRNAME, tokenizer=run.tokenizer, config=run.cfg)
        barrier(run.info)
    finally:
        bar.close()
        run.metrics.close()


def _train(cfg: ExperimentConfig, resume: bool, info: DistInfo, micro: int, accum: int) -> TrainResult:
    wall_start = time.perf_counter()
    state = _previous_state(cfg, resume)
    run = _build_run(cfg, resume, info, micro, accum)
    if state is not None:
        _restore(run, state)
    run.model = wrap_model(run.raw_model, info)
    n_params = sum(p.numel() for p in run.raw_model.parameters())
    _report_setup(run, n_params)
    run.metrics = MetricsLogger(run.out_dir, enabled=info.is_main, loggers=cfg.train.loggers,
                                resume_step=run.start_step if state is not None else None, notice=run.say,
                                wandb_project=cfg.train.wandb_project, config=cfg.to_dict())
    run.result = TrainResult(out_dir=run.out_dir, model_dir=run.out_dir / FINAL_DIRNAME, state_path=run.state_path,
                             start_step=run.start_step, step=run.start_step, best_val_nelbo=run.best_val,
                             num_parameters=n_params)
    _run_steps(run, state is None, wall_start)
    result = run.result
    result.tokens_seen = result.step * run.tokens_per_step
    result.wall_time_s = time.perf_counter() - wall_start
    _summary(run)
    return result


def _val_text(arch: str, nelbo: float, ppl: float) -> str:
    """The validation loss in words: an autoregressive model's is its exact NLL, a diffusion model's a bound."""
    if arch == "ar":
        return f"val NLL {nelbo:.4f} nats/token, perplexity {ppl:.2f}"
    return f"val NELBO {nelbo:.4f} nats/token, perplexity bound {ppl:.2f}"


def _summary(run: _Run) -> None:
    result = run.result
    ran = result.step - run.start_step
    rate = ran * run.tokens_per_step / max(result.wall_time_s, 1e-9)
    recent = result.losses[-10:]
    lines = [f"done: {result.step} steps ({ran} in this run) in {_fmt_time(result.wall_time_s)}, "
             f"{result.tokens_seen:,} tokens seen, {rate:,.0f} tok/s overall"]
    if recent:
        lines.append(f"  train loss (mean of last {len(recent)} steps): {sum(recent) / len(recent):.4f}")
    if result.val_nelbo is not None:
        lines.append(f"  {_val_text(run.cfg.model.arch, result.val_nelbo, result.val_ppl)}"
                     + (f" (best {result.best_val_nelbo:.4f})" if result.best_val_nelbo is not None else ""))
    weights = "EMA" if run.ema is not None else "raw"
    lines.append(f"  model ({weights} weights + tokenizer + config): {result.model_dir}")
    lines.append(f"  training state (for --resume): {result.state_path}")
    run.say("\n".join(lines))
