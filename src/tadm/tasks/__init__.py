"""Task evaluation: tadm's models on the field's benchmark harness, and the degeneration judge.

* :mod:`~tadm.tasks.lm_eval_model` - :class:`TadmLM`, the ``tadm`` model of EleutherAI's
  lm-evaluation-harness (``generate_until`` tasks; sec. "TADM:Post-train", the post-training table);
* :mod:`~tadm.tasks.lm_eval_cli` - ``tadm-lm-eval`` / ``python -m tadm.tasks.lm_eval_cli``:
  lm-eval's command line with the ``tadm`` model registered;
* :mod:`~tadm.tasks.generation` - prompted generation with a post-training base (+ adapter) or one
  of tadm's own models, and what each batch cost;
* :mod:`~tadm.tasks.model_args` - the model's settings (``--model_args``);
* :mod:`~tadm.tasks.stats` - per-request tokens, tokens/s and layer calls;
* :mod:`~tadm.tasks.judge` - the degeneration judge of the paper's appendix "Generation corruption
  Evaluation Prompt" (corruption rate), with :mod:`~tadm.tasks.judge_clients` (an
  OpenAI-compatible endpoint or a local ``transformers`` model) and :mod:`~tadm.tasks.verdict_cache`.

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
