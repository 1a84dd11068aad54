"""Rotary position embedding on CUDA in one Triton launch (GPU variant of `reference.py`).

Grid (T, ceil(heads / BLOCK_H)): each program rotates BLOCK_H heads of one token, reading each
element and its rotate-half partner from x (row strides allowed, last dim contiguous) and the
token's cos / sin once. The math is fp32 with one rounding per output (the reference rounds after
each op in x's dtype, as transformers does: bf16 results differ by an ulp or so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.rotary.reference import check


@triton.jit
def _rotary_kernel(x, cos, sin, y, H, D, R, stride_xt, stride_xh, stride_c, stride_s,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    half = R // 2
    rot = dims < R
    m = (heads[:, None] < H) & (dims[None, :] < D)
    base = x + t * stride_xt + heads[:, None] * stride_xh
    v = tl.load(base + dims[None, :], mask=m, other=0.0).to(tl.float32)
    partner = tl.where(dims < half, dims + half, dims - half)
    pv = tl.load(base + partner[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)
    c = tl.load(cos + t * stride_c + dims, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin + t * stride_s + dims, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(dims < half, -1.0, 1.0)
    out = tl.where(rot[None, :], v * c[None, :] + sign[None, :] * pv * s[None, :], v)
    tl.store(y + t * H * D + heads[:, None] * D + dims[None, :], out.to(y.dtype.element_ty), mask=m)


def apply_rotary(x, cos, sin):
    """Same contract as `reference.apply_rotary`; one launch, no host sync. x: [T, heads, head_dim]
    (last dim contiguous); cos, sin: [T, rotary_dim] (last dim contiguous). Returns a new
    contiguous tensor of x's shape and dtype."""
    rotary_dim = check(x, cos, sin)
    num_tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    y = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 2048 // block_d))
    grid = (num_tokens, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x, cos, sin, y, heads, head_dim, rotary_dim, x.stride(0), x.stride(1), cos.stride(0),
                         sin.stride(0), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return y
