"""Gated activations (CPU path = the reference): SwiGLU and the attention output gate, fp32 math with
one rounding at the end."""

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels.activation import sigmoid_gate_mul, silu_and_mul


@pytest.mark.parametrize("shape", [(1, 16), (7, 24), (0, 8), (3, 5, 12)])
def test_fp32_equals_transformers_mlp_activation(shape):
    """For fp32 it is exactly transformers' `act_fn(gate_proj(x)) * up_proj(x)`."""
    gen = torch.Generator().manual_seed(sum(shape))
    gate, up = (3 * torch.randn(shape, generator=gen)), torch.randn(shape, generator=gen)
    assert torch.equal(silu_and_mul(gate, up), F.silu(gate) * up)


def test_bf16_on_chunked_halves_equals_grouped_moe_code():
    """The two halves of `h.chunk(2, -1)` (strided views), as the grouped MoE computed them."""
    gen = torch.Generator().manual_seed(1)
    h = (3 * torch.randn(9, 2 * 20, generator=gen)).bfloat16()
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    g32, u32 = h.float().chunk(2, dim=-1)
    out = silu_and_mul(gate, up)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, (F.silu(g32) * u32).to(torch.bfloat16))


def test_rejects_mismatched_halves():
    with pytest.raises(ValueError, match="share shape and dtype"):
        silu_and_mul(torch.zeros(2, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="share shape and dtype"):
        silu_and_mul(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(1, 4, 16), (9, 3, 8), (0, 4, 16), (5, 40)])
def test_sigmoid_gate_mul_fp32_equals_the_unfused_gate(shape):
    """fp32: exactly `x * torch.sigmoid(gate)` (the gate contiguous, as transformers has it), for the
    gate as a strided view too (same result whatever its layout)."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    wide = 4 * torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    gate = wide[..., shape[-1]:]
    assert not gate.is_contiguous() or not gate.numel()
    assert torch.equal(sigmoid_gate_mul(x, gate), x * torch.sigmoid(gate.contiguous()))


def test_sigmoid_gate_mul_bf16_rounds_once():
    gen = torch.Generator().manual_seed(2)
    x, gate = ((3 * torch.randn(7, 4, 16, generator=gen)).bfloat16() for _ in range(2))
    out = sigmoid_gate_mul(x, gate)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() * torch.sigmoid(gate.float())).bfloat16())
    assert not torch.equal(out, x * torch.sigmoid(gate))  # the op-by-op bf16 form rounds twice


def test_sigmoid_gate_mul_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="x and gate must share shape and dtype"):
        sigmoid_gate_mul(torch.zeros(2, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="x and gate must share shape and dtype"):
        sigmoid_gate_mul(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))
