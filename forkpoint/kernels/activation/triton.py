"""SwiGLU activation on CUDA, in Triton (GPU variant of `reference.py`).

Same signature and semantics as `forkpoint.kernels.activation.reference.silu_and_mul`: one launch
instead of four (two casts, silu and the product, then a cast back), reading gate and up in place
(row strides allowed, last dim contiguous) and writing a contiguous [..., I] tensor. Grid: one
program per (row, BLOCK columns); rows on grid axis 0, which takes up to 2^31 - 1 of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must share shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    width = gate.shape[-1] if gate.dim() else 1
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return y
    g2, u2 = _as_rows(gate, width), _as_rows(up, width)
    block = min(1024, triton.next_power_of_2(width))
    grid = (g2.shape[0], triton.cdiv(width, block))
    _silu_and_mul_kernel[grid](g2, u2, y, width, g2.stride(0), u2.stride(0), BLOCK=block, num_warps=4)
    return y
