"""A Mamba2 hybrid (Nemotron-H, Granite-4.0-H, Falcon-H1) on one tensor-parallel rank.

The rank's model is the family's own class built with the rank's local config
(distributed/mamba2_sharding.py): its mixers hold the rank's heads and groups, so `project` and
`core` run unchanged on the rank's heads and state-pool rows, and `pool_shapes` declares the rank's
conv / SSM state and KV heads. Modules are then swapped, keeping their parameter names
(distributed/parallel_layers.py):

    embedding          vocab-parallel lookup + all-reduce
    each layer's `reduce`   the all-reduce of its row-parallel partial sums: one per residual branch
                       (Nemotron-H: the block's mixer; Granite: mixer, then MoE + shared MLP together;
                       Falcon-H1: attention + Mamba2 together, then the MLP), before the multipliers
                       that scale the branch
    a mixer's gated norm    when the rank holds a fraction of one norm group: the sum of squares
                       all-reduced
    lm_head            the rank's vocab rows, all-gathered; the logits multipliers then apply to the
                       full logits, as in one process
"""

from __future__ import annotations

from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.parallel_layers import (
    AllReduce,
    SplitGroupGatedRMSNorm,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from forkpoint.distributed.sharding import ShardLayout
from forkpoint.models.mamba2 import Mamba2Mixer
from forkpoint.models.mamba2_lm import Mamba2HybridLM
from forkpoint.models.registry import model_class


def parallel_mamba2_model(layout: ShardLayout, group: TensorParallelGroup) -> Mamba2HybridLM:
    """The rank's model (parameters uninitialised, on the current default device); `forward` returns
    the full logits [R, vocab] on every rank."""
    local = layout.local_config()
    model = model_class(local)(local)
    hidden = local.hidden_size
    embedding = model.input_embeddings()
    name = next(name for name, child in model.model.named_children() if child is embedding)
    setattr(model.model, name, VocabParallelEmbedding(local.vocab_size, hidden, layout.vocab_start, group))
    model.lm_head = VocabParallelLMHead(hidden, local.vocab_size, group)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.input_embeddings().weight
    for layer in model.model.layers:
        layer.reduce = AllReduce(group)
    full = layout.config.mamba2.mamba
    if full.norm_groups % layout.world:  # each rank holds a fraction of one norm group
        share = layout.world // full.norm_groups
        for mixer in list(model.modules()):
            if isinstance(mixer, Mamba2Mixer) and mixer.norm is not None:
                mixer.norm = SplitGroupGatedRMSNorm(
                    mixer.intermediate, full.norm_eps, full.norm_before_gate, group, layout.rank // share,
                    full.norm_groups, full.intermediate_size // full.norm_groups)
    return model

