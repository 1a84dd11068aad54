"""Rotary position embedding on CUDA in Triton (GPU variant of `reference.py`).

apply_rotary: one launch. Grid (T, ceil(heads / BLOCK_H)): each program rotates BLOCK_H heads of
one token, reading each element and its rotate-half partner from x (row strides allowed, last dim
contiguous) and the token's cos / sin once. The math is fp32 with one rounding per output (the
reference rounds after each op in x's dtype, as transformers does: bf16 results differ by an ulp or so).

qk_norm_rotary_: one launch for what took four (q RMSNorm, k RMSNorm, two rotaries), in place, so
that the normed and rotated q, k stay the column views of the stacked projection they were (no
copies into the piecewise runner's static buffers). Rows are the T * HQ q heads, then the T * HKV
k heads; each program normalises BLOCK_R rows of one of them in the tiles of the norms' row kernel
(`norms.triton.row_tiles`), rounds the normed values to the output dtype exactly where
`norms.triton.rms_norm` does, and rotates them as `apply_rotary` above does (fp32, one rounding).
So on CUDA it reproduces the unfused Triton sequence (norm kernel, then rotary kernel) bit for bit,
up to the order of the fp32 sum of squares, which follows the same tile shape and warps.
The rotate-half partner of a dim is read (and normalised) a second time from memory; every program
loads all it needs, then waits at a barrier before it writes, as its rows are overwritten in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.norms.triton import row_tiles
from forkpoint.kernels.rotary.reference import check, check_qk


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


@triton.jit
def _norm_rotary_rows(x, w, cos, sin, block, n_rows, H, D, R, stride_t, stride_h, stride_c, stride_s, eps,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows block * BLOCK_R .. of x [T, H, D] (row r = head r % H of token r // H), in place."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m_d = cols < D
    m_r = rows < n_rows
    mask = m_r[:, None] & m_d[None, :]
    t = (rows // H).to(tl.int64)
    start = t * stride_t + (rows % H).to(tl.int64) * stride_h
    xv = tl.load(x + start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)
    wv = 1.0 + tl.load(w + cols, mask=m_d, other=0.0).to(tl.float32)
    nv = ((xv * inv[:, None]) * wv[None, :]).to(x.dtype.element_ty).to(tl.float32)  # rms_norm's output
    half = R // 2
    rot = cols < R
    m_rot = m_r[:, None] & rot[None, :]
    partner = tl.where(cols < half, cols + half, cols - half)
    pxv = tl.load(x + start[:, None] + partner[None, :], mask=m_rot, other=0.0).to(tl.float32)
    pwv = 1.0 + tl.load(w + partner, mask=rot, other=0.0).to(tl.float32)
    pnv = ((pxv * inv[:, None]) * pwv[None, :]).to(x.dtype.element_ty).to(tl.float32)
    c = tl.load(cos + t[:, None] * stride_c + cols[None, :], mask=m_rot, other=1.0).to(tl.float32)
    s = tl.load(sin + t[:, None] * stride_s + cols[None, :], mask=m_rot, other=0.0).to(tl.float32)
    sign = tl.where(cols < half, -1.0, 1.0)
    out = tl.where(rot[None, :], nv * c + sign[None, :] * pnv * s, nv)
    tl.debug_barrier()  # every load of the program is done before any row is overwritten
    tl.store(x + start[:, None] + cols[None, :], out.to(x.dtype.element_ty), mask=mask)


# the token-dependent counts are not specialised (== 1, % 16): every step size shares one compiled
# variant, so nothing compiles after the warm-up
@triton.jit(do_not_specialize=["q_blocks", "n_q", "n_k"])
def _qk_norm_rotary_kernel(q, k, wq, wk, cos, sin, q_blocks, n_q, n_k, HQ, HKV, D, R, sq_t, sq_h, sk_t, sk_h,
                           stride_c, stride_s, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid < q_blocks:
        _norm_rotary_rows(q, wq, cos, sin, pid, n_q, HQ, D, R, sq_t, sq_h, stride_c, stride_s, eps,
                          BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    else:
        _norm_rotary_rows(k, wk, cos, sin, pid - q_blocks, n_k, HKV, D, R, sk_t, sk_h, stride_c, stride_s, eps,
                          BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)


def qk_norm_rotary_(q, k, q_weight, k_weight, eps, cos, sin):
    """Same contract as `reference.qk_norm_rotary_`; one launch, no host sync, in place. q: [T, HQ,
    Dh] and k: [T, HKV, Dh] with any token and head strides and a contiguous last dim (the stacked
    projection's column views); cos, sin: [T, rotary_dim] (last dim contiguous or copied). Returns
    (q, k)."""
    rotary_dim = check_qk(q, k, q_weight, k_weight, cos, sin)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k are written in place and need a contiguous last dim, got strides "
                         f"{q.stride()} and {k.stride()}")
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if num_tokens == 0 or head_dim == 0:
        return q, k
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_r, block_d, num_warps = row_tiles(head_dim)
    n_q, n_k = num_tokens * q_heads, num_tokens * kv_heads
    q_blocks = triton.cdiv(n_q, block_r)
    grid = (q_blocks + triton.cdiv(n_k, block_r),)
    _qk_norm_rotary_kernel[grid](q, k, q_weight.contiguous(), k_weight.contiguous(), cos, sin, q_blocks, n_q, n_k,
                                 q_heads, kv_heads, head_dim, rotary_dim, q.stride(0), q.stride(1), k.stride(0),
                                 k.stride(1), cos.stride(0), sin.stride(0), float(eps), BLOCK_R=block_r,
                                 BLOCK_D=block_d, num_warps=num_warps)
    return q, k
