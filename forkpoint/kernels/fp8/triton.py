"""Block-scaled FP8 projections on Hopper tensor cores, in Triton (GPU variant of `reference.py`).

`fp8_linear` runs two launches, as the FP8 releases' `activation_scheme: "dynamic"` asks:

    quantise   xq [M, K] e4m3, s [M, ceil(K / bk)] fp32     one program per (row, group of bk channels):
                                                            s = max(amax, 1e-10) / 448, xq = x / s
    GEMM       y [M, N] = sum_g (xq_g @ q_g^T) * s_g * scale_inv_g     fp8 x fp8 -> fp32 `tl.dot` per
                                                            BLOCK_K = bk step (one scale group), scaled
                                                            and accumulated in fp32; bias added, one
                                                            rounding at the store

so its result is `reference.w8a8_block_linear` up to the order of the fp32 sums (and the FP8 tensor
cores' narrower sum inside each 128-wide block: 1.3e-4 relative RMS in fp32 on an H200). Output rows
may be strided (a column range of a wider buffer: the stacked projections write theirs in place). No
host sync, no allocation but the two outputs: capturable in a CUDA graph. Blocks the kernel does not
take (bk not a multiple of 32, or above 128 and not a multiple of 128) and dtypes other than bf16 /
fp16 / fp32 run the reference.

Steps of at least SCALED_MM_MIN_ROWS rows with Qwen's 128 x 128 blocks (bf16, N and K multiples of 128,
on Hopper with torch >= 2.9) run the GEMM as torch's block-scaled `torch._scaled_mm` (cuBLAS) on the
same quantised activations instead: measured on an H200 in CUDA graphs (bench/fp8_kernel.py,
bench/results/fp8_kernel_h200.json) it is 1.3-1.8x faster there (8,192 rows of the GDN input
projection: 0.45 ms against the Triton GEMM's 0.81 ms and bf16's 0.59 ms), while below 256 rows the
Triton GEMM is as fast or faster (1 row of the GDN input projection: 10.4 us; bf16 13.3 us).

`fused_moe_fp8` (the routed experts) is `moe_fp8.py`'s.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from forkpoint.kernels.fp8 import reference
from forkpoint.kernels.fp8.moe_fp8 import fused_moe_fp8
from forkpoint.kernels.fp8.reference import ACTIVATION_EPS, FP8_MAX, check_block_scales

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALED_MM_MIN_ROWS = 256


@triton.jit
def _quantize_kernel(x, xq, s, K, stride_xm, groups, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                     EPS: tl.constexpr, QMAX: tl.constexpr):
    """xq[m, g*GROUP + i] = x / s[m, g] in e4m3 with s[m, g] = max(amax, EPS) / QMAX, for this program's
    row m and group g (fp32 math, IEEE division)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    cols = g * GROUP + lanes
    ok = (lanes < GROUP) & (cols < K)
    v = tl.load(x + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), 0), EPS), QMAX)
    q = tl.clamp(tl.math.div_rn(v, scale), -QMAX, QMAX)
    tl.store(xq + row * K + cols, q.to(xq.dtype.element_ty), mask=ok)
    tl.store(s + row * groups + g, scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_activations` in one launch: x [M, K] (last dim contiguous) -> (xq e4m3 [M, K],
    s [M, ceil(K / group)] fp32)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    xq = torch.empty((m, k), dtype=reference.FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, groups)](x, xq, s, k, x.stride(0), groups, GROUP=group,
                                      BLOCK=triton.next_power_of_2(group), EPS=ACTIVATION_EPS, QMAX=FP8_MAX,
                                      num_warps=1 if group <= 128 else 4)
    return xq, s


@triton.jit(do_not_specialize=["M"])  # one compiled variant for every step size
def _gemm_kernel(a, a_s, b, b_s, bias, c, M, N, K, a_groups, b_groups, stride_cm, GROUP_N: tl.constexpr,
                 GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr):
    """c[m, n] = sum_k (a[m, k] * a_s[m, k // GROUP_K]) * (b[n, k] * b_s[n // GROUP_N, k // GROUP_K])
    (+ bias[n]) for this program's tile: a [M, K] e4m3 with a_s [M, a_groups]; b [N, K] e4m3 with b_s
    [ceil(N / GROUP_N), b_groups]. BLOCK_K divides GROUP_K, so each step has one scale per row."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = SWIZZLE * num_n  # programs that share SWIZZLE row blocks of a: b tiles reused from L2
    first_m = (pid // per_group) * SWIZZLE
    size_m = tl.minimum(num_m - first_m, SWIZZLE)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptr = a + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_ptr = b + cols[None, :].to(tl.int64) * K + ks[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptr = a_s + rows.to(tl.int64) * a_groups
    bs_ptr = b_s + (cols // GROUP_N).to(tl.int64) * b_groups
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        av = tl.load(a_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bv = tl.load(b_ptr + k0, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        g = k0 // GROUP_K
        sa = tl.load(as_ptr + g, mask=row_ok, other=0.0)
        sb = tl.load(bs_ptr + g, mask=col_ok, other=0.0)
        acc += tl.dot(av, bv) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def kernel_takes(block: tuple[int, int]) -> bool:
    """Whether the Triton GEMM takes weight blocks `block` (bn, bk): any bn; bk a multiple of 32 (the
    FP8 tensor cores' K step), and of 128 when above 128 (then run as 128-wide steps)."""
    bk = block[1]
    return bk % 32 == 0 and (bk <= 128 or bk % 128 == 0)


def _tile(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by step rows: decode-sized steps stream the weight
    with narrow column blocks (more programs), prefill steps take 128 x 128 tiles."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 128:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


@functools.cache
def _blockwise_scaled_mm(device_index: int) -> bool:
    """Whether torch's `_scaled_mm` takes 1 x 128 / 128 x 128 block scales on this device: Hopper (sm90)
    and torch >= 2.9 (measured with torch 2.11 on an H200)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return torch.cuda.get_device_capability(device_index) == (9, 0) and (major, minor) >= (2, 9)


def _use_scaled_mm(x: torch.Tensor, n: int, block: tuple[int, int]) -> bool:
    m, k = x.shape
    return (m >= SCALED_MM_MIN_ROWS and block == (128, 128) and x.dtype == torch.bfloat16 and n % 128 == 0
            and k % 128 == 0 and _blockwise_scaled_mm(x.device.index or 0))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 with its block scales)^T (+ bias [N]) -> [M, N] in x.dtype, x
    quantised per token and bk-group on the way (module docstring). `out`: [M, N] with unit column
    stride (rows may be strided), written and returned when given."""
    check_block_scales(weight, scale_inv, block)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x [M, K] = {tuple(x.shape)} does not fit weight [N, K] = {tuple(weight.shape)}")
    if out is not None and (tuple(out.shape) != (m, n) or out.stride(-1) != 1):
        raise ValueError(f"out must be [M, N] = {[m, n]} with unit column stride, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if x.dtype not in DTYPES or not kernel_takes(block):
        return reference.fp8_linear(x, weight, scale_inv, block, bias, out)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq, xs = quantize_activations(x, block[1])
    if _use_scaled_mm(x, n, block):
        # cuBLAS wants the activation scales column-major and the weight as a column-major [K, N]
        y = torch._scaled_mm(xq, weight.T, scale_a=xs.T.contiguous().T, scale_b=scale_inv.T, out_dtype=x.dtype)
        if bias is not None:
            y += bias
        return y if out is None else out.copy_(y)
    return block_fp8_gemm(xq, xs, weight, scale_inv, block, bias, out, x.dtype)


def block_fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None, out: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The Triton GEMM alone: xq [M, K] e4m3 with its per-token-group scales xs [M, ceil(K / bk)] (as
    `quantize_activations` returns them) against weight [N, K] e4m3 with scale_inv; + bias; -> [M, N] in
    `dtype`, into `out` when given (unit column stride). M, N >= 1; `kernel_takes(block)`."""
    m, k = xq.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=xq.device)
    weight = weight if weight.is_contiguous() else weight.contiguous()
    scale_inv = scale_inv if scale_inv.is_contiguous() else scale_inv.contiguous()
    block_m, block_n, warps, stages = _tile(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](xq, xs, weight, scale_inv, xs if bias is None else bias, out, m, n, k, xs.shape[1],
                       scale_inv.shape[1], out.stride(0), GROUP_N=block[0], GROUP_K=block[1],
                       HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block[1], 128),
                       SWIZZLE=8, num_warps=warps, num_stages=stages)
    return out


__all__ = ["block_fp8_gemm", "fp8_linear", "fused_moe_fp8", "kernel_takes", "quantize_activations"]
