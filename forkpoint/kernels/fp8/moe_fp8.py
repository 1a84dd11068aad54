"""Routed experts with block-wise FP8 (e4m3) weights on CUDA, in Triton (GPU variant of
`reference.fused_moe_fp8`).

The pipeline of `kernels/moe/grouped.py` (routes sorted by expert on the device, two expert GEMMs,
one fp32 combine with the shared expert and the residual), with expert tiles that read the e4m3
weights: each [BLOCK_N, BLOCK_K] weight tile is loaded as one byte per element, multiplied by its
block's scale in fp32 and rounded to bf16 (exactly the reference's dequantised weight), then fed to
the bf16 tensor cores with the bf16 activations (weight-only FP8: half the weight bytes of the bf16
experts, the same math as the dequantised model; the activations are not quantised here).

    first   a[p, :] = silu(g) * u, [g; u] = w1[e] @ x[tokens[p]]     gather fused, g and u rounded to bf16
    second  ys[p, :] = w2[e] @ a[p]

One program per (hit expert, column block), each expert's rows in BLOCK_M chunks (`tiled.TILES` for
the tile shapes, its last entry past 64 routes per expert). No host sync: capturable in a CUDA graph.
bf16 activations only; other dtypes, and bk not a multiple of 16, run the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.fp8 import reference
from forkpoint.kernels.fp8.reference import check_block_scales
from forkpoint.kernels.moe import grouped, tiled


@triton.jit
def _fp8_expert_gemm_kernel(src, w, w_s, rows_of, offs, active, num_active, out, K, N, stride_src, stride_we,
                            stride_wn, stride_se, stride_sn, stride_out, GROUP_N: tl.constexpr,
                            GROUP_K: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p, n] = act(sum_k src[row(p), k] * W[e, n, k]) for rows p of expert e = active[slot], with
    W = bf16(q * scale) dequantised tile by tile; row(p) = rows_of[p] when GATHER. SWIGLU: w holds 2N
    rows (gate n, up N + n) and out = silu(gate) * up (gate, up rounded to out's dtype first)."""
    slot = tl.program_id(0)
    if slot >= tl.load(num_active):
        return
    e = tl.load(active + slot)
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    end = tl.load(offs + e)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_e = w + e.to(tl.int64) * stride_we
    s_e = w_s + e.to(tl.int64) * stride_se
    w_gate = w_e + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_up = w_gate + N * stride_wn
    s_gate = s_e + (cols // GROUP_N).to(tl.int64) * stride_sn
    s_up = s_e + ((cols + N) // GROUP_N).to(tl.int64) * stride_sn
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        if GATHER:
            src_rows = tl.load(rows_of + rows, mask=row_ok, other=0)
        else:
            src_rows = rows
        a_ptr = src + src_rows[:, None].to(tl.int64) * stride_src + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks < K)[None, :]
            a = tl.load(a_ptr + k0, mask=row_ok[:, None] & k_ok, other=0.0)
            g = k0 // GROUP_K
            wg = tl.load(w_gate + k0, mask=col_ok[:, None] & k_ok, other=0.0).to(tl.float32)
            wg = (wg * tl.load(s_gate + g, mask=col_ok, other=0.0)[:, None]).to(a.dtype)
            acc = tl.dot(a, tl.trans(wg), acc)
            if SWIGLU:
                wu = tl.load(w_up + k0, mask=col_ok[:, None] & k_ok, other=0.0).to(tl.float32)
                wu = (wu * tl.load(s_up + g, mask=col_ok, other=0.0)[:, None]).to(a.dtype)
                acc_up = tl.dot(a, tl.trans(wu), acc_up)
        if SWIGLU:
            gate = acc.to(out.dtype.element_ty).to(tl.float32)
            acc = (gate * tl.sigmoid(gate)) * acc_up.to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + rows[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _expert_gemm(src, w, w_s, block, rows: tiled.ExpertRows, num_routes: int, config: tiled.TileConfig, *,
                 swiglu: bool, rows_of=None) -> torch.Tensor:
    """One expert GEMM over the sorted routes -> out [num_routes, N] in src.dtype (N = rows of w, halved
    for SwiGLU). src: [*, K] contiguous rows (x with `rows_of`, or [R, K] in route order); w: [E, rows, K]
    e4m3 contiguous; w_s: its block scales."""
    _, w_rows, k_dim = w.shape
    n_dim = w_rows // 2 if swiglu else w_rows
    out = torch.empty((num_routes, n_dim), dtype=src.dtype, device=src.device)
    if num_routes == 0:
        return out
    block_k = min(config.block_k, block[1])
    while block[1] % block_k:
        block_k //= 2
    grid = (rows.slots, triton.cdiv(n_dim, config.block_n))
    _fp8_expert_gemm_kernel[grid](
        src, w, w_s, src if rows_of is None else rows_of, rows.offs, rows.active, rows.num_active, out, k_dim, n_dim,
        src.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1), out.stride(0), GROUP_N=block[0],
        GROUP_K=block[1], GATHER=rows_of is not None, SWIGLU=swiglu, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, block, topk_weights, topk_ids, *, shared=None,
                  shared_gate=None, residual=None):
    """`reference.fused_moe_fp8` on CUDA (module docstring): x [T, Hd] bf16; gate_up [E, 2I, Hd] and down
    [E, Hd, I] e4m3 with their block scales; topk_* [T, k]. Returns [T, Hd] in x.dtype, the routed sum,
    sigmoid(shared_gate) * shared and residual added in one fp32 sum."""
    check_block_scales(gate_up, gate_up_scale, block)
    check_block_scales(down, down_scale, block)
    if x.dtype != torch.bfloat16 or block[1] % 16:
        return reference.fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, block, topk_weights, topk_ids,
                                       shared=shared, shared_gate=shared_gate, residual=residual)
    num_experts, _, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, gate_up.shape[1] // 2):
        raise ValueError(f"expected x [T, Hd], gate_up [E, 2I, Hd], down [E, Hd, I]; got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(f"topk_ids and topk_weights must both be [T, k] with T = {x.shape[0]}, "
                         f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.shape[0] == 0:
        return x.new_zeros(x.shape)
    if x.stride(-1) != 1:
        x = x.contiguous()
    routes = grouped._sorted_routes(topk_ids, num_experts)
    num_routes = routes.tokens.shape[0]
    covered = tiled.covers(num_routes, num_experts, tiled.TILES)
    tiles = tiled.tiles_for(num_routes, num_experts, tiled.TILES) if covered else tiled.TILES[-1]
    a = _expert_gemm(x, gate_up.contiguous(), gate_up_scale.contiguous(), block, routes.rows, num_routes,
                     tiles.first, swiglu=True, rows_of=routes.tokens)
    ys = _expert_gemm(a, down.contiguous(), down_scale.contiguous(), block, routes.rows, num_routes, tiles.second,
                      swiglu=False)
    extras = grouped._extras(x.shape[0], hidden, shared, shared_gate, residual)
    return grouped._combine(ys, routes.pos, topk_weights, *extras).to(x.dtype)
