"""RMSNorms (CPU path = the reference) against transformers' Qwen3-Next modules, bit for bit, and
the fused residual add against the unfused `residual + x`."""

import pytest
import torch

from forkpoint.kernels.norms import gated_rms_norm, rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def hf_rms_norm(dim, weight):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    module = Qwen3NextRMSNorm(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


def hf_gated_rms_norm(dim, weight):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    module = Qwen3NextRMSNormGated(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    weight = (0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 48), (0, 32), (5, 4, 16), (2, 3, 2, 8)])
def test_rms_norm_equals_transformers(dtype, shape):
    x, weight, _ = inputs(shape, dtype, seed=sum(shape))
    y = rms_norm(x, weight, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, hf_rms_norm(shape[-1], weight)(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_heads(dtype):
    """q of the interleaved q/gate projection: [T, heads, D] with row stride 2D."""
    x, weight, gen = inputs((6, 3, 32), dtype, seed=1)
    q_gate = torch.cat([x, torch.randn(6, 3, 32, generator=gen).to(dtype)], dim=-1)
    q = q_gate.split(32, dim=-1)[0]
    assert not q.is_contiguous()
    assert torch.equal(rms_norm(q, weight, EPS), rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_equals_unfused(dtype):
    x, weight, gen = inputs((9, 40), dtype, seed=2)
    residual = (3 * torch.randn(9, 40, generator=gen)).to(dtype)
    y, s = rms_norm(x, weight, EPS, residual)
    unfused = residual + x
    assert s.dtype == dtype and torch.equal(s, unfused)
    assert torch.equal(y, rms_norm(unfused, weight, EPS))


def test_rms_norm_rejects_mismatches():
    x, weight, _ = inputs((4, 8), torch.float32, seed=3)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:4], EPS)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, weight, EPS, x.bfloat16())
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, weight, EPS, x[:2])


@pytest.mark.parametrize("weight_dtype", [None, torch.float32])  # None: the activations' dtype
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 32), (7, 2, 16), (0, 2, 16), (5, 24)])
def test_gated_rms_norm_equals_transformers(dtype, weight_dtype, shape):
    x, _, gen = inputs(shape, dtype, seed=10 + sum(shape))
    gate = (2 * torch.randn(shape, generator=gen)).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(weight_dtype or dtype)
    y = gated_rms_norm(x, gate, weight, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, hf_gated_rms_norm(shape[-1], weight)(x, gate))


def test_gated_rms_norm_rejects_mismatched_gate():
    x, _, _ = inputs((4, 8), torch.float32, seed=4)
    with pytest.raises(ValueError, match="gate must have"):
        gated_rms_norm(x, x[:, :4], torch.ones(8), EPS)
