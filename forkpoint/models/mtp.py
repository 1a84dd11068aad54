"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: the drafter of
speculative decoding (`speculative_config={"method": "mtp", ...}`).

The checkpoints store it under `mtp.*` (config.json: `mtp_num_hidden_layers` in Qwen3.5,
`num_nextn_predict_layers` in Qwen3-Next). For the token at position i + 1 it reads the target's
final-normed hidden state at position i and the embedding of token i + 1 (shared with the target)::

    e = pre_fc_norm_embedding(embed(token[i+1]))         [T, hidden]
    h = pre_fc_norm_hidden(previous[i])                  [T, hidden]  (target's, or the MTP's own)
    x = fc(cat(e, h))                                    [T, hidden]  (fc: [hidden, 2 * hidden])
    x = one full-attention decoder layer (gated attention at position i, MLP or MoE as the target's)
    out = norm(x)                                        -> lm_head (shared) gives the draft logits

`out` at position i is also the `previous` of the next draft step (at position i + 1). The layer's
attention KV is one more attention layer of the pools (`HybridForCausalLM.pool_shapes` counts it
last), so it shares the target's block tables, copy-on-write and checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.models.layers import DenseMLP, RMSNorm, SparseMoE, apply_linear
from forkpoint.step.batch import ForwardBatch

# config.json's name for the number of MTP layers: Qwen3.5 (text config), Qwen3-Next
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def mtp_layer_count(model_dir: Path) -> int:
    """The number of MTP layers config.json in `model_dir` declares (0 when it declares none),
    read from the top level or the multimodal checkpoints' `text_config`."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    for section in (raw, raw.get("text_config") or {}):
        for key in MTP_LAYER_KEYS:
            if section.get(key):
                return int(section[key])
    return 0


class MTPLayer(nn.Module):
    """The MTP's decoder layer: gated full attention, then the target's kind of feed-forward (MoE
    when the target has experts). Parameter names follow the checkpoints (`mtp.layers.0.*`)."""

    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp: nn.Module = (SparseMoE(config) if config.num_experts > 0
                               else DenseMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MultiTokenPredictor(nn.Module):
    """`mtp.*` of a Qwen3.5 / Qwen3-Next checkpoint (one layer: every draft step runs it).
    `attention`: the family's gated attention module for the layer (models/qwen3_5.GatedAttention)."""

    def __init__(self, config: ModelConfig, num_layers: int, attention: nn.Module) -> None:
        super().__init__()
        if num_layers != 1:
            raise ValueError(f"config.json declares {num_layers} MTP layers; forkpoint drafts with exactly one "
                             "(the Qwen3.5 and Qwen3-Next releases have one)")
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList([MTPLayer(config, attention)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """embeds: [T, hidden], the shared embedding of the tokens at positions + 1; previous: [T, hidden]
        final-normed hidden states at `batch.positions` (the target's or this head's own output);
        cos_sin: the rotary tables of `batch.positions`; k_cache / v_cache: this head's KV pool layer
        [num_blocks, block_size, HKV, Dh], written at `batch.attention.slot_mapping` (then attended
        causally as the target's layers are). Returns the normed output [T, hidden] (lm_head of it:
        the draft logits; also the next draft step's `previous`)."""
        layer = self.layers[0]
        x = apply_linear(self.fc, torch.cat([self.pre_fc_norm_embedding(embeds),
                                             self.pre_fc_norm_hidden(previous)], dim=-1))
        attn = layer.self_attn
        p = attn.project(layer.input_layernorm(x), cos_sin)
        mixed = attn.finish(attn.core(p, batch, k_cache, v_cache), p.gate)
        normed, hidden = layer.post_attention_layernorm(mixed, x)
        if isinstance(layer.mlp, SparseMoE):
            hidden = layer.mlp(normed, residual=hidden)
        else:
            hidden = hidden + layer.mlp(normed)
        return self.norm(hidden)
