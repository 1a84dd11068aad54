"""The causal-LM shell shared by the Mamba2 hybrids: embedding (with its multiplier), the decoder
layers of the family, final norm and lm_head (with the family's logits multipliers).

A family's decoder layer is called as `layer(hidden, cos_sin, batch, state, kv) -> hidden` with
`state = (conv [S, conv_dim, W-1], ssm [S, H, P, N])` its rows of the state pool (None for layers
without a recurrent mixer) and `kv = (k, v)` its paged KV cache (None without attention); the
shell hands each layer its tensors from `LayerCaches` (recurrent layers in `recurrent_layer_ids`
order, attention layers in `attention_layer_ids` order), as `HybridForCausalLM` does.
"""

from __future__ import annotations

import torch
from torch import nn

from forkpoint.cache.sizing import PoolShapes
from forkpoint.config import ModelConfig
from forkpoint.models.layers import RotaryEmbedding, mrope_axes
from forkpoint.models.mamba2 import Mamba2Mixer
from forkpoint.models.qwen3_5 import LayerCaches
from forkpoint.step.batch import ForwardBatch


class Mamba2HybridLM(nn.Module):
    """`forward(batch, caches) -> logits [R, vocab]` float32 for `batch.logits_indices`.

    Subclasses build `self.model` (with `layers` and their final norm) and name the embedding and
    the final norm through `input_embeddings()` / `final_norm()`; parameter names follow the HF
    checkpoints."""

    def __init__(self, config: ModelConfig, *, with_vision: bool = False) -> None:
        super().__init__()
        if config.mamba2 is None:
            raise ValueError(f"{type(self).__name__} needs a Mamba2 hybrid config, got model_type "
                             f"{config.model_type!r}")
        del with_vision  # text-only families
        self.config = config
        self.visual = None
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta) if config.rotary_dim else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._state_index = {layer: i for i, layer in enumerate(config.recurrent_layer_ids)}
        self._kv_index = {layer: i for i, layer in enumerate(config.attention_layer_ids)}

    def input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def pool_shapes(self, dtype: torch.dtype) -> PoolShapes:
        """What the pools hold per sequence: KV of the attention layers, one Mamba2 state row per
        recurrent layer (all of one shape)."""
        config = self.config
        return PoolShapes(len(config.attention_layer_ids), config.num_key_value_heads, config.head_dim, dtype,
                          len(config.recurrent_layer_ids), Mamba2Mixer.state_spec(config, dtype))

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the rotary tables on `device` after `to_empty`."""
        if self.rotary is None:
            return
        dim, theta = self.config.rotary_dim, self.config.rope_theta
        self.rotary.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.rotary.mrope_axis = mrope_axes(dim // 2, self.config.mrope_section, device)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden] leaving the last layer; logits_indices: [R] -> [R, vocab] float32."""
        hybrid = self.config.mamba2
        logits = self.lm_head(self.final_norm()(hidden.index_select(0, logits_indices)))
        if hybrid.lm_head_multiplier != 1.0:
            logits = logits * hybrid.lm_head_multiplier
        if hybrid.logits_scaling != 1.0:
            logits = logits / hybrid.logits_scaling
        return logits.float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        hidden = self.input_embeddings()(batch.input_ids)
        if self.config.mamba2.embedding_multiplier != 1.0:
            hidden = hidden * self.config.mamba2.embedding_multiplier
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(batch.positions, hidden.dtype)
        for layer_id, layer in enumerate(self.model.layers):
            s, j = self._state_index.get(layer_id), self._kv_index.get(layer_id)
            state = None if s is None else (caches.conv[s], caches.ssm[s])
            kv = None if j is None else (caches.k[j], caches.v[j])
            hidden = layer(hidden, cos_sin, batch, state, kv)
        return self.compute_logits(hidden, batch.logits_indices)
