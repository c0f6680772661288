"""tadm: time-anchored diffusion language models.

``tadm.anchorize(model, split=(S, A), fusion=FusionSpec(...), refresh_interval=K)`` and
``tadm.AnchoredModel.from_pretrained(model, adapter=DIR_OR_HUB_ID, refresh_interval=K)`` put the anchor
cache into a loaded diffusion LM (:mod:`tadm.posttrain.anchorize`); ``tadm.FusionSpec`` sizes the fusion.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"anchorize": "tadm.posttrain.anchorize", "AnchoredModel": "tadm.posttrain.anchorize",
         "FusionSpec": "tadm.posttrain.model", "SplitSpec": "tadm.posttrain.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # deferred: importing tadm loads nothing (torch included) until these are named
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
