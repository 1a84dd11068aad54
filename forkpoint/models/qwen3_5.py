"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid model: Gated DeltaNet and gated full attention.

One implementation serves all three families; the loader converts Qwen3-Next's grouped projection
layout into Qwen3.5's flat one. Layers never own caches: each forward receives the state and KV
tensors of the pools plus the step's `ForwardBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.attention import copy_kv_slots, paged_attention, write_kv
from forkpoint.kernels.conv1d import causal_conv1d_step, causal_conv1d_varlen
from forkpoint.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from forkpoint.models.layers import DenseMLP, GatedRMSNorm, RMSNorm, RotaryEmbedding, SparseMoE, apply_rotary
from forkpoint.models.vision import VisionTransformer
from forkpoint.runner.batch import ForwardBatch


@dataclass(frozen=True)
class LayerCaches:
    """Cache tensors handed to the model for one forward.

    conv[i]: [S, conv_dim, W-1] and ssm[i]: [S, HV, K, V] fp32 for the i-th GDN layer (row 0 is
    the all-zero slot); k[j], v[j]: [num_blocks, block_size, HKV, Dh] for the j-th attention layer.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer with packed two-phase execution (see runner/batch.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = config.conv_dim
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed: [n, conv_dim] -> q, k: [n, H, K]; v: [n, HV, V]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. Reads and writes rows of conv_state / ssm_state in place."""
        num_tokens = x.shape[0]
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        conv_weight = self.conv1d.weight.squeeze(1)
        core = x.new_empty(num_tokens, self.num_v_heads, self.head_v_dim)

        decode = batch.decode
        if decode is not None and decode.num_tokens:
            n = decode.num_tokens
            conv_out, new_conv = causal_conv1d_step(mixed[:n], conv_weight, None, conv_state.index_select(0, decode.slots))
            q, k, v = self._split_qkv(conv_out)
            out, new_ssm = recurrent_gated_delta_rule(
                q, k, v, g[:n], beta[:n], ssm_state.index_select(0, decode.slots)
            )
            core[:n] = out
            conv_state.index_copy_(0, decode.slots, new_conv.to(conv_state.dtype))
            ssm_state.index_copy_(0, decode.slots, new_ssm)

        for phase in batch.phases:
            lo, hi = phase.token_start, phase.token_end
            conv_out, final_conv = causal_conv1d_varlen(
                mixed[lo:hi],
                conv_weight,
                None,
                conv_state.index_select(0, phase.initial_slots),
                phase.cu_seqlens,
                phase.cu_seqlens_host,
            )
            q, k, v = self._split_qkv(conv_out)
            out, final_ssm = chunk_gated_delta_rule(
                q,
                k,
                v,
                g[lo:hi],
                beta[lo:hi],
                ssm_state.index_select(0, phase.initial_slots),
                phase.cu_seqlens,
                phase.cu_seqlens_host,
            )
            core[lo:hi] = out
            if phase.dest_slots.numel():
                conv_state.index_copy_(
                    0, phase.dest_slots, final_conv.index_select(0, phase.dest_rows).to(conv_state.dtype)
                )
                ssm_state.index_copy_(0, phase.dest_slots, final_ssm.index_select(0, phase.dest_rows))

        core = self.norm(core, z)
        return self.out_proj(core.reshape(num_tokens, self.value_dim))


class GatedAttention(nn.Module):
    """Full attention with an output gate, q/k RMSNorm, partial rotary embedding and GQA over paged KV."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. Writes this step's K/V into the paged cache first."""
        num_tokens = x.shape[0]
        q_gate = self.q_proj(x).reshape(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate.split(self.head_dim, dim=-1)
        gate = gate.reshape(num_tokens, self.num_heads * self.head_dim)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        meta = batch.attention
        write_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), meta.slot_mapping)
        if meta.cow_src.numel():
            copy_kv_slots(k_cache, v_cache, meta.cow_src, meta.cow_dst)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.cu_seqlens_q_host,
            meta.seq_lens,
            meta.seq_lens_host,
            scale=self.scale,
        )
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_recurrent = config.layer_types[layer_id] == "linear_attention"
        if self.is_recurrent:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        if config.moe_layers[layer_id]:
            self.mlp: nn.Module = SparseMoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridModel(nn.Module):
    """Embedding, decoder layers and final norm. Parameter names follow the HF checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """The language model: `forward(batch, caches) -> logits [R, vocab]` for `batch.logits_indices`.

    With `with_vision`, `visual` is the vision tower (models/vision.py); the runner calls it before
    the forward and hands its outputs in as `batch.embedding_overrides`.
    """

    def __init__(self, config: ModelConfig, *, with_vision: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
        self.visual = VisionTransformer(config.vision) if with_vision and config.vision is not None else None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        if batch.embedding_overrides is not None:  # image tokens take the vision tower's rows
            index, embeds = batch.embedding_overrides
            hidden = hidden.index_copy(0, index, embeds.to(hidden.dtype))
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        gdn_index = attn_index = 0
        for layer in self.model.layers:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            if layer.is_recurrent:
                hidden = layer.linear_attn(hidden, batch, caches.conv[gdn_index], caches.ssm[gdn_index])
                gdn_index += 1
            else:
                hidden = layer.self_attn(hidden, batch, cos_sin, caches.k[attn_index], caches.v[attn_index])
                attn_index += 1
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.model.norm(hidden.index_select(0, batch.logits_indices))
        return self.lm_head(hidden).float()
