"""Gated DeltaNet gating on CUDA, in Triton (GPU variant of `reference.py`).

Same signature and semantics as `forkpoint.kernels.gating.reference.gdn_gating`: one launch for
both outputs instead of ~9 elementwise kernels. Each program takes BLOCK_T tokens x all HV heads
(BLOCK_H = next power of two >= HV, BLOCK_T * BLOCK_H = 1024); a and b may have row strides (views
of a fused projection), their last dim contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.gating import reference


@triton.jit
def _gdn_gating_kernel(a, b, A_log, dt_bias, g, beta, T, HV, stride_a, stride_b,
                       BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    m_h = cols < HV
    mask = (rows < T)[:, None] & m_h[None, :]
    r = rows.to(tl.int64)[:, None]
    av = tl.load(a + r * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bv = tl.load(b + r * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(A_log + cols, mask=m_h, other=0.0).to(tl.float32)
    dt = tl.load(dt_bias + cols, mask=m_h, other=0.0).to(tl.float32)
    x = av + dt[None, :]
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p(u) = u * log(1 + u) / ((1 + u) - 1), exact
    # where 1 + u rounds to 1 (Goldberg's trick: no log1p needed); torch returns x itself above 20
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    d = w - 1.0
    log1p_u = tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_u)
    gv = -tl.exp(a_log)[None, :] * sp
    tl.store(g + r * HV + cols[None, :], gv, mask=mask)
    tl.store(beta + r * HV + cols[None, :], tl.sigmoid(bv).to(beta.dtype.element_ty), mask=mask)


def gdn_gating(a, b, A_log, dt_bias):
    """a, b: [T, HV] (row strides allowed); A_log, dt_bias: [HV] (any float dtype, read as is).
    Returns (g [T, HV] fp32, beta [T, HV] in b.dtype), new contiguous tensors."""
    reference.check_shapes(a, b, A_log, dt_bias)
    num_tokens, heads = a.shape
    g = torch.empty((num_tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((num_tokens, heads), dtype=b.dtype, device=b.device)
    if g.numel() == 0:
        return g, beta
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, 1024 // block_h)
    grid = (triton.cdiv(num_tokens, block_t),)
    _gdn_gating_kernel[grid](a, b, A_log.contiguous(), dt_bias.contiguous(), g, beta, num_tokens, heads,
                             a.stride(0), b.stride(0), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return g, beta
