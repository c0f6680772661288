"""Backbone adapters for layer-stack diffusion LMs that run over the whole sequence (prompt included).

* :mod:`~tadm.posttrain.backbones.llada` - LLaDA (``LLaDAModelLM``): x0 prediction at every position;
* :mod:`~tadm.posttrain.backbones.dream` - Dream (``DreamModel``): logits shifted right by one position.

Both wrap a model the user has loaded (tadm never runs code shipped with a checkpoint) through its
own modules, and read the padding mask of a batch from ``StackContext.attention_mask``.
:mod:`~tadm.posttrain.backbones.whole_sequence` holds what the two share;
:mod:`~tadm.posttrain.backbones.shape` describes their dense stacks analytically for planning.
"""

from tadm.posttrain.backbones.dream import DREAM_7B, DreamBackbone, dream_7b_config
from tadm.posttrain.backbones.llada import LLADA_8B, LLaDABackbone, llada_8b_config
from tadm.posttrain.backbones.shape import DenseStackShape

__all__ = ["DREAM_7B", "DenseStackShape", "DreamBackbone", "LLADA_8B", "LLaDABackbone", "dream_7b_config",
           "llada_8b_config"]
