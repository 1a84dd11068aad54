"""The causal-LM shell shared by the Mamba2 hybrids: embedding (with its multiplier), the decoder
layers of the family, final norm and lm_head (with the family's logits multipliers).

It implements the model interface `CausalLM` (models/interface.py), so the piecewise CUDA graphs and
the whole-step decode graphs (runner/piecewise.py, runner/decode_graphs.py) run these models as they
run Qwen's: `forward` is exactly embed, then project / core / finish per layer, then
`compute_logits`. A family's decoder layer provides

    core_kind        "recurrent" (Mamba2), "attention", "parallel" (Falcon-H1: both on one input)
                     or None (token-wise only: Nemotron-H's MLP and MoE blocks; no project / core)
    project(hidden, cos_sin) -> NamedTuple          token-wise, the mixer's projections
    core_shape() -> tuple                           trailing shape of its core output
    core(p, batch, state, kv, out) -> [T, ...]      varlen: conv + SSD and/or KV write + attention
    finish(residual, p, core) -> [T, hidden]        token-wise, mixer output, residual, MLP / MoE

with `state = (conv [S, conv_dim, W-1], ssm [S, H, P, N])` its rows of the state pool and
`kv = (k, v)` its paged KV cache; recurrent and parallel layers also give `mamba_part(p, out)`
(their Mamba2 projection and core-output view), so that one CUDA graph of a Mamba2 core serves
every Mamba2 layer of a step (`recurrent_core`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from forkpoint.cache.sizing import PoolShapes
from forkpoint.config import ModelConfig
from forkpoint.models.layers import RotaryEmbedding, mrope_axes
from forkpoint.models.mamba2 import Mamba2CoreParams, Mamba2Mixer
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.caches import LayerCaches


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
        self.mtp = None  # no multi-token-prediction head in these families
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

    # ------------------------------------------------------------------ parts (runner/piecewise.py)
    def core_kind(self, layer_id: int) -> str | None:
        """"recurrent", "attention", "parallel", or None for a token-wise-only layer."""
        return self.model.layers[layer_id].core_kind

    def core_shape(self, layer_id: int) -> tuple[int, ...]:
        return self.model.layers[layer_id].core_shape()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              embedding_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids, positions: [T] long -> hidden [T, hidden] (times the embedding multiplier) and
        the rotary tables (cos, sin) [T, rotary_dim] in the model dtype ([T, 0] without rotary)."""
        if embedding_overrides is not None:
            raise ValueError(f"{self.config.model_type} is a text-only model: a batch with image rows cannot run")
        hidden = self.input_embeddings()(input_ids)
        if self.config.mamba2.embedding_multiplier != 1.0:
            hidden = hidden * self.config.mamba2.embedding_multiplier
        if self.rotary is None:
            empty = hidden.new_zeros(hidden.shape[0], 0)
            return hidden, (empty, empty)
        return hidden, self.rotary.cos_sin(positions, hidden.dtype)

    def projection_width(self, layer_id: int) -> int | None:
        """Columns of layer `layer_id`'s Mamba2 in_proj output (the `stacked_out` of `project`), or
        None for a layer without one (attention: the piecewise forward copies its projections)."""
        return self.model.layers[layer_id].projection_width()

    def project(self, layer_id: int, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                stacked_out: torch.Tensor | None = None) -> NamedTuple:
        """hidden: [T, hidden], the stream entering the layer -> its mixer projections. Token-wise.
        With `stacked_out` [T, projection_width(layer_id)] the Mamba2 in_proj writes there and xbc / z
        are views of it (as `HybridForCausalLM.project`)."""
        return self.model.layers[layer_id].project(hidden, cos_sin, stacked_out)

    def _state(self, layer_id: int, caches: LayerCaches):
        s, j = self._state_index.get(layer_id), self._kv_index.get(layer_id)
        state = None if s is None else (caches.conv[s], caches.ssm[s])
        kv = None if j is None else (caches.k[j], caches.v[j])
        return state, kv

    def core(self, layer_id: int, p: NamedTuple, batch: ForwardBatch, caches: LayerCaches,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's varlen part on the step's T tokens (reads `batch`, reads and writes the pools'
        rows) -> [T, *core_shape], written into `out` when given."""
        state, kv = self._state(layer_id, caches)
        return self.model.layers[layer_id].core(p, batch, state, kv, out)

    def attention_core(self, layer_id: int, p: NamedTuple, batch: ForwardBatch, caches: LayerCaches,
                       out: torch.Tensor) -> None:
        """The attention part of layer `layer_id`'s core into its columns of `out`: the whole core of
        an attention layer, the attention half of a parallel one (its Mamba2 half ran through
        `recurrent_core`). ValueError for a layer without attention."""
        layer = self.model.layers[layer_id]
        if layer.core_kind not in ("attention", "parallel"):
            raise ValueError(f"layer {layer_id} ({layer.core_kind or 'token-wise only'}) has no attention core")
        _, kv = self._state(layer_id, caches)
        if layer.core_kind == "parallel":
            layer.attention_core(p, batch, kv, out)
        else:
            layer.core(p, batch, None, kv, out)

    def recurrent_core_params(self, layer_id: int) -> Mamba2CoreParams:
        """The parameters that Mamba2 layer `layer_id`'s core reads (views of the parameters)."""
        return self.model.layers[layer_id].mamba_mixer().core_params()

    def recurrent_core(self, p: NamedTuple, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                       params: Mamba2CoreParams, row_offset: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The Mamba2 core of the layer that the device data selects: conv_states / ssm_states are
        the flattened `LayerCaches.conv_stack / ssm_stack` [L * S, ...], row_offset (0-dim long) =
        j * S and `params` those of the j-th recurrent layer. Equal to that layer's Mamba2 core (all
        recurrent layers share their shapes and kind); writes its rows of `out`."""
        layer = self.model.layers[self.config.recurrent_layer_ids[0]]
        mamba_p, mamba_out = layer.mamba_part(p, out)
        return layer.mamba_mixer().core(mamba_p, batch, conv_states, ssm_states, mamba_out, params=params,
                                        row_offset=row_offset)

    def finish(self, layer_id: int, residual: torch.Tensor, p: NamedTuple | None,
               core: torch.Tensor | None) -> torch.Tensor:
        """residual: [T, hidden] (the stream entering the layer) -> the stream leaving it. Token-wise."""
        return self.model.layers[layer_id].finish(residual, p, core)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden] leaving the last layer; logits_indices: [R] -> [R, vocab] float32."""
        hybrid = self.config.mamba2
        logits = self.lm_head(self.final_norm()(hidden.index_select(0, logits_indices)))
        if hybrid.lm_head_multiplier != 1.0:
            logits = logits * hybrid.lm_head_multiplier
        if hybrid.logits_scaling != 1.0:
            logits = logits / hybrid.logits_scaling
        return logits.float()

    def norm_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden] leaving the last layer -> its final norm [T, hidden]."""
        return self.final_norm()(hidden)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """The stream leaving the last layer [T, hidden]: `forward` without `compute_logits`."""
        hidden, cos_sin = self.embed(batch.input_ids, batch.positions, batch.embedding_overrides)
        for layer_id in range(len(self.model.layers)):
            p = core = None
            if self.core_kind(layer_id) is not None:
                p = self.project(layer_id, hidden, cos_sin)
                core = self.core(layer_id, p, batch, caches)
            hidden = self.finish(layer_id, hidden, p, core)
        return hidden

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(batch, caches), batch.logits_indices)
