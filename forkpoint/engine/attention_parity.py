"""The attention parity C of a model: the context length at which one prefill token's attention over the
positions before it costs what the rest of its work (its matrix products) costs (issue 27).

A prefill token at context position c multiplies each of its matrices once (a fixed cost) and, in each
attention layer, dots its query with c keys and sums c values (2 x heads x head_dim multiply-adds a
position), so it costs about (1 + c / C) times a token at position 0, where

    C = matmul multiply-adds per token / attention multiply-adds per context position.

engine/prefill_budget.py shrinks a long prefill's chunk in a step that decodes by that factor.

Counted per token (multiply-adds = weights touched): every layer's mixer projections (full attention:
q, its gate where Qwen's attention has one, k, v, o; GDN: qkv, z, b, a, out; Mamba2: in and out), its
feed-forward (dense: gate, up, down, or up and down for a non-gated activation; MoE: the top-k experts and
the shared expert, and the router). Left out: embeddings and the LM head (a prefill chunk computes logits
for its last token only), norms, convolutions and the recurrent scans (a few percent of the projections).

Checked on the CPU (2 cores, float32, the embedded model: C = 6,684 by this count) with
bench/attention_parity_cpu.py: the attention reference took 0.21 ms + 153 ns x c + 19.8 ns x t x c for t
queries after c positions (the c term: it gathers the whole context's keys and values once a step, whatever
t), and a prefill token's other work is 0.155 ms (bench/mixed_step_cost.py, a 64-token chunk's step over the
decode step at 0-2k positions), so C = 0.155 ms / 19.8 ns = 7,817 there. The count is the smaller: it errs on
the bystander's side and leaves some room for the gather, which does not shrink with the chunk
(docs/server.md, issue 27, session 19).
`EngineConfig.attention_parity_tokens` overrides it.
"""

from __future__ import annotations

from forkpoint.config import ModelConfig

_ATTENTION = ("full_attention", "parallel")  # layer types with attention (Falcon-H1's parallel layers too)
_MAMBA = ("mamba2", "parallel")  # layer types with a Mamba2 mixer


def attention_parity(model: ModelConfig) -> int | None:
    """C for `model`, in tokens (>= 1): its matmul multiply-adds per token over its attention
    multiply-adds per context position (module docstring). None for a model with no attention layer:
    its prefill tokens cost the same at every position."""
    layers = sum(t in _ATTENTION for t in model.layer_types)
    if not layers:
        return None
    per_position = layers * 2 * model.num_attention_heads * model.head_dim
    return max(1, round(matmul_params_per_token(model) / per_position))


def matmul_params_per_token(model: ModelConfig) -> int:
    """Weights of `model`'s matrix products one token multiplies (its multiply-adds), embeddings and LM
    head left out: every layer's mixer and feed-forward (MoE: the top-k experts, the shared expert and
    the router)."""
    return sum(_mixer_params(model, kind) + _feed_forward_params(model, i, kind)
               for i, kind in enumerate(model.layer_types))


def _mixer_params(model: ModelConfig, kind: str) -> int:
    hidden, total = model.hidden_size, 0
    if kind in _ATTENTION:
        query = model.num_attention_heads * model.head_dim
        gate = query if model.mamba2 is None else 0  # Qwen's attention gates its output (q_proj is 2x)
        total += hidden * (query + gate + 2 * model.num_key_value_heads * model.head_dim) + query * hidden
    if kind == "linear_attention":
        value = model.linear_num_value_heads * model.linear_value_head_dim
        total += hidden * (model.conv_dim + value + 2 * model.linear_num_value_heads) + value * hidden
    if kind in _MAMBA:
        mamba = model.mamba2.mamba
        inner = mamba.num_heads * mamba.head_dim
        total += hidden * (2 * inner + 2 * mamba.n_groups * mamba.state_size + mamba.num_heads) + inner * hidden
    return total


def _feed_forward_params(model: ModelConfig, layer: int, kind: str) -> int:
    """The feed-forward of layer `layer`: Nemotron-H has it in layers of its own ("mlp", "moe"), every
    other family in every layer (MoE where `moe_layers` says so)."""
    if model.mamba2 is not None and model.mamba2.family == "nemotron_h" and kind not in ("mlp", "moe"):
        return 0
    hidden = model.hidden_size
    matrices = 3 if model.mamba2 is None or model.mamba2.mlp_act == "silu" else 2
    if model.moe_layers[layer]:
        experts = model.num_experts_per_tok * model.moe_intermediate_size + model.shared_expert_intermediate_size
        return matrices * hidden * experts + hidden * model.num_experts
    return matrices * hidden * model.intermediate_size
