"""Decode step of the gated delta rule on a state pool, in place, in Triton (GPU variant of
`reference.recurrent_gated_delta_rule_inplace`).

Same signature and semantics as the reference. This module imports Triton (not fla) at its top; the
dispatch in `forkpoint.kernels.gated_delta` imports it only for CUDA tensors and falls back to the
reference when Triton is missing, so the CPU install never needs Triton.

Why in place: the gather / step / scatter path (`state_pool.index_select`, fla's fused recurrent
kernel, `index_copy_`) moves each sequence's fp32 state (HV * K * V * 4 bytes, 2 MiB per layer at
Qwen3.5-35B shapes) three times more than needed. Here every program loads its state tile straight
from the pool row, updates it in registers and stores it back to the same place: one read and one
write of the state, no temporary.

Grid: (N sequences, HV value heads, V / BV blocks). Program (n, j, b) owns the tile

    state_pool[slots[n], j, :, b*BV:(b+1)*BV]        [K, BV] fp32, V contiguous

and value head j reads q/k head j // (HV // H). The V columns of one head are independent in the
delta rule (S^T k and the rank-one update act column by column), so splitting V needs no
communication; each program recomputes the (cheap) l2 norms of its q and k rows. Programs never
share a tile as long as `slots` are distinct (the documented precondition), so the read-modify-write
needs no synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.gated_delta.reference import L2NORM_EPS, _check_heads, _check_out, _check_pool


@triton.jit
def _inplace_step_kernel(q, k, v, g, beta, pool, slots, o,
                         stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         scale, eps, K: tl.constexpr, V: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr):
    i_n, i_hv, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    b_q = tl.load(q + i_n * stride_qn + i_h * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_n * stride_kn + i_h * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + eps)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + eps)
    b_q = b_q * scale
    b_v = tl.load(v + i_n * stride_vn + i_hv * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_n * HV + i_hv).to(tl.float32)
    b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)

    # pool row offsets can pass 2**31 elements (S * HV * K * V): int64 from the slot on
    slot = tl.load(slots + i_n).to(tl.int64)
    p_h = pool + (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0)

    b_h = b_h * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta     # beta (v - S^T k): [BV]
    b_h = b_h + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_h * b_q[:, None], axis=0)                          # scale * S^T q: [BV]

    tl.store(p_h, b_h, mask=m_h)
    tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def _block_v(num_heads: int, head_v: int) -> tuple[int, int]:
    """(BV, num_warps) for N * HV = ``num_heads`` head states. Wide tiles when the batch alone fills
    the GPU; narrow ones, for more programs, when it is small (one sequence at 32 value heads makes
    only 32 * V / BV programs)."""
    bv = 32 if num_heads >= 512 else 8
    bv = min(bv, triton.next_power_of_2(head_v))
    return bv, (4 if bv >= 32 else 1)


def recurrent_gated_delta_rule_inplace(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=True,
                                       out=None):
    """One decode step of N sequences, updating their rows of the state pool in place; one launch.

    q, k: [N, H, K] (last dim contiguous); v: [N, HV, V] (last dim contiguous), HV % H == 0;
    g: [N, HV] fp32 log-decay (<= 0); beta: [N, HV]; state_pool: [S, HV, K, V] fp32, contiguous,
    rows ``slots`` read and overwritten, every other row untouched; slots: [N] long on the device.
    Precondition (not checked: that would sync the host): ``slots`` are distinct.
    Returns o [N, HV, V] in v.dtype, written into ``out`` (contiguous [N, HV, V] of v.dtype) when
    given. No host synchronisation (capturable in a CUDA graph).
    """
    _check_heads(q, k, v, g, beta)
    n, h, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    _check_pool(state_pool, slots, num_v_heads, head_k, head_v, n)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel writes its rows in place, so it cannot "
                         "work on a copy (pass the pool tensor itself)")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    o = _check_out(out, (n, num_v_heads, head_v), v.dtype)
    if o is None:
        o = torch.empty(n, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    bv, num_warps = _block_v(n * num_v_heads, head_v)
    grid = (n, num_v_heads, triton.cdiv(head_v, bv))
    _inplace_step_kernel[grid](
        q, k, v, g, beta, state_pool, slots, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        float(head_k ** -0.5 if scale is None else scale), L2NORM_EPS, head_k, head_v,
        HV=num_v_heads, GROUP=num_v_heads // h, BK=triton.next_power_of_2(head_k), BV=bv,
        L2NORM=bool(use_qk_l2norm), num_warps=num_warps,
    )
    return o
