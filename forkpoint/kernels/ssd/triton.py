"""Decode step of the SSD scan on a state pool, in place, in Triton (GPU variant of
``reference.ssd_step_inplace``; same signature and semantics).

Grid: (N sequences, H heads, P / BP blocks). Program (n, h, b) owns the tile

    state_pool[slots[n], h, b*BP:(b+1)*BP, :]        [BP, N] fp32, N contiguous

loads it from the pool row, decays it by exp(dt A_h), adds dt x B^T (B of head h's group), stores
it back and writes y = H C + D x for its BP outputs. Rows of P are independent, so no program
shares data with another as long as ``slots`` are distinct (the documented precondition).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.ssd.reference import _check, check_pool


@triton.jit
def _ssd_step_kernel(x, dt, A, B, C, D, pool, slots, y, stride_xn, stride_xh, stride_bn, stride_bg,
                     stride_cn, stride_cg, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                     GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr):
    i_n, i_h, i_p = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_g = i_h // GROUP
    o_p = i_p * BP + tl.arange(0, BP)
    o_s = tl.arange(0, BN)
    m_p, m_s = o_p < P, o_s < N
    b_x = tl.load(x + i_n * stride_xn + i_h * stride_xh + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_b = tl.load(B + i_n * stride_bn + i_g * stride_bg + o_s, mask=m_s, other=0.0).to(tl.float32)
    b_c = tl.load(C + i_n * stride_cn + i_g * stride_cg + o_s, mask=m_s, other=0.0).to(tl.float32)
    b_dt = tl.load(dt + i_n * H + i_h).to(tl.float32)
    b_a = tl.load(A + i_h).to(tl.float32)
    slot = tl.load(slots + i_n).to(tl.int64)
    p_s = pool + (slot * H + i_h) * P * N + o_p[:, None] * N + o_s[None, :]
    m_ps = m_p[:, None] & m_s[None, :]
    b_s = tl.load(p_s, mask=m_ps, other=0.0)
    b_s = b_s * tl.exp(b_dt * b_a) + (b_x * b_dt)[:, None] * b_b[None, :]
    tl.store(p_s, b_s, mask=m_ps)
    b_y = tl.sum(b_s * b_c[None, :], axis=1)
    if HAS_D:
        b_y = b_y + tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(y + (i_n * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)


def ssd_step_inplace(x, dt, A, B, C, state_pool, slots, *, D=None):
    """x: [N, H, P]; dt: [N, H]; A: [H]; B, C: [N, G, N] (last dims contiguous); state_pool:
    [S, H, P, N] fp32, contiguous, rows ``slots`` [N] (distinct; not checked, that would sync)
    read and overwritten. Returns y [N, H, P] in x.dtype. One launch, no host synchronisation."""
    _check(x, dt, A, B, C, D)
    check_pool(state_pool, slots, x, B)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel writes its rows in place")
    n, heads, head_dim = x.shape
    groups, state_dim = B.shape[1:]
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    dt, A = dt.float().contiguous(), A.float().contiguous()
    y = torch.empty(n, heads, head_dim, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    bp = min(16, triton.next_power_of_2(head_dim))
    grid = (n, heads, triton.cdiv(head_dim, bp))
    _ssd_step_kernel[grid](x, dt, A, B, C, D if D is not None else A, state_pool, slots, y,
                           x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                           H=heads, P=head_dim, N=state_dim, GROUP=heads // groups, BP=bp,
                           BN=triton.next_power_of_2(state_dim), HAS_D=D is not None, num_warps=4)
    return y
