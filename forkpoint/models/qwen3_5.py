"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid model: Gated DeltaNet and gated full attention.

One implementation serves all three families; the loader converts Qwen3-Next's grouped projection
layout into Qwen3.5's flat one. Layers never own caches: each forward receives the state and KV
tensors of the pools plus the step's `ForwardBatch`.

Each decoder layer runs in three parts, so that the runner can replay everything token-wise as CUDA
graphs and run only the varlen part eagerly (runner/piecewise.py):

    project   token-wise: input norm, then the mixer's projections   -> GDNProjection | AttentionProjection
    core      varlen, reads the ForwardBatch and the pools: GDN conv + gated delta rule per decode
              group and phase, or attention KV write + copy-on-write + paged attention   -> [T, heads, dim]
    finish    token-wise: mixer output (gated norm + out_proj, or sigmoid gate + o_proj), residual,
              post-attention norm, MLP / MoE, residual                                   -> [T, hidden]

`HybridForCausalLM` implements the model interface `CausalLM` (models/interface.py): its `forward` is
exactly embed, then project / core / finish per layer, then `compute_logits` on the sampled rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from forkpoint.cache.sizing import PoolShapes
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import sigmoid_gate_mul
from forkpoint.kernels.conv1d import causal_conv1d_step_inplace, causal_conv1d_varlen
from forkpoint.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule_inplace
from forkpoint.kernels.gating import gdn_gating
from forkpoint.kernels.rotary import qk_norm_rotary_
from forkpoint.models.attention_core import attention_core
from forkpoint.models.layers import (
    DenseMLP,
    GatedRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    StackedProjections,
    apply_linear,
    mrope_axes,
)
from forkpoint.models.mtp import MultiTokenPredictor
from forkpoint.models.recurrent import two_phase_core
from forkpoint.models.vision import VisionTransformer
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.caches import LayerCaches


class GDNProjection(NamedTuple):
    """Token-wise outputs of a Gated DeltaNet layer's input projections (T rows each)."""

    mixed: torch.Tensor  # [T, conv_dim]: q, k, v channels before the causal convolution
    z: torch.Tensor  # [T, HV, V]: output gate
    g: torch.Tensor  # [T, HV] float32: log-decay (<= 0)
    beta: torch.Tensor  # [T, HV]: write strength


class AttentionProjection(NamedTuple):
    """Token-wise outputs of a gated attention layer's projections (T rows each)."""

    q: torch.Tensor  # [T, HQ, Dh]: normed and rotated
    k: torch.Tensor  # [T, HKV, Dh]: normed and rotated
    v: torch.Tensor  # [T, HKV, Dh]
    gate: torch.Tensor  # [T, HQ, Dh]: output gate, before the sigmoid


class GDNCoreParams(NamedTuple):
    """The per-layer parameters a GDN core reads (all else is per token, from the projection)."""

    conv_weight: torch.Tensor  # [conv_dim, W]


class GatedDeltaNet(StackedProjections):
    """Gated DeltaNet token mixer with packed two-phase execution: the driver of models/recurrent.py
    with its conv and delta-rule kernels plugged in (`decode_step`, `phase_scan`). The four input
    projections (qkv, z, b, a) run as one GEMM."""

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

    @staticmethod
    def state_spec(config: ModelConfig, dtype: torch.dtype) -> RecurrentStateSpec:
        """Per-sequence state: conv [conv_dim, W-1] in the model dtype, SSM [HV, K, V] float32."""
        return RecurrentStateSpec((config.conv_dim, config.linear_conv_kernel_dim - 1), dtype,
                                  (config.linear_num_value_heads, config.linear_key_head_dim,
                                   config.linear_value_head_dim), torch.float32)

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed: [n, conv_dim] -> q, k: [n, H, K]; v: [n, HV, V]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def project(self, x: torch.Tensor, stacked_out: torch.Tensor | None = None) -> GDNProjection:
        """x: [T, hidden] (after the input norm). Token-wise. `mixed` and `z` are column views of
        the stacked projection (row-strided), of `stacked_out` [T, stacked_width()] when given."""
        num_tokens = x.shape[0]
        mixed, z, b, a = self.project_stacked(x, stacked_out)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        return GDNProjection(mixed, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim), g, beta)

    def core_params(self) -> GDNCoreParams:
        """This layer's parameters that `core` reads (views, no copies)."""
        return GDNCoreParams(self.conv1d.weight.squeeze(1))

    def core(self, p: GDNProjection, batch: ForwardBatch, conv_state: torch.Tensor, ssm_state: torch.Tensor,
             out: torch.Tensor | None = None, *, params: GDNCoreParams | None = None,
             row_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv and gated delta rule of the decode group and every phase (models/recurrent.py):
        reads `batch`, reads and writes rows of conv_state / ssm_state in place. p's tensors hold the
        step's T tokens exactly; returns out [T, HV, V] (allocated when None; every row is written,
        since decodes and phases cover all T tokens).

        conv_state: [S, conv_dim, W-1], ssm_state: [S, HV, K, V] fp32, this layer's pool rows; or, with
        `row_offset` (a 0-dim long tensor on the device), the flattened states of all GDN layers
        ([L * S, ...]), of which rows row_offset + slot are this layer's. params: this layer's own
        (`core_params()`) when None. With both, the layer is chosen by device data only, so one CUDA
        graph of this call serves every GDN layer (runner/piecewise.py)."""
        if out is None:
            out = p.mixed.new_empty(p.mixed.shape[0], self.num_v_heads, self.head_v_dim)
        conv_weight = (params if params is not None else self.core_params()).conv_weight
        return two_phase_core(self, p, batch, conv_state, ssm_state, out, conv_weight, row_offset)

    def decode_step(self, p: GDNProjection, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                    ssm_state: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        """`RecurrentKernels.decode_step`: single-token conv and delta-rule step, rows updated in place."""
        conv_out = causal_conv1d_step_inplace(p.mixed, conv_weight, None, conv_state, rows)
        q, k, v = self._split_qkv(conv_out)
        recurrent_gated_delta_rule_inplace(q, k, v, p.g, p.beta, ssm_state, rows, out=out)

    def phase_scan(self, p: GDNProjection, conv_weight: torch.Tensor, conv_initial: torch.Tensor,
                   ssm_initial: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: tuple[int, ...],
                   out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`RecurrentKernels.phase_scan`: packed varlen conv, then the chunked gated delta rule."""
        num_tokens = p.mixed.shape[0]
        # q, k and v come out as contiguous tensors (the chunked rule takes them so: no copies)
        split = (self.key_dim, self.key_dim, self.value_dim)
        (q, k, v), final_conv = causal_conv1d_varlen(p.mixed, conv_weight, None, conv_initial, cu_seqlens,
                                                     cu_seqlens_host, split=split)
        q = q.view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)
        o, final_ssm = chunk_gated_delta_rule(q, k, v, p.g, p.beta, ssm_initial, cu_seqlens, cu_seqlens_host)
        out.copy_(o)
        return final_conv, final_ssm

    def finish(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core, z: [T, HV, V] -> [T, hidden]: gated norm and output projection. Token-wise."""
        num_tokens = core.shape[0]
        return apply_linear(self.out_proj, self.norm(core, z).reshape(num_tokens, self.value_dim))


class GatedAttention(StackedProjections):
    """Full attention with an output gate, q/k RMSNorm, partial rotary embedding and GQA over paged KV;
    the q (with its gate), k and v projections as one GEMM."""

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

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                stacked_out: torch.Tensor | None = None) -> AttentionProjection:
        """x: [T, hidden] (after the input norm); cos, sin: [T, rotary_dim]. Token-wise. All four
        fields are views of the stacked projection GEMM's output (`stacked_out` [T, stacked_width()]
        when given): q and gate interleaved per head ([T, HQ, 2 * Dh] split in halves), then k, v.
        q and k are normed and rotated in place there, in one kernel on CUDA (`qk_norm_rotary_`)."""
        num_tokens = x.shape[0]
        q_gate, k, v = self.project_stacked(x, stacked_out)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        # q_norm and k_norm share config.rms_norm_eps
        qk_norm_rotary_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        return AttentionProjection(q, k, v, gate)

    def core(self, p: AttentionProjection, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes this step's K/V into the paged cache, copies shared partial blocks (copy-on-write),
        then attends. p's tensors hold the step's T tokens exactly; returns [T, HQ, Dh] (copied into
        `out` when given)."""
        return attention_core(p.q, p.k, p.v, batch, k_cache, v_cache, self.scale, out)

    def finish(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """core: [T, HQ, Dh]; gate: [T, HQ, Dh] (a strided view) -> o_proj(core * sigmoid(gate))
        [T, hidden], the gate in fp32 with one rounding (one kernel on CUDA). Token-wise."""
        out = sigmoid_gate_mul(core, gate)
        return apply_linear(self.o_proj, out.flatten(1))


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

    `forward` composes the public parts `embed`, `project` / `core` / `finish` per layer and
    `compute_logits`; runner/piecewise.py composes the same parts around static buffers and CUDA
    graphs. Only `core` reads the step's metadata and the pools.

    With `with_vision`, `visual` is the vision tower (models/vision.py); the runner calls it before
    the forward and hands its outputs in as `batch.embedding_overrides`. With `mtp_layers` (speculative
    decoding), `mtp` is the multi-token-prediction head (models/mtp.py; else None), whose KV is the
    last attention layer of the pools.
    """

    def __init__(self, config: ModelConfig, *, with_vision: bool = False, mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
        self.visual = VisionTransformer(config.vision) if with_vision and config.vision is not None else None
        self.mtp = MultiTokenPredictor(config, mtp_layers, GatedAttention(config)) if mtp_layers else None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

        # index of each layer's tensors in LayerCaches (conv/ssm for GDN layers, k/v for attention)
        self._cache_index = [
            config.gdn_layer_ids.index(i) if kind == "linear_attention" else config.attention_layer_ids.index(i)
            for i, kind in enumerate(config.layer_types)
        ]

    def pool_shapes(self, dtype: torch.dtype) -> PoolShapes:
        """What the pools hold per sequence for this model (cache/sizing.py), states and KV in `dtype`;
        the MTP head's KV (when built) is one more attention layer, the last."""
        config = self.config
        num_attention = len(config.attention_layer_ids) + (self.mtp is not None)
        return PoolShapes(num_attention, config.num_key_value_heads, config.head_dim, dtype,
                          len(config.gdn_layer_ids), GatedDeltaNet.state_spec(config, dtype))

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers (rotary tables) on `device` after `to_empty`."""
        config = self.config
        dim = config.rotary_dim
        self.rotary.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.rotary.mrope_axis = mrope_axes(dim // 2, config.mrope_section, device)

    def core_kind(self, layer_id: int) -> str:
        """"recurrent" for a Gated DeltaNet layer, "attention" for gated attention."""
        return "recurrent" if self.model.layers[layer_id].is_recurrent else "attention"

    def core_shape(self, layer_id: int) -> tuple[int, int]:
        """(heads, dim) of the core output of layer `layer_id`: (HV, V) for GDN, (HQ, Dh) for attention."""
        layer = self.model.layers[layer_id]
        if layer.is_recurrent:
            return layer.linear_attn.num_v_heads, layer.linear_attn.head_v_dim
        return layer.self_attn.num_heads, layer.self_attn.head_dim

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              embedding_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids: [T] long; positions: [T] or [3, T] (multi-axis) long -> hidden [T, hidden] and the
        rotary tables (cos, sin): [T, rotary_dim] in the model dtype. Token-wise without overrides."""
        hidden = self.model.embed_tokens(input_ids)
        if embedding_overrides is not None:  # image tokens take the vision tower's rows
            index, embeds = embedding_overrides
            hidden = hidden.index_copy(0, index, embeds.to(hidden.dtype))
        return hidden, self.rotary.cos_sin(positions, hidden.dtype)

    def projection_width(self, layer_id: int) -> int:
        """Columns of layer `layer_id`'s stacked projection GEMM (the `stacked_out` of `project`)."""
        layer = self.model.layers[layer_id]
        return (layer.linear_attn if layer.is_recurrent else layer.self_attn).stacked_width()

    def project(self, layer_id: int, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                stacked_out: torch.Tensor | None = None) -> GDNProjection | AttentionProjection:
        """hidden: [T, hidden], the residual stream entering the layer -> its input norm and mixer
        projections. Token-wise. With `stacked_out` [T, projection_width(layer_id)] the projection
        GEMM writes there and the fields that are its column views (GDN: mixed, z; attention: v)
        are views of it (runner/piecewise.py: no copy into its static buffers)."""
        layer = self.model.layers[layer_id]
        x = layer.input_layernorm(hidden)
        if layer.is_recurrent:
            return layer.linear_attn.project(x, stacked_out)
        return layer.self_attn.project(x, cos_sin, stacked_out)

    def core(self, layer_id: int, p: GDNProjection | AttentionProjection, batch: ForwardBatch, caches: LayerCaches,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's varlen part on the step's T tokens (reads `batch`, reads and writes the pools'
        rows) -> [T, heads, dim] (see `core_shape`), written into `out` when given."""
        layer, j = self.model.layers[layer_id], self._cache_index[layer_id]
        if layer.is_recurrent:
            return layer.linear_attn.core(p, batch, caches.conv[j], caches.ssm[j], out)
        return layer.self_attn.core(p, batch, caches.k[j], caches.v[j], out)

    def attention_core(self, layer_id: int, p: AttentionProjection, batch: ForwardBatch, caches: LayerCaches,
                       out: torch.Tensor) -> None:
        """The core of attention layer `layer_id` into `out` [T, HQ, Dh] (Qwen has no parallel layers:
        an attention layer's core is all attention). ValueError for a GDN layer."""
        layer = self.model.layers[layer_id]
        if layer.is_recurrent:
            raise ValueError(f"layer {layer_id} is a Gated DeltaNet layer: it has no attention core")
        j = self._cache_index[layer_id]
        layer.self_attn.core(p, batch, caches.k[j], caches.v[j], out)

    def recurrent_core_params(self, layer_id: int) -> GDNCoreParams:
        """GDN layer `layer_id`'s parameters that its core reads: the causal conv weight [conv_dim, W]
        (a view of the parameter)."""
        return self.model.layers[layer_id].linear_attn.core_params()

    def recurrent_core(self, p: GDNProjection, batch: ForwardBatch, conv_states: torch.Tensor,
                       ssm_states: torch.Tensor, params: GDNCoreParams, row_offset: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
        """The core of the GDN layer that the device data selects: conv_states [L * S, conv_dim, W-1] and
        ssm_states [L * S, HV, K, V] are the flattened `LayerCaches.conv_stack / ssm_stack`; row_offset
        (0-dim long) = j * S and params = `recurrent_core_params` of the j-th GDN layer. Equal to
        `core` of that layer (same function, GDN layers share their shapes); writes `out` [T, HV, V]."""
        gdn = self.model.layers[self.config.gdn_layer_ids[0]].linear_attn
        return gdn.core(p, batch, conv_states, ssm_states, out, params=params, row_offset=row_offset)

    def finish(self, layer_id: int, residual: torch.Tensor, p: GDNProjection | AttentionProjection,
               core: torch.Tensor) -> torch.Tensor:
        """residual: [T, hidden] (the stream entering the layer); core: the layer's core output ->
        the stream leaving the layer [T, hidden]. Token-wise."""
        layer = self.model.layers[layer_id]
        if layer.is_recurrent:
            mixer_out = layer.linear_attn.finish(core, p.z)
        else:
            mixer_out = layer.self_attn.finish(core, p.gate)
        normed, hidden = layer.post_attention_layernorm(mixer_out, residual)  # fused residual add
        if isinstance(layer.mlp, SparseMoE):
            return layer.mlp(normed, residual=hidden)  # the residual add fused into the experts' combine
        return hidden + layer.mlp(normed)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden], the stream leaving the last layer; logits_indices: [R] -> [R, vocab]
        float32 (final norm and lm_head on the sampled rows only)."""
        return self.lm_head(self.model.norm(hidden.index_select(0, logits_indices))).float()

    def norm_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden], the stream leaving the last layer -> the final norm of it [T, hidden]
        (what lm_head reads; the MTP head's `previous`)."""
        return self.model.norm(hidden)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """The stream leaving the last layer [T, hidden]: `forward` without `compute_logits`."""
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        hidden, cos_sin = self.embed(batch.input_ids, positions, batch.embedding_overrides)
        for layer_id in range(len(self.model.layers)):
            p = self.project(layer_id, hidden, cos_sin)
            hidden = self.finish(layer_id, hidden, p, self.core(layer_id, p, batch, caches))
        return hidden

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(batch, caches), batch.logits_indices)
