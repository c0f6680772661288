"""Task evaluation: tadm's models on the field's benchmark harness, and the degeneration judge.

:mod:`~tadm.tasks.lm_eval_model` is the ``tadm`` model of EleutherAI's lm-evaluation-harness (sec.
"TADM:Post-train", the post-training table), on the command line through :mod:`~tadm.tasks.lm_eval_cli`
(``tadm-lm-eval``); :mod:`~tadm.tasks.judge` is the degeneration judge of the paper's appendix
"Generation corruption Evaluation Prompt" (corruption rate).

Install with ``pip install 'tadm[tasks]'``. Importing this package imports neither ``lm_eval`` nor
``transformers``; :func:`register_lm_eval_model` registers the ``tadm`` model with lm-eval.
"""

from __future__ import annotations

__all__ = ["register_lm_eval_model"]


def register_lm_eval_model() -> type:
    """Register the ``tadm`` model with lm-eval (idempotent) and return its class.

    Raises ImportError with the install hint when lm-eval is not installed.
    """
    try:  # deferred: lm_eval_model needs lm-eval, an optional dependency (the tasks extra)
        from tadm.tasks.lm_eval_model import TadmLM
    except ImportError as err:
        if getattr(err, "name", "") and str(err.name).startswith("lm_eval"):
            raise ImportError("the tadm lm-eval model needs lm-eval: pip install 'tadm[tasks]'") from err
        raise
    return TadmLM
