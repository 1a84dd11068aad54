"""SwiGLU activation (CPU path = the reference): fp32 math with one rounding at the end."""

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels.activation import silu_and_mul


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
