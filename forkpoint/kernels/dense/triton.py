"""Dense projection y = x @ weight^T (+ bias) on CUDA for decode-sized x (few rows), in Triton.

Same signature and semantics as `forkpoint.kernels.dense.reference.linear`. At decode sizes torch's
GEMMs (cuBLAS) are latency-bound: too few CTAs, or split-K plus a reduce kernel. Here one program
computes a BLOCK_N slab of output columns for a BLOCK_M chunk of rows and streams that slab of
weight rows once:

    grid      one axis, program p -> (row chunk p % cdiv(M, BLOCK_M), column block p // ...): the
              programs that share a weight slab are neighbours, so a slab is read from memory once
              and from L2 by the other row chunks
    dot       tl.dot tiles, x's rows padded to BLOCK_M >= 16 (masked loads, zero rows)
    broadcast (BLOCK_M <= 4) fp32 products summed along K, no tensor cores

Each output element is one fp32 accumulation over K in BLOCK_K steps, in order (no split-K, no
atomics), rounded once to x.dtype after the bias add: deterministic, and a row's result does not
depend on the other rows of x. `TABLE` is chosen so that within one (N, K) class every entry
gives the same bits per row, so row i of a step does not depend on M either, up to the class's
last ``max_m`` (tests/kernels/test_gpu_dense.py checks both). Past it, or for other dtypes and
layouts, torch's F.linear runs. No host sync and no allocation but the output: capturable in a
CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from forkpoint.kernels.dense import reference
from forkpoint.kernels.dense.reference import check_linear

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M", "N"])  # one compiled variant for every step size and width
def _linear_kernel(x, w, b, y, M, N, K, stride_xm, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for this program's rows and columns; fp32
    accumulation over K in BLOCK_K steps, one rounding at the store."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    rows = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptr = x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptr = w + cols[:, None].to(tl.int64) * K + ks[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x_mask = row_ok[:, None]
            w_mask = col_ok[:, None]
        else:
            k_ok = (k0 + ks < K)[None, :]
            x_mask = row_ok[:, None] & k_ok
            w_mask = col_ok[:, None] & k_ok
        a = tl.load(x_ptr + k0, mask=x_mask, other=0.0)
        wt = tl.load(w_ptr + k0, mask=w_mask, other=0.0)
        if DOT:
            acc = tl.dot(a, tl.trans(wt), acc, input_precision="ieee")  # ieee: fp32 stays fp32 (no tf32)
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Tile:
    """One launch configuration, serving steps of at most ``max_m`` rows."""

    max_m: int
    block_m: int  # rows per program: >= 16 with dot, 1 / 2 / 4 without
    block_n: int  # output columns (weight rows) per program
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool = True  # tl.dot tiles, or the broadcast-multiply-sum path


@dataclass(frozen=True)
class ShapeClass:
    """Tiles for weights [N, K] with N <= max_n and K <= max_k (the first class that fits serves)."""

    max_n: float
    max_k: float
    tiles: tuple[Tile, ...]  # ascending max_m; past the last one F.linear runs


# From the sweep of bench/dense_kernel.py on an H200 (bf16, weights read from HBM, CUDA-graph
# replays; times for M = 1 / 16, cuBLAS in brackets):
#   narrow: out_proj 2048 x 4096 8.8 / 8.9 us (8.8 / 9.6), router+ 1288 x 2048 5.7 / 5.7 (6.7 / 5.9),
#           shared_down 2048 x 512 3.4 / 3.5 (3.7 / 3.8): BLOCK_N = 16, deep pipeline (5 x 512 of K)
#   wide:   gdn_in 12352 x 2048 14.3 / 14.7 (15.7 / 15.9), lm_head 248320 x 2048 227 / 239 (237 / 245);
#           attn_qkv 9216 x 2048 is 4% slower than cuBLAS (12.3 vs 11.9)
# Past M = 16 (BLOCK_M 32 and 64) cuBLAS is as fast or faster on most of these shapes. Every tl.dot
# configuration measured gives the same bits per row (and, for K <= 2048, cuBLAS's bits); the
# broadcast path is faster at M <= 2 on the narrow shapes (out_proj 7.2 us, router+ 4.1, shared_down
# 3.0) but rounds differently, so mixing it with tl.dot tiles in one class would break row
# invariance: it is not in the table.
TABLE = (
    ShapeClass(4096, math.inf, (Tile(16, 16, 16, 512, 4, 5),)),
    ShapeClass(math.inf, math.inf, (Tile(16, 16, 32, 128, 4, 4),)),
)


def tile_for(m: int, n: int, k: int, table: tuple[ShapeClass, ...] = TABLE) -> Tile | None:
    """The tile of `table` for x [m, K=k] and weight [n, k]; None past the table (F.linear runs)."""
    for shape in table:
        if n <= shape.max_n and k <= shape.max_k:
            return next((t for t in shape.tiles if m <= t.max_m), None)
    return None


def linear_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                tile: Tile) -> torch.Tensor:
    """Run the kernel with `tile` for any M >= 1 (the benchmark's entry): x [M, K] (last dim
    contiguous), weight [N, K] contiguous, bias [N] or None, out [M, N] contiguous, one dtype."""
    m, k = x.shape
    n = weight.shape[0]
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    # the table's stages are sized for 2-byte operands; fp32 tiles take twice the shared memory per
    # stage (fewer stages change the speed, not the result)
    stages = tile.num_stages if x.element_size() <= 2 else max(1, tile.num_stages // 2)
    _linear_kernel[grid](x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0),
                         HAS_BIAS=bias is not None, DOT=tile.dot, EVEN_K=k % tile.block_k == 0,
                         BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                         num_warps=tile.num_warps, num_stages=stages)
    return out


def _kernel_layout(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel reads these inputs in place: a supported dtype, x's rows contiguous,
    weight row-major contiguous, bias contiguous, no empty dimension."""
    return (x.dtype in DTYPES and x.stride(1) == 1 and weight.is_contiguous() and min(x.shape[0], *weight.shape) > 0
            and (bias is None or bias.stride(0) == 1))


def linear(x, weight, bias=None, out=None):
    """x [M, K], weight [N, K], bias [N] or None -> x @ weight^T + bias, [M, N] in x.dtype (into
    ``out`` when given: [M, N] contiguous). The Triton kernel for M within `TABLE`, else F.linear."""
    check_linear(x, weight, bias, out)
    tile = tile_for(x.shape[0], *weight.shape) if _kernel_layout(x, weight, bias) else None
    if tile is None:
        return reference.linear(x, weight, bias, out)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return linear_tile(x, weight, bias, out, tile)
