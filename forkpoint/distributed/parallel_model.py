"""The Qwen3.5 / Qwen3-Next hybrid model on one tensor-parallel rank.

The rank's model is `HybridForCausalLM` built with the rank's local config (distributed/sharding.py):
its projections hold the rank's heads and intermediate columns, so `project` and `core` run unchanged
on the rank's heads and pool rows. Three parts differ:

    embed           vocab-parallel: each rank looks up the ids of its vocab share (others give zero
                    rows), then one all-reduce (exact: every row is one rank's value plus zeros); image
                    tokens then take the vision tower's rows, which rank 0 (the only rank with the
                    tower) encoded and broadcast (distributed/images.py)
    finish          the mixer's output projection and the MLP's down projection are row-parallel:
                    each yields a partial sum, all-reduced once per block (attention or GDN, then MLP;
                    a MoE block's routed and shared experts share one all-reduce)
    compute_logits  each rank's lm_head rows give its vocab share; all-gathered into [R, vocab]
"""

from __future__ import annotations

import torch

from forkpoint.config import ModelConfig
from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.parallel_layers import vocab_parallel_lookup
from forkpoint.models.qwen3_5 import (
    AttentionProjection,
    GDNProjection,
    HybridForCausalLM,
)


class ParallelHybridForCausalLM(HybridForCausalLM):
    """`HybridForCausalLM` on one rank: `config` is the rank's local config, `vocab_start` the first
    vocab id of its embedding / lm_head rows; `forward` returns the full logits [R, vocab] on every rank.
    `with_vision`: this rank holds the whole vision tower (rank 0 of an engine that serves images)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, vocab_start: int, *,
                 with_vision: bool = False) -> None:
        super().__init__(config, with_vision=with_vision)
        self.group = group
        self.vocab_start = vocab_start

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              embedding_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """As `HybridForCausalLM.embed`: input_ids [T] long (full vocab ids); the overrides are the same
        on every rank."""
        hidden = vocab_parallel_lookup(input_ids, self.model.embed_tokens.weight, self.vocab_start, self.group)
        if embedding_overrides is not None:  # image tokens take the vision tower's rows
            index, embeds = embedding_overrides
            hidden = hidden.index_copy(0, index, embeds.to(hidden.dtype))
        return hidden, self.rotary.cos_sin(positions, hidden.dtype)

    def finish(self, layer_id: int, residual: torch.Tensor, p: GDNProjection | AttentionProjection,
               core: torch.Tensor) -> torch.Tensor:
        """As `HybridForCausalLM.finish`, the two row-parallel partial sums all-reduced."""
        layer = self.model.layers[layer_id]
        if layer.is_recurrent:
            mixer_out = layer.linear_attn.finish(core, p.z)
        else:
            mixer_out = layer.self_attn.finish(core, p.gate)
        normed, hidden = layer.post_attention_layernorm(self.group.all_reduce(mixer_out), residual)
        return hidden + self.group.all_reduce(layer.mlp(normed))

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden]; logits_indices: [R] -> [R, vocab] float32, gathered from the ranks' shares."""
        local = self.lm_head(self.model.norm(hidden.index_select(0, logits_indices))).float()
        return self.group.all_gather_last(local)
