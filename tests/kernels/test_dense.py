"""Dense projection (CPU path = the reference): exactly F.linear, into `out` when given, and clear
errors for inputs that do not fit together."""

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels import dense
from forkpoint.kernels.dense import reference


def inputs(m, n, k, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (7, 33, 200), (0, 16, 8), (5, 1, 3)])
def test_equals_f_linear(dtype, bias, m, n, k):
    x, w, b = inputs(m, n, k, dtype, bias, seed=m + n + k)
    y = dense.linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.equal(y, F.linear(x, w, b))


@pytest.mark.parametrize("bias", [True, False])
def test_out_is_written_and_returned(bias):
    x, w, b = inputs(6, 24, 48, torch.bfloat16, bias)
    out = torch.full((6, 24), float("nan"), dtype=torch.bfloat16)
    y = dense.linear(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, F.linear(x, w, b))


def test_strided_inputs_give_f_linear():
    x, w, b = inputs(5, 12, 32)
    assert torch.equal(dense.linear(x[:, ::2], w[::2, ::2], b[::2]), F.linear(x[:, ::2], w[::2, ::2], b[::2]))


def test_cpu_dispatch_is_the_reference():
    from forkpoint.kernels import select_variant

    assert select_variant("dense", "triton", False) is reference


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((4,), (8, 4), "x \\[M, K\\] and weight \\[N, K\\]"),
    ((2, 3, 4), (8, 4), "flatten x's leading dims"),
    ((2, 4), (8, 5), "with one K"),
    ((2, 4), (8,), "with one K"),
])
def test_rejects_mismatched_shapes(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        dense.linear(torch.zeros(x_shape), torch.zeros(w_shape))


def test_rejects_bad_bias_and_out():
    x, w, b = inputs(3, 8, 4)
    with pytest.raises(ValueError, match="bias must be \\[N\\] = \\[8\\]"):
        dense.linear(x, w, torch.zeros(7))
    with pytest.raises(ValueError, match="bias is torch.bfloat16"):
        dense.linear(x, w, b.bfloat16())
    with pytest.raises(ValueError, match="weight is torch.bfloat16"):
        dense.linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="out must be a contiguous \\[M, N\\] = \\[3, 8\\]"):
        dense.linear(x, w, b, out=torch.empty(3, 9))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        dense.linear(x, w, b, out=torch.empty(8, 3).t())
    with pytest.raises(ValueError, match="out is torch.float16"):
        dense.linear(x, w, b, out=torch.empty(3, 8, dtype=torch.float16))


def test_tile_table_is_well_formed():
    """Ascending M buckets per class, tl.dot tiles of at least 16 rows, broadcast ones of at most 4,
    and a last class that takes every (N, K)."""
    tri = pytest.importorskip("forkpoint.kernels.dense.triton")
    assert tri.TABLE[-1].max_n == tri.TABLE[-1].max_k == float("inf")
    for shape in tri.TABLE:
        assert [t.max_m for t in shape.tiles] == sorted({t.max_m for t in shape.tiles})
        for t in shape.tiles:
            assert (t.block_m >= 16) if t.dot else (t.block_m <= 4)
    assert tri.tile_for(1, 2048, 4096) is not None
    assert tri.tile_for(10**6, 2048, 4096) is None
