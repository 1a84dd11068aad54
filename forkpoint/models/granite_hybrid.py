"""IBM Granite-4.0-H (`granitemoehybrid`): each layer a Mamba2 or attention mixer, then a MoE of
SwiGLU experts (softmax over the top-k router logits) plus a shared SwiGLU MLP (or the shared MLP
alone), both residual branches scaled by `residual_multiplier`; embeddings times
`embedding_multiplier`, attention scale `attention_multiplier`, logits divided by `logits_scaling`.
Weights as `save_pretrained` writes them (`block_sparse_moe.input_linear.weight` [E, 2I, H], gate
rows first; `output_linear.weight` [E, H, I]; `router.layer.weight`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import silu_and_mul
from forkpoint.kernels.moe import fused_moe
from forkpoint.models.mamba2 import Attention, Mamba2Mixer, Mamba2Projection, PlainRMSNorm
from forkpoint.models.mamba2_lm import Mamba2HybridLM


class _Weight(nn.Module):
    """A module holding one `weight` (for the HF names `router.layer.weight`, `input_linear.weight`)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class GraniteMoE(nn.Module):
    """Routed SwiGLU experts; weights = softmax of the top-k router logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, experts, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = _Weight(experts, hidden)
        self.input_linear = _Weight(experts, 2 * inter, hidden)
        self.output_linear = _Weight(experts, hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.layer.weight).float()
        top_logits, ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
        return fused_moe(x, self.input_linear.weight, self.output_linear.weight, weights, ids)


class SharedMLP(nn.Module):
    """output_linear(silu(gate) * up) with input_linear = [gate; up] rows."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(silu_and_mul(gate, up))


class GraniteLayer(nn.Module):
    """Mixer, then MoE + shared MLP, each a residual branch; `reduce` sums each branch over the
    tensor-parallel ranks before its multiplier (the identity in one process)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_recurrent = config.layer_types[layer_id] == "mamba2"
        self.input_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_recurrent:
            self.mamba = Mamba2Mixer(config)
        else:
            self.self_attn = Attention(config)
        self.block_sparse_moe = GraniteMoE(config) if config.num_experts > 0 else None
        self.shared_mlp = SharedMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.residual_multiplier = config.mamba2.residual_multiplier
        self.reduce: nn.Module = nn.Identity()  # a tensor-parallel rank's all-reduce of the partial sums

    @property
    def core_kind(self) -> str:
        return "recurrent" if self.is_recurrent else "attention"

    def mamba_mixer(self) -> Mamba2Mixer:
        return self.mamba

    def mamba_part(self, p: Mamba2Projection, out: torch.Tensor) -> tuple[Mamba2Projection, torch.Tensor]:
        return p, out

    def core_shape(self) -> tuple[int, int]:
        mixer = self.mamba if self.is_recurrent else self.self_attn
        return mixer.num_heads, mixer.head_dim

    def projection_width(self) -> int | None:
        """in_proj's width for a Mamba2 layer (its `project` takes `stacked_out`), else None."""
        return self.mamba.projection_width() if self.is_recurrent else None

    def project(self, hidden, cos_sin, stacked_out=None):
        x = self.input_layernorm(hidden)
        return self.mamba.project(x, stacked_out) if self.is_recurrent else self.self_attn.project(x, cos_sin)

    def core(self, p, batch, state, kv, out=None) -> torch.Tensor:
        if self.is_recurrent:
            return self.mamba.core(p, batch, *state, out)
        return self.self_attn.core(p, batch, *kv, out)

    def finish(self, hidden, p, core) -> torch.Tensor:
        x = self.mamba.finish(core, p.z) if self.is_recurrent else self.self_attn.finish(core)
        x, hidden = self.post_attention_layernorm(self.reduce(x) * self.residual_multiplier, hidden)  # fused add
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return hidden + self.reduce(out) * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GraniteLayer(config, i) for i in range(config.num_layers))
        self.norm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)


class GraniteMoeHybridForCausalLM(Mamba2HybridLM):
    def __init__(self, config: ModelConfig, *, with_vision: bool = False) -> None:
        super().__init__(config, with_vision=with_vision)
        self.model = GraniteHybridModel(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.norm
