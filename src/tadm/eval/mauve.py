"""MAUVE between generated samples and held-out reference text, on the evaluator's features.

As in the reference setup (MAUVE with GPT-2 Large features, ``max_text_length`` 1,024), each text
is re-tokenized with the evaluator's tokenizer, truncated to its first ``max_tokens`` tokens, and
represented by the evaluator's last-layer hidden state at its last token (:func:`text_features`).
Which hidden state depends on the evaluator: for a Hugging Face evaluator it is ``hidden_states[-1]``,
after the final norm, as mauve-text takes it; for a tadm AR evaluator it is the last DiT block's
output before the output layer's norm (:func:`~tadm.eval.evaluator.evaluator_from_ar_model`). tadm
keeps the latter as it is, because moving it would change every MAUVE already reported with an
in-domain AR evaluator; compare MAUVE values only under the same evaluator.
The score itself always comes from the ``mauve-text`` package,
``mauve.compute_mauve(p_features=..., q_features=...)``, with P the reference and Q the samples;
its defaults are kept (``num_buckets="auto"`` = max(2, round(min(n_p, n_q) / 10)) clusters, PCA to
90% variance, k-means with 5 restarts, scaling factor 5, seed 25) unless overridden.

Small sample sets make MAUVE meaningless: with 16 texts per side "auto" falls back to 2 clusters
and scores barely move between very different sets. :func:`mauve_from_features` therefore refuses
fewer than ``min_samples`` texts on either side (default :data:`MAUVE_MIN_SAMPLES`, which gives at
least 5 clusters), and every result carries its sample and cluster counts for reports. "auto" gives
each cluster about 20 points (10 texts per side), below the 39 that faiss's k-means asks for, so faiss
prints "WARNING clustering N points to K centroids" on every call; tadm drops that one line, since the
counts are in every result, and passes anything else written to standard error through.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from tadm.eval.evaluator import Evaluator
from tadm.records import dataclass_record

__all__ = ["MAUVE_MIN_SAMPLES", "MAUVE_MISSING", "MauveResult", "mauve_from_features", "mauve_installed",
           "mauve_sample_problem", "mauve_score", "text_features"]

MAUVE_MIN_SAMPLES = 50  # per side; "auto" then uses >= 5 clusters (the reference uses 5,000 samples)
MAUVE_MISSING = "MAUVE needs mauve-text: pip install 'tadm[eval]'"
_FAISS_SIZE_WARNING = re.compile(r"WARNING clustering \d+ points to \d+ centroids: please provide at least \d+ "
                                 r"training points\n?")


def mauve_installed() -> bool:
    """Whether mauve-text (the eval extra) is installed, checked without importing it."""
    return importlib.util.find_spec("mauve") is not None


@contextlib.contextmanager
def _without_faiss_size_warning() -> Iterator[None]:
    """Standard error (file descriptor 2, where faiss's C++ code writes) minus faiss's too-few-points line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = _FAISS_SIZE_WARNING.sub("", caught.read().decode("utf-8", "replace"))
            if rest:
                sys.stderr.write(rest)


def mauve_sample_problem(num_samples: int, num_reference: int, min_samples: int = MAUVE_MIN_SAMPLES) -> str | None:
    """Why MAUVE would be meaningless for these counts (a one-line reason), or None if they suffice."""
    short = [f"{n} {what}" for n, what in ((num_samples, "samples"), (num_reference, "reference texts"))
             if n < min_samples]
    if not short:
        return None
    return (f"MAUVE needs at least {min_samples} samples and {min_samples} reference texts, got "
            f"{' and '.join(short)}")


@torch.no_grad()
def text_features(
    texts: Sequence[str],
    evaluator: Evaluator,
    *,
    max_tokens: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> np.ndarray:
    """Last-token, last-layer hidden state of each text: float32 array (N, D).

    ``max_tokens`` (default: the evaluator's context, at most 1,024) truncates each text's
    evaluator tokens from the right, like ``max_text_length`` of the reference.
    """
    if len(texts) == 0:
        raise ValueError("the text set is empty: MAUVE needs at least one text on each side")
    limit = evaluator.context_size if max_tokens is None else min(max_tokens, evaluator.context_size)
    encoded = [ids[:limit] for ids in evaluator.encode(texts)]
    empty = [n for n, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"text {empty[0]} has no evaluator tokens: cannot featurize an empty text")
    order = sorted(range(len(encoded)), key=lambda n: -len(encoded[n]))
    feats: list[np.ndarray | None] = [None] * len(encoded)
    for start in tqdm(range(0, len(order), batch_size), desc="MAUVE features", disable=not progress, leave=False):
        group = order[start : start + batch_size]
        ids, valid = evaluator.pad([encoded[n] for n in group])  # (b, n), (b, n)
        hidden = evaluator.forward(ids, valid.long(), hidden=True).hidden  # (b, n, D)
        assert hidden is not None
        for row, n in enumerate(group):
            feats[n] = hidden[row, len(encoded[n]) - 1].float().cpu().numpy()  # (D,)
    return np.stack(feats).astype(np.float32)  # type: ignore[arg-type]


@dataclass
class MauveResult:
    """A MAUVE score with the settings that produced it."""

    mauve: float
    frontier_integral: float
    num_buckets: int
    num_reference: int  # reference texts (P)
    num_samples: int  # generated texts (Q)

    def as_dict(self) -> dict[str, Any]:
        return dataclass_record(self)


def mauve_from_features(
    p_features: np.ndarray,
    q_features: np.ndarray,
    *,
    num_buckets: int | str = "auto",
    kmeans_num_redo: int = 5,
    kmeans_max_iter: int = 500,
    kmeans_explained_var: float = 0.9,
    mauve_scaling_factor: float = 5.0,
    seed: int = 25,
    min_samples: int = MAUVE_MIN_SAMPLES,
) -> MauveResult:
    """``mauve.compute_mauve(p_features=p, q_features=q, ...)``: P reference (n_p, D), Q samples (n_q, D).

    Raises:
        ValueError: fewer than ``min_samples`` rows on either side (the message names the minimum).
    """
    try:
        # deferred: mauve-text is an optional dependency (the eval extra; GPL-3.0, loaded only for MAUVE)
        import mauve
    except ImportError as err:
        raise ImportError(MAUVE_MISSING) from err
    p = np.asarray(p_features, dtype=np.float32)
    q = np.asarray(q_features, dtype=np.float32)
    if p.ndim != 2 or q.ndim != 2 or p.shape[1] != q.shape[1]:
        raise ValueError(f"features must be (n, D) arrays of one width, got {p.shape} and {q.shape}")
    if len(p) == 0 or len(q) == 0:
        raise ValueError("MAUVE needs at least one reference text and one sample")
    problem = mauve_sample_problem(len(q), len(p), min_samples)
    if problem is not None:
        raise ValueError(f"{problem}; generate more samples (or pass a lower minimum knowingly)")
    if isinstance(num_buckets, int) and num_buckets > len(p) + len(q):
        raise ValueError(f"num_buckets={num_buckets} exceeds the {len(p) + len(q)} texts to cluster")
    with _without_faiss_size_warning():
        out = mauve.compute_mauve(p_features=p, q_features=q, num_buckets=num_buckets,
                                  kmeans_num_redo=kmeans_num_redo, kmeans_max_iter=kmeans_max_iter,
                                  kmeans_explained_var=kmeans_explained_var,
                                  mauve_scaling_factor=mauve_scaling_factor, seed=seed, verbose=False)
    return MauveResult(
        mauve=float(out.mauve),
        frontier_integral=float(out.frontier_integral),
        num_buckets=int(out.num_buckets),
        num_reference=len(p),
        num_samples=len(q),
    )


def mauve_score(
    samples: Sequence[str],
    references: Sequence[str],
    evaluator: Evaluator,
    *,
    max_tokens: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
    **mauve_kwargs: Any,
) -> MauveResult:
    """MAUVE of generated ``samples`` against held-out ``references`` (texts), features from ``evaluator``.

    ``mauve_kwargs`` go to :func:`mauve_from_features` (``num_buckets``, ``seed``, ...).
    """
    if len(samples) == 0:
        raise ValueError("the sample set is empty: MAUVE needs at least one sample")
    if len(references) == 0:
        raise ValueError("the reference set is empty: MAUVE needs held-out reference text")
    kw = dict(max_tokens=max_tokens, batch_size=batch_size, progress=progress)
    p = text_features(references, evaluator, **kw)
    q = text_features(samples, evaluator, **kw)
    return mauve_from_features(p, q, **mauve_kwargs)
