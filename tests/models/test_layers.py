"""Building blocks of models/layers.py against transformers' Qwen3-Next modules (same weights), and
the contract of the fused residual add in `RMSNorm.forward(x, residual)`."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextMLP,
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
)

from forkpoint.models.layers import (
    STACK_ROW_MULTIPLE,
    DenseMLP,
    GatedRMSNorm,
    RMSNorm,
    SparseMoE,
    stack_all_projections,
)

EPS = 1e-6


def randomise(*modules, seed=0):
    """Identical random parameters in modules with the same parameter names."""
    gen = torch.Generator().manual_seed(seed)
    params = [dict(m.named_parameters()) for m in modules]
    with torch.no_grad():
        for name, p in params[0].items():
            value = 0.3 * torch.randn(p.shape, generator=gen)
            for ps in params:
                ps[name].copy_(value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers(dtype):
    ours, theirs = RMSNorm(24, EPS), Qwen3NextRMSNorm(24, eps=EPS)
    randomise(ours, theirs)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (2 * torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_rms_norm_with_residual_returns_normed_sum_and_sum():
    norm = RMSNorm(16, EPS)
    randomise(norm)
    norm = norm.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(2, 7, 16, generator=gen).bfloat16() for _ in range(2))
    out = norm(x, residual)
    assert isinstance(out, tuple) and len(out) == 2
    normed, summed = out
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, norm(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_transformers(dtype):
    ours, theirs = GatedRMSNorm(16, EPS), Qwen3NextRMSNormGated(16, eps=EPS)
    randomise(ours, theirs)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    gen = torch.Generator().manual_seed(3)
    x, gate = (torch.randn(6, 4, 16, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(ours(x, gate), theirs(x, gate))


def test_dense_mlp_equals_transformers_fp32():
    ours = DenseMLP(16, 40)
    theirs = Qwen3NextMLP(Qwen3NextConfig(hidden_size=16, intermediate_size=40, hidden_act="silu"))
    randomise(ours, theirs)
    ours.stack_projections()
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_stacked_projections_are_views_of_one_weight_with_the_checkpoint_names():
    mlp = DenseMLP(16, 40)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    before = {name: t.clone() for name, t in mlp.state_dict().items()}
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(6))
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    with pytest.raises(RuntimeError, match="stack_projections"):
        mlp(x)
    mlp.stack_projections()
    stacked = mlp._stack.runs[0].weight
    assert mlp.gate_proj.weight.data_ptr() == stacked.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == stacked.data_ptr() + 40 * 16 * stacked.element_size()
    after = mlp.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)


def test_stacked_rows_are_padded_to_aligned_output_rows_with_the_views_unchanged():
    """The MoE's shared gate/up (8 + 8 rows here), router (4) and shared gate (1) stack into 24:
    zero rows outside every view, so that the GEMM output's rows are aligned; the state dict and
    the projections are those of the checkpoint; the shared expert, absorbed, is not stacked again."""
    moe = SparseMoE(SimpleNamespace(hidden_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    moe_intermediate_size=8, shared_expert_intermediate_size=8))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    x = torch.randn(3, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    shared = moe.shared_expert
    expected = (x @ shared.gate_proj.weight.T, x @ shared.up_proj.weight.T, x @ moe.gate.weight.T,
                x @ moe.shared_expert_gate.weight.T)
    unstacked_shared = shared.down_proj(torch.nn.functional.silu(expected[0]) * expected[1])
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    stack_all_projections(moe)
    assert shared._stack is None
    assert moe.stacked_width() == 24 and moe.stacked_width() % STACK_ROW_MULTIPLE == 0
    assert torch.equal(moe._stack.runs[0].weight[21:], torch.zeros(3, x.shape[1]))
    assert all(torch.equal(v, state[k]) for k, v in moe.state_dict().items())
    outputs = moe.project_stacked(x)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shared.finish(*outputs[:2]), unstacked_shared, rtol=1e-5, atol=1e-5)
    out = torch.full((3, 24), float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(moe.project_stacked(x, out), outputs))
