"""RMSNorms on CUDA, in Triton (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.norms.reference`; imported only for CUDA
tensors by the dispatch in `forkpoint.kernels.norms`, so CPU installs never need Triton.

One launch per call, replacing ~8 elementwise kernels (float, pow, mean, rsqrt, mul, weight.float,
1 + w, cast) and the separate residual add; Mamba2's grouped gated norm: one launch for ~12.
Each program normalises BLOCK_R rows (or row groups) held whole in registers (BLOCK_D = next power
of two >= D; BLOCK_R * BLOCK_D = 2048 elements for D <= 2048, one row per program above that),
fp32 throughout; weights are read in their stored dtype.

Rows may be strided views (q of the interleaved q/gate projection, [T, heads, Dh] with row stride
2 * Dh): the leading dims are read as [A, B] with two strides, row r = a * B + b, last dim
contiguous. Outputs are new contiguous tensors of x's shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.norms import reference

_TILE = 2048  # elements per program (rows * padded D) for short rows


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., D] -> (x', B, stride_a, stride_b): row r = a * B + b of x' starts at a * stride_a +
    b * stride_b elements, with the last dim contiguous. A view when possible, else a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() > 3:
        x = x.flatten(0, -3)
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, 1, 0, 0


def row_tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) of the row-norm kernels for rows of d elements (also the fused
    q/k norm + rotary of kernels/rotary/triton.py, so that its norms reduce in the same tiles)."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, _TILE // block_d)
    num_warps = min(8, max(4, block_r * block_d // 512))
    return block_r, block_d, num_warps


@triton.jit
def _rms_norm_kernel(x, res, w, y, s, n_rows, B, D, sxa, sxb, sra, srb, eps,
                     HAS_RES: tl.constexpr, CENTRED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m_d = cols < D
    mask = (rows < n_rows)[:, None] & m_d[None, :]
    i_a = (rows // B).to(tl.int64)
    i_b = (rows % B).to(tl.int64)
    o_out = rows.to(tl.int64)[:, None] * D + cols[None, :]
    xv = tl.load(x + (i_a * sxa + i_b * sxb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        rv = tl.load(res + (i_a * sra + i_b * srb)[:, None] + cols[None, :], mask=mask, other=0.0)
        sv = (rv.to(tl.float32) + xv).to(s.dtype.element_ty)  # rounded as the unfused bf16 add
        tl.store(s + o_out, sv, mask=mask)
        xv = sv.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)
    wv = tl.load(w + cols, mask=m_d, other=0.0).to(tl.float32)
    if CENTRED:
        wv = 1.0 + wv
    yv = (xv * inv[:, None]) * wv[None, :]
    tl.store(y + o_out, yv.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x, z, w, y, n_rows, B, D, sxa, sxb, sza, szb, eps,
                           ROUND_WX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m_d = cols < D
    mask = (rows < n_rows)[:, None] & m_d[None, :]
    i_a = (rows // B).to(tl.int64)
    i_b = (rows % B).to(tl.int64)
    xv = tl.load(x + (i_a * sxa + i_b * sxb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)
    # the reference's casts: norm(x) -> dtype, w * norm in the promoted dtype, * silu(z) in fp32
    nv = (xv * inv[:, None]).to(y.dtype.element_ty).to(tl.float32)
    wv = tl.load(w + cols, mask=m_d, other=0.0).to(tl.float32)
    pv = nv * wv[None, :]
    if ROUND_WX:
        pv = pv.to(y.dtype.element_ty).to(tl.float32)
    zv = tl.load(z + (i_a * sza + i_b * szb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = pv * (zv * tl.sigmoid(zv))
    tl.store(y + rows.to(tl.int64)[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None, *, centred=True):
    """x: [..., D] (last dim contiguous or not; strided rows are read in place); weight: [D] (any
    float dtype, read as is; the factor is 1 + w when `centred`, else w); residual: None or x's
    shape and dtype. Returns y, or (y, s) with s = residual + x in x.dtype; new contiguous tensors
    of x's shape."""
    reference.check_shapes(x, weight, residual=residual)
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    n_rows = x.numel() // d if d else 0
    if n_rows:
        xr, b, sxa, sxb = _rows(x)
        # x and residual have one shape, so their [A, B, D] views share B
        rr, _, sra, srb = _rows(residual) if residual is not None else (xr, b, sxa, sxb)
        block_r, block_d, num_warps = row_tiles(d)
        grid = (triton.cdiv(n_rows, block_r),)
        _rms_norm_kernel[grid](xr, rr, weight.contiguous(), y, s, n_rows, b, d, sxa, sxb, sra, srb, float(eps),
                               HAS_RES=residual is not None, CENTRED=bool(centred), BLOCK_R=block_r, BLOCK_D=block_d,
                               num_warps=num_warps)
    return (y, s) if residual is not None else y


def gated_rms_norm(x, gate, weight, eps):
    """x, gate: [..., D] of one shape (strided rows read in place); weight: [D]. Returns
    (w * norm(x).to(dtype)) * silu(gate) in x.dtype, a new contiguous tensor of x's shape."""
    reference.check_shapes(x, weight, gate=gate)
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x.numel() // d if d else 0
    if n_rows:
        xr, b, sxa, sxb = _rows(x)
        zr, _, sza, szb = _rows(gate)  # same shape as x: same B
        round_wx = torch.promote_types(weight.dtype, x.dtype) == x.dtype
        block_r, block_d, num_warps = row_tiles(d)
        grid = (triton.cdiv(n_rows, block_r),)
        _gated_rms_norm_kernel[grid](xr, zr, weight.contiguous(), y, n_rows, b, d, sxa, sxb, sza, szb, float(eps),
                                     ROUND_WX=round_wx, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return y


@triton.jit
def _grouped_gated_rms_norm_kernel(x, z, w, y, n_rows, I, GS, sx, sz, eps, NORM_BEFORE_GATE: tl.constexpr,
                                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, g): rows i * BLOCK_R .. of norm group g (channels g * GS ..), fp32 throughout."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK_D)
    cols = tl.program_id(1) * GS + offs
    m_d = offs < GS
    mask = (rows < n_rows)[:, None] & m_d[None, :]
    r = rows.to(tl.int64)[:, None]
    xv = tl.load(x + r * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    zv = tl.load(z + r * sz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = zv * tl.sigmoid(zv)
    if not NORM_BEFORE_GATE:
        xv = xv * gate
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / GS + eps)
    wv = tl.load(w + cols, mask=m_d, other=0.0).to(tl.float32)
    out = (xv * inv[:, None]) * wv[None, :]
    if NORM_BEFORE_GATE:
        out = out * gate
    tl.store(y + r * I + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def grouped_gated_rms_norm(x, gate, weight, groups, eps, norm_before_gate=False, *, mean_square=None):
    """x, gate: [T, I] (row-strided views read in place); weight: [I]. Returns w * norm_g(x * silu(z))
    (or w * norm_g(x) * silu(z)) in x.dtype, a new contiguous [T, I] tensor; one launch. With a
    custom `mean_square` (a tensor-parallel rank holding part of a norm group) the reference runs."""
    if mean_square is not None:
        return reference.grouped_gated_rms_norm(x, gate, weight, groups, eps, norm_before_gate,
                                                mean_square=mean_square)
    reference.check_grouped_shapes(x, gate, weight, groups)
    n_rows, width = x.shape
    y = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
    if n_rows and width:
        x = x if x.stride(-1) == 1 else x.contiguous()
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        group_size = width // groups
        block_r, block_d, num_warps = row_tiles(group_size)
        grid = (triton.cdiv(n_rows, block_r), groups)
        _grouped_gated_rms_norm_kernel[grid](x, gate, weight.contiguous(), y, n_rows, width, group_size, x.stride(0),
                                             gate.stride(0), float(eps), NORM_BEFORE_GATE=bool(norm_before_gate),
                                             BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return y
