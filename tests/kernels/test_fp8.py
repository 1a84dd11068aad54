"""The FP8 reference: block quantiser, dequantiser, activation quantisation, the W8A8 spec and the CPU
paths (fp8_linear, fused_moe_fp8) against independent computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels.fp8 import fp8_linear, fused_moe_fp8, reference
from forkpoint.kernels.moe import reference as moe_reference

GEN = torch.Generator().manual_seed


def blockwise_loop(w, block):
    """scale_inv and the dequantised weight, block by block (the definition, no broadcasting tricks)."""
    bn, bk = block
    n, k = w.shape
    q, s = reference.quantize_blocks(w, block)
    expected = torch.empty(n, k)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            tile = w[i:i + bn, j:j + bk]
            scale = tile.abs().max() / 448.0
            assert s[i // bn, j // bk] == scale
            expected[i:i + bn, j:j + bk] = (tile / scale).to(torch.float8_e4m3fn).float() * scale
    return q, s, expected


@pytest.mark.parametrize("shape,block", [((96, 64), (16, 32)), ((100, 70), (32, 32)), ((7, 130), (128, 128))])
def test_quantize_and_dequantize_blocks_follow_the_definition(shape, block):
    w = torch.randn(shape, generator=GEN(0))
    q, s, expected = blockwise_loop(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == reference.block_scale_shape(shape, block)
    assert torch.equal(reference.dequantize_blocks(q, s, block), expected)
    # each block's largest magnitude is exact; the rest within e4m3's half step (2^-4 relative)
    err = (reference.dequantize_blocks(q, s, block) - w).abs()
    assert (err <= w.abs() * 2**-4 + 1e-12).all()


def test_zero_blocks_get_unit_scales_and_stacked_experts_quantise_per_expert():
    w = torch.randn(3, 32, 48, generator=GEN(1))
    w[1, :16, :16] = 0.0
    q, s = reference.quantize_blocks(w, (16, 16))
    assert s.shape == (3, 2, 3) and s[1, 0, 0] == 1.0
    for e in range(3):
        assert torch.equal(s[e], reference.quantize_blocks(w[e], (16, 16))[1])
    assert torch.equal(reference.dequantize_blocks(q, s, (16, 16))[1, :16, :16], torch.zeros(16, 16))


def test_check_block_scales_names_the_shapes():
    q, s = reference.quantize_blocks(torch.randn(40, 64), (16, 32))
    with pytest.raises(ValueError, match=r"scale_inv of shape \(3, 2\)"):
        reference.dequantize_blocks(q, s[:2], (16, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        reference.dequantize_blocks(q.float(), s, (16, 32))


def test_activation_quantisation_per_token_group():
    x = torch.randn(5, 200, generator=GEN(2)) * 3
    x[2] = 0.0
    xq, s = reference.quantize_activations(x, 64)
    assert xq.shape == x.shape and s.shape == (5, 4)
    for m in range(5):
        for g in range(4):
            group = x[m, g * 64:(g + 1) * 64]
            scale = max(group.abs().max().item(), 1e-10) / 448.0
            assert s[m, g].item() == pytest.approx(scale, rel=1e-7)
            assert torch.equal(xq[m, g * 64:(g + 1) * 64], (group / s[m, g]).to(torch.float8_e4m3fn))
    assert (xq[2].float() == 0).all()


def test_w8a8_spec_is_the_fake_quantised_product():
    gen = GEN(3)
    w, x, bias = torch.randn(48, 96, generator=gen), torch.randn(6, 96, generator=gen), torch.randn(48, generator=gen)
    q, s = reference.quantize_blocks(w, (16, 32))
    xq, xs = reference.quantize_activations(x, 32)
    a = (xq.float().view(6, 3, 32) * xs[..., None]).view(6, 96)
    expected = a @ reference.dequantize_blocks(q, s, (16, 32)).T + bias
    torch.testing.assert_close(reference.w8a8_block_linear(x, q, s, (16, 32), bias), expected, rtol=1e-6, atol=1e-6)
    # activation quantisation is a small relative error (e4m3: 3 mantissa bits)
    dense = F.linear(x, reference.dequantize_blocks(q, s, (16, 32)), bias)
    rel = (reference.w8a8_block_linear(x, q, s, (16, 32), bias) - dense).norm() / dense.norm()
    assert 0 < rel < 0.05


def test_cpu_fp8_linear_is_the_dequantised_linear_into_strided_out():
    gen = GEN(4)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(3, 64, generator=gen)
    q, s = reference.quantize_blocks(w, (16, 32))
    expected = F.linear(x, reference.dequantize_blocks(q, s, (16, 32)))
    assert torch.equal(fp8_linear(x, q, s, (16, 32)), expected)
    wide = torch.full((3, 50), float("nan"))
    fp8_linear(x, q, s, (16, 32), out=wide[:, 5:45])
    assert torch.equal(wide[:, 5:45], expected) and torch.isnan(wide[:, :5]).all() and torch.isnan(wide[:, 45:]).all()


def test_cpu_fused_moe_fp8_equals_the_moe_reference_on_dequantised_experts():
    gen = GEN(5)
    num_experts, hidden, inter, tokens, block = 6, 64, 32, 9, (16, 32)
    gate_up, gs = reference.quantize_blocks(torch.randn(num_experts, 2 * inter, hidden, generator=gen), block)
    down, ds = reference.quantize_blocks(torch.randn(num_experts, hidden, inter, generator=gen), block)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.topk(torch.rand(tokens, num_experts, generator=gen), 2, dim=-1)
    extras = dict(shared=torch.randn(tokens, hidden, generator=gen), shared_gate=torch.randn(tokens, 1, generator=gen),
                  residual=torch.randn(tokens, hidden, generator=gen))
    ours = fused_moe_fp8(x, gate_up, gs, down, ds, block, weights, ids, **extras)
    theirs = moe_reference.fused_moe(x, reference.dequantize_blocks(gate_up, gs, block),
                                     reference.dequantize_blocks(down, ds, block), weights, ids, **extras)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 6\)"):
        fused_moe_fp8(x, gate_up, gs, down, ds, block, weights, ids + 5)
