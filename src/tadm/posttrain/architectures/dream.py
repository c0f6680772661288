"""Dream (``DreamModel``, Dream-org/Dream-v0-*-7B): where its parts live, for :func:`tadm.anchorize`.

Dream generates with its own ``diffusion_generate``, which calls ``model(x, attention_mask, tok_idx)``
once per step: the anchorized model starts a new generation (and record) at the start of every
``diffusion_generate`` call and marks one pass per forward call. Its logits predict the next position
(``diffusion_generate`` shifts them right by one): the ``subs-shifted`` parameterisation.
"""

from typing import Any

from torch import nn

from tadm.posttrain.architectures.spec import Architecture
from tadm.posttrain.backbones import DreamBackbone


def generation_steps(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """T of a ``diffusion_generate(inputs, generation_config, **kwargs)`` call: ``steps=``, else the config's."""
    if kwargs.get("steps") is not None:
        return int(kwargs["steps"])
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
    config = config if config is not None else getattr(model, "generation_config", None)
    steps = getattr(config, "steps", None)
    return None if steps is None else int(steps)


DREAM = Architecture(
    name="dream",
    class_names=("DreamModel",),
    model_types=("Dream",),
    layers="model.layers",
    embedding="model.embed_tokens",
    final_norm="model.norm",
    head="lm_head",
    token_argument="input_ids",
    parameterisation="subs-shifted",
    prior="mask",
    backbone=DreamBackbone,
    description='AutoModel.from_pretrained("Dream-org/Dream-v0-Instruct-7B", trust_remote_code=True)',
    generation_methods=("diffusion_generate",),
    rollout_sampler="dream-origin",
    generation_steps=generation_steps,
)
