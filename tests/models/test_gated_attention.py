"""Qwen3.5's gated attention layer (models/qwen3_5.py `GatedAttention`) with its fused prologue and
output gate, on CPU (the reference kernels):

- `project` equals the unfused sequence it replaced (q RMSNorm, k RMSNorm, rotary on each, gate
  and v as they come from the GEMM) bit for bit, in fp32 and bf16; its four fields are views of
  the stacked GEMM output (`stacked_out` when given), so the piecewise runner copies none of them;
- `finish` is o_proj(core * sigmoid(gate)) with the gate in fp32 and one rounding (in fp32 exactly
  the unfused `core * torch.sigmoid(gate)`).
The whole model against transformers: tests/models/test_vs_transformers.py.
"""

import pytest
import torch
import torch.nn.functional as F

from forkpoint import LLM
from forkpoint.config import ModelConfig
from forkpoint.kernels.norms.reference import rms_norm
from forkpoint.kernels.rotary.reference import apply_rotary
from forkpoint.models.layers import RotaryEmbedding
from forkpoint.models.qwen3_5 import GatedAttention
from forkpoint.runner.piecewise import PiecewiseForward, _same_view


def layer(config: ModelConfig, dtype: torch.dtype, seed: int) -> GatedAttention:
    attention = GatedAttention(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    attention = attention.to(dtype)
    attention.stack_projections()
    return attention


def inputs(config: ModelConfig, tokens: int, dtype: torch.dtype, seed: int, multi_axis: bool = False):
    """x [T, hidden] and the model's rotary tables for random (or multi-axis) positions."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(dtype)
    rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
    positions = torch.randint(0, 4000, (3, tokens) if multi_axis else (tokens,), generator=gen)
    return x, rotary.cos_sin(positions, dtype)


@pytest.fixture(autouse=True)
def inference():
    """The model runs under inference mode (project overwrites views of its GEMM output in place)."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def config(moe_model):
    return ModelConfig.from_hf_dir(moe_model[0])


@pytest.mark.parametrize("multi_axis", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 13, 0])
def test_project_equals_the_unfused_sequence(config, dtype, tokens, multi_axis):
    assert 0 < config.rotary_dim < config.head_dim  # partial rotary, as Qwen3.5
    attention = layer(config, dtype, seed=tokens)
    x, (cos, sin) = inputs(config, tokens, dtype, seed=tokens + 1, multi_axis=multi_axis)
    hq, hkv, dh = attention.num_heads, attention.num_kv_heads, attention.head_dim
    q_gate, k, v = (t.clone() for t in attention.project_stacked(x))  # the raw GEMM columns
    q, gate = q_gate.view(tokens, hq, 2 * dh).split(dh, dim=-1)
    q = apply_rotary(rms_norm(q, attention.q_norm.weight, config.rms_norm_eps), cos, sin)
    k = apply_rotary(rms_norm(k.view(tokens, hkv, dh), attention.k_norm.weight, config.rms_norm_eps), cos, sin)
    p = attention.project(x, (cos, sin))
    assert torch.equal(p.q, q) and torch.equal(p.k, k)
    assert torch.equal(p.v, v.view(tokens, hkv, dh)) and torch.equal(p.gate, gate)


def test_projection_fields_are_views_of_stacked_out(config):
    attention = layer(config, torch.float32, seed=3)
    x, cos_sin = inputs(config, 6, torch.float32, seed=4)
    stacked = torch.full((6, attention.stacked_width()), float("nan"))
    p = attention.project(x, cos_sin, stacked_out=stacked)
    for name, field in p._asdict().items():
        assert field.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr(), name
    assert not torch.isnan(stacked).any()
    assert torch.equal(p.q, attention.project(x, cos_sin).q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_gates_in_fp32_with_one_rounding(config, dtype):
    attention = layer(config, dtype, seed=5)
    x, cos_sin = inputs(config, 9, dtype, seed=6)
    gate = attention.project(x, cos_sin).gate
    core = torch.randn(9, attention.num_heads, attention.head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    gated = (core.float() * torch.sigmoid(gate.float().contiguous())).to(dtype)
    expected = F.linear(gated.flatten(1), attention.o_proj.weight, attention.o_proj.bias)
    assert torch.equal(attention.finish(core, gate), expected)
    if dtype == torch.float32:  # exactly the unfused expression it replaced
        unfused = core.reshape(9, -1) * torch.sigmoid(gate.reshape(9, -1))
        assert torch.equal(attention.finish(core, gate), attention.o_proj(unfused))


def test_piecewise_pieces_copy_no_attention_projection(moe_model):
    """The piece that projects an attention layer gets q, k, v and gate as the very views of the
    static stacked buffer that its projection buffers are (q, k normed and rotated there), so
    `_copy_into` copies none of them."""
    llm = LLM(str(moe_model[0]), num_kv_blocks=32, max_num_seqs=2, enable_checkpoints=False)
    model = llm.engine.runner.model
    piecewise = PiecewiseForward(model, (8,), llm.engine.device, capture=False)
    stacked = piecewise.stacked["attention"]
    static = piecewise.projection["attention"]
    for name, field in static._asdict().items():
        assert field.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr(), name
    layer_id = model.config.attention_layer_ids[0]
    hidden = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(8))
    p = model.project(layer_id, hidden, (piecewise.cos[:8], piecewise.sin[:8]), stacked_out=stacked[:8])
    for name, field in p._asdict().items():
        assert _same_view(getattr(static, name)[:8], field), name
