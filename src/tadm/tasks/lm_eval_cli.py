"""lm-eval's command line with the ``tadm`` model registered.

lm-eval (0.4.13) finds models only in its own registry, filled by importing the modules that
define them; it has no entry-point discovery. This wrapper imports :mod:`tadm.tasks.lm_eval_model`
(which registers ``tadm``) and runs lm-eval's own CLI with the same arguments::

    tadm-lm-eval --model tadm --model_args base=DIR,adapter=DIR,K=2 --tasks gsm8k --apply_chat_template
    python -m tadm.tasks.lm_eval_cli --model tadm --model_args model=tadm-tiny --tasks my_task --include_path DIR
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lm-eval`` with ``argv`` (default: the process's arguments) after registering ``tadm``."""
    from tadm.tasks import register_lm_eval_model

    register_lm_eval_model()
    from lm_eval.__main__ import cli_evaluate

    saved = list(sys.argv)
    if argv is not None:  # lm-eval's parser reads sys.argv
        sys.argv = [saved[0] if saved else "tadm-lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
