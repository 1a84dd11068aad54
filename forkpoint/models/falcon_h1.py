"""TII Falcon-H1 (`falcon_h1`): every layer runs attention and Mamba2 side by side on the same
normed input, `hidden + mamba(x) * ssm_out + attn(x * attn_in) * attn_out`, then a SwiGLU MLP
`down(up(x) * silu(gate(x) * gate_mult)) * down_mult`; the muP multipliers of config.json
(embedding, lm_head, keys, the five in_proj parts of the mixer, its input) as transformers applies
them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import silu_and_mul
from forkpoint.models.mamba2 import Attention, Mamba2Mixer, Mamba2Projection, PlainRMSNorm, QKVProjection
from forkpoint.models.mamba2_lm import Mamba2HybridLM


class ParallelProjection(NamedTuple):
    """Token-wise outputs of a Falcon-H1 layer's projections: both mixers read the same normed input."""

    mamba: Mamba2Projection
    attention: QKVProjection


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

    core_kind = "parallel"

    def mamba_mixer(self) -> Mamba2Mixer:
        return self.mamba

    def _widths(self) -> tuple[int, int]:
        return self.mamba.num_heads * self.mamba.head_dim, self.self_attn.num_heads * self.self_attn.head_dim

    def core_shape(self) -> tuple[int]:
        """One flat row per token: the Mamba2 output [H * P], then the attention output [HQ * Dh]."""
        return (sum(self._widths()),)

    def mamba_part(self, p: ParallelProjection, out: torch.Tensor) -> tuple[Mamba2Projection, torch.Tensor]:
        """p's Mamba2 projection and the [T, H, P] view of its columns of out [T, H*P + HQ*Dh]."""
        width, _ = self._widths()
        return p.mamba, out[:, :width].view(out.shape[0], self.mamba.num_heads, self.mamba.head_dim)

    def _attention_out(self, out: torch.Tensor) -> torch.Tensor:
        width, _ = self._widths()
        return out[:, width:].view(out.shape[0], self.self_attn.num_heads, self.self_attn.head_dim)

    def projection_width(self) -> int:
        """The Mamba2 half's in_proj width (`stacked_out` of `project` holds that half's projection)."""
        return self.mamba.projection_width()

    def project(self, hidden, cos_sin, stacked_out=None) -> ParallelProjection:
        x = self.input_layernorm(hidden)
        attention_in = x * self.attn_in if self.attn_in != 1.0 else x
        return ParallelProjection(self.mamba.project(x, stacked_out), self.self_attn.project(attention_in, cos_sin))

    def attention_core(self, p: ParallelProjection, batch, kv, out: torch.Tensor) -> None:
        self.self_attn.core(p.attention, batch, *kv, self._attention_out(out))

    def core(self, p: ParallelProjection, batch, state, kv, out=None) -> torch.Tensor:
        if out is None:
            out = p.mamba.xbc.new_empty(p.mamba.xbc.shape[0], *self.core_shape())
        mamba_p, mamba_out = self.mamba_part(p, out)
        self.mamba.core(mamba_p, batch, *state, mamba_out)
        self.attention_core(p, batch, kv, out)
        return out

    def finish(self, hidden, p: ParallelProjection, core) -> torch.Tensor:
        _, mamba_out = self.mamba_part(p, core)
        mamba = self.mamba.finish(mamba_out, p.mamba.z) * self.ssm_out
        attn = self.self_attn.finish(self._attention_out(core)) * self.attn_out
        x, hidden = self.pre_ff_layernorm(self.reduce(mamba + attn), hidden)  # the residual add fused in
        return hidden + self.reduce(self.feed_forward(x))


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
