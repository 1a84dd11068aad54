"""TII Falcon-H1 (`falcon_h1`): every layer runs attention and Mamba2 side by side on the same
normed input, `hidden + mamba(x) * ssm_out + attn(x * attn_in) * attn_out`, then a SwiGLU MLP
`down(up(x) * silu(gate(x) * gate_mult)) * down_mult`; the muP multipliers of config.json
(embedding, lm_head, keys, the five in_proj parts of the mixer, its input) as transformers applies
them.
"""

from __future__ import annotations

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import silu_and_mul
from forkpoint.models.mamba2 import Attention, Mamba2Mixer, PlainRMSNorm
from forkpoint.models.mamba2_lm import Mamba2HybridLM


class FalconMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mamba2.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_multiplier, self.down_multiplier = config.mamba2.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        y = self.down_proj(silu_and_mul(gate, self.up_proj(x)))
        return y * self.down_multiplier if self.down_multiplier != 1.0 else y


class FalconLayer(nn.Module):
    """Attention and Mamba2 side by side, then the MLP; `reduce` sums each residual branch over the
    tensor-parallel ranks (the identity in one process)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        del layer_id  # every layer is "parallel"
        hybrid = config.mamba2
        self.input_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config)
        self.self_attn = Attention(config)
        self.feed_forward = FalconMLP(config)
        self.ssm_out, self.attn_in, self.attn_out = (hybrid.ssm_out_multiplier, hybrid.attention_in_multiplier,
                                                     hybrid.attention_out_multiplier)
        self.reduce: nn.Module = nn.Identity()  # a tensor-parallel rank's all-reduce of the partial sums

    def forward(self, hidden, cos_sin, batch, state, kv) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        p = self.mamba.project(x)
        mamba = self.mamba.finish(self.mamba.core(p, batch, *state), p.z) * self.ssm_out
        attn = self.self_attn(x * self.attn_in, cos_sin, batch, *kv) * self.attn_out
        hidden = hidden + self.reduce(mamba + attn)
        return hidden + self.reduce(self.feed_forward(self.pre_ff_layernorm(hidden)))


class FalconH1Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FalconLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)


class FalconH1ForCausalLM(Mamba2HybridLM):
    def __init__(self, config: ModelConfig, *, with_vision: bool = False) -> None:
        super().__init__(config, with_vision=with_vision)
        self.model = FalconH1Model(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm
