"""Gated activations on CUDA, in Triton (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.activation.reference`, fp32 math and one rounding:

    silu_and_mul      one launch instead of four (two casts, silu and the product, then a cast back),
                      reading gate and up in place (row strides allowed, last dim contiguous); grid:
                      one program per (row, BLOCK columns), rows on grid axis 0 (up to 2^31 - 1)
    sigmoid_gate_mul  one launch instead of two (sigmoid, product) or five (with the casts); rows of
                      [..., D] read as [A, B] with two strides (the attention gate [T, HQ, Dh] is a
                      view with strides (width, 2 * Dh, 1)); tiles of BLOCK_R rows x BLOCK_D columns

Both write a new contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.activation.reference import check_same


@triton.jit
def _silu_and_mul_kernel(g, u, y, I, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    gv = tl.load(g + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    uv = tl.load(u + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * I + cols, ((gv * tl.sigmoid(gv)) * uv).to(y.dtype.element_ty), mask=m)


def _as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., I] -> [M, I] with a contiguous last dim (a view when the leading dims allow it)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, width)


def silu_and_mul(gate, up):
    """gate, up: [..., I], one shape and dtype, strided rows allowed. Returns silu(gate) * up in
    gate.dtype (fp32 math, one rounding), a new contiguous tensor."""
    check_same("gate", gate, "up", up)
    width = gate.shape[-1] if gate.dim() else 1
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return y
    g2, u2 = _as_rows(gate, width), _as_rows(up, width)
    block = min(1024, triton.next_power_of_2(width))
    grid = (g2.shape[0], triton.cdiv(width, block))
    _silu_and_mul_kernel[grid](g2, u2, y, width, g2.stride(0), u2.stride(0), BLOCK=block, num_warps=4)
    return y


@triton.jit(do_not_specialize=["n_rows", "B"])  # one compiled variant for every step size
def _sigmoid_gate_mul_kernel(x, g, y, n_rows, B, D, sxa, sxb, sga, sgb,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    i_a = (rows // B).to(tl.int64)
    i_b = (rows % B).to(tl.int64)
    xv = tl.load(x + (i_a * sxa + i_b * sxb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(g + (i_a * sga + i_b * sgb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = xv * tl.sigmoid(gv)
    tl.store(y + rows.to(tl.int64)[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def _as_ab_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """t [..., D] -> (t', stride_a, stride_b) with t' [A, B, D], last dim contiguous: row a * B + b
    starts at a * stride_a + b * stride_b. A view when the leading dims allow it, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    while t.dim() < 3:
        t = t.unsqueeze(0)
    if t.dim() > 3:
        t = t.flatten(0, -3)
    return t, t.stride(0), t.stride(1)


def sigmoid_gate_mul(x, gate):
    """x, gate: [..., D], one shape and dtype (strided rows read in place, e.g. the gate half of the
    interleaved q/gate projection as [T, HQ, Dh]). Returns x * sigmoid(gate) in x.dtype (fp32 math,
    one rounding), a new contiguous tensor of x's shape."""
    check_same("x", x, "gate", gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    width = x.shape[-1] if x.dim() else 1
    xr, sxa, sxb = _as_ab_rows(x)
    gr, sga, sgb = _as_ab_rows(gate)
    n_rows, b = x.numel() // width, xr.shape[1]
    block_d = min(1024, triton.next_power_of_2(width))
    block_r = max(1, 2048 // block_d)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(width, block_d))
    _sigmoid_gate_mul_kernel[grid](xr, gr, y, n_rows, b, width, sxa, sxb, sga, sgb, BLOCK_R=block_r,
                                   BLOCK_D=block_d, num_warps=4)
    return y
