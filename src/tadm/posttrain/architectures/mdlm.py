"""tadm's MDLM (:class:`tadm.nn.MDLM`, a DiT stack): where its parts live, for :func:`tadm.anchorize`.

tadm's samplers drive a network stage by stage (:func:`tadm.sampling.generate`), so an anchorized MDLM
is sampled through its stage view, ``generate(model.stage_view(), "mdlm", refresh_interval=K, ...)``;
its own ``forward(z_t, t)`` runs the cache too (one pass per call), for loops of the user's. Calling
tadm's samplers on the anchorized MDLM itself is refused (``compute_anchor``), since their stage calls
would bypass the cache.
"""

from tadm.posttrain.architectures.spec import Architecture
from tadm.posttrain.backbone import MDLMBackbone

MDLM = Architecture(
    name="mdlm",
    class_names=("tadm.nn.baselines.MDLM",),
    layers="blocks.blocks",
    embedding="embed",
    final_norm="head.norm_final",
    head="head.linear",
    token_argument="z_t",
    parameterisation="subs",
    prior="mask",
    backbone=MDLMBackbone,
    description='tadm.nn.load_model("DIR") (a tadm MDLM checkpoint)',
    rollout_sampler="mdlm",
)
