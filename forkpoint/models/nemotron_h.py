"""NVIDIA Nemotron-H / Nemotron-3 (`nemotron_h`): a stack of single-mixer blocks, each
`hidden + mixer(norm(hidden))`, the mixer one of Mamba2, attention (no rotary), a ReLU^2 MLP or
a MoE of ReLU^2 experts with a shared expert and a sigmoid router (DeepSeek-V3 style: correction
bias, expert groups). Weights as `save_pretrained` writes them: `backbone.` prefix (the loader maps
it to `model.`), experts per expert (`mixer.experts.{e}.up_proj.weight`; stacked here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.moe import fused_moe_relu2, sigmoid_grouped_topk
from forkpoint.models.mamba2 import Attention, Mamba2Mixer, Mamba2Projection, PlainRMSNorm
from forkpoint.models.mamba2_lm import Mamba2HybridLM


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2) (Nemotron-H's non-gated MLP)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class GroupedSigmoidRouter(nn.Module):
    """Nemotron-3's router (transformers' NemotronHTopkRouter): sigmoid scores of the fp32 logits;
    scores + e_score_correction_bias choose the topk_group best of n_group expert groups (a group's
    score: the sum of its best two), then the top-k experts inside them; the weights are the raw
    scores of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor.
    The weight and the bias stay float32 in a bf16 model (`float32_parameters`, as transformers'
    `_keep_in_fp32_modules_strict` and vLLM keep them): rounded to bf16 they move the routing weights
    (by up to 0.6% on the tiny test model) and, at close scores, the choice of experts."""

    float32_parameters = ("weight", "e_score_correction_bias")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hybrid = config.mamba2
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, hybrid.n_group, hybrid.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, hybrid.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] fp32, expert ids [T, k] long): the fp32 logits GEMM,
        then kernels/moe `sigmoid_grouped_topk` (one kernel on CUDA; ties to the lowest index)."""
        logits = F.linear(x.float(), self.weight.float())
        return sigmoid_grouped_topk(logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                                    self.norm_topk_prob, self.scale)


class StackedExperts(nn.Module):
    """Routed ReLU^2 experts stacked: up_proj [E, I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H]; weights, ids: [T, k] -> sum_j w_j down[e_j] relu(up[e_j] x)^2 (+ residual [T, H]),
        [T, H] in x.dtype (kernels/moe `fused_moe_relu2`: the reference on the CPU, grouped GEMMs
        without a host sync on CUDA in bf16)."""
        return fused_moe_relu2(x, self.up_proj, self.down_proj, weights, ids, residual=residual)


class NemotronMoE(nn.Module):
    """Routed ReLU^2 experts plus the shared expert (always on, unscaled). With `moe_latent_size`
    (Nemotron-3 LatentMoE) the routed experts run in the latent width, between fc1_latent_proj
    and fc2_latent_proj; the router and the shared expert read the full hidden state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, latent, bias = config.hidden_size, config.mamba2.moe_latent_size, config.mamba2.mlp_bias
        self.gate = GroupedSigmoidRouter(config)
        self.experts = StackedExperts(config.num_experts, latent or hidden, config.moe_intermediate_size)
        self.shared_experts = ReluSquaredMLP(hidden, config.shared_expert_intermediate_size, bias)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias)
        self.latent = latent is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if not self.latent:
            return self.experts(x, weights, ids, residual=self.shared_experts(x))
        routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
        return routed + self.shared_experts(x)


class NemotronBlock(nn.Module):
    """`hidden + mixer(norm(hidden))` for one of the four mixer kinds, in the parts of
    models/mamba2_lm.py: Mamba2 and attention blocks project / core / finish; MLP and MoE blocks
    are token-wise only (`finish`). `reduce` sums the mixer's output over the tensor-parallel ranks
    (the identity in one process)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer_id]
        self.core_kind = {"mamba2": "recurrent", "full_attention": "attention"}.get(self.kind)
        self.norm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == "mamba2":
            self.mixer: nn.Module = Mamba2Mixer(config)
        elif self.kind == "full_attention":
            self.mixer = Attention(config)
        elif self.kind == "moe":
            self.mixer = NemotronMoE(config)
        else:
            self.mixer = ReluSquaredMLP(config.hidden_size, config.intermediate_size, config.mamba2.mlp_bias)
        self.reduce: nn.Module = nn.Identity()  # a tensor-parallel rank's all-reduce of the partial sums

    def mamba_mixer(self) -> Mamba2Mixer:
        return self.mixer

    def mamba_part(self, p: Mamba2Projection, out: torch.Tensor) -> tuple[Mamba2Projection, torch.Tensor]:
        return p, out

    def core_shape(self) -> tuple[int, int]:
        return self.mixer.num_heads, self.mixer.head_dim  # Mamba2: (H, P); attention: (HQ, Dh)

    def projection_width(self) -> int | None:
        """in_proj's width for a Mamba2 block (its `project` takes `stacked_out`), else None."""
        return self.mixer.projection_width() if self.kind == "mamba2" else None

    def project(self, hidden, cos_sin, stacked_out=None):
        x = self.norm(hidden)
        return self.mixer.project(x, stacked_out) if self.kind == "mamba2" else self.mixer.project(x, cos_sin)

    def core(self, p, batch, state, kv, out=None) -> torch.Tensor:
        return self.mixer.core(p, batch, *(state if self.kind == "mamba2" else kv), out)

    def finish(self, hidden, p, core) -> torch.Tensor:
        if self.kind == "mamba2":
            out = self.mixer.finish(core, p.z)
        elif self.kind == "full_attention":
            out = self.mixer.finish(core)
        else:
            out = self.mixer(self.norm(hidden))
        return hidden + self.reduce(out)


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronBlock(config, i) for i in range(config.num_layers))
        self.norm_f = PlainRMSNorm(config.hidden_size, config.rms_norm_eps)


class NemotronHForCausalLM(Mamba2HybridLM):
    def __init__(self, config: ModelConfig, *, with_vision: bool = False) -> None:
        super().__init__(config, with_vision=with_vision)
        self.model = NemotronHModel(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def final_norm(self) -> nn.Module:
        return self.model.norm_f
