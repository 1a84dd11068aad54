"""Routed-expert GEMMs as Triton tiles, one program per (expert that was hit, column block).

The GPU path of `grouped.fused_moe` / `fused_moe_relu2` for steps with few routes per expert
(decode steps and small prefills: on an H200 torch's grouped GEMM reads the hit experts' weights
at 1.1-2.9 TB/s there, these tiles at 3.1-4.3 TB/s; bench/moe_kernel.py). Two launches replace the
gather, two grouped GEMMs (each with its CUTLASS set-up kernel) and the activation:

    first   a[p, :] = act(w1[e] @ x[tokens[p]])     [R, I]   gather fused; h = w1[e] @ x rounded to
                                                             x's dtype (as the grouped GEMM rounds
                                                             it), act in fp32 (SwiGLU: silu(gate) *
                                                             up, w1 = [gate; up]; or relu(h)^2),
                                                             rounded once more
    second  ys[p, :] = w2[e] @ a[p]                 [R, Hd]

for every row p of expert e's group (rows offs[e-1] .. offs[e] of the routes sorted by expert).
Grid: (slots, column blocks); slot s < num_active runs expert active[s] over all its rows in
BLOCK_M chunks, so each weight tile is read from memory once per step (again from L2 per further
chunk); slots at or past num_active return at once. Each output element is one fp32 dot over the
whole K in BLOCK_K steps, in order (no split-K, no atomics): a row's result does not depend on the
other rows of the step (measured bit for bit across the table's configurations on an H200:
bench/moe_kernel.py `rows_invariant`).

`TILES` picks the configuration from the step's routes per expert (constexprs, so a handful of
compiled variants, all reached by the start-up warm-up's decode captures and prefill steps).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SWIGLU, RELU2, NONE = 0, 1, 2  # the first GEMM's activation (constexpr ACT), NONE for the second


@triton.jit
def _expert_gemm_kernel(src, w, rows_of, offs, active, num_active, out, K, N, stride_src, stride_we, stride_wn,
                        stride_out, GATHER: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p, n] = act(sum_k src[row(p), k] * w[e, n, k]) for rows p of expert e = active[slot] and
    columns n of this program's block; row(p) = rows_of[p] when GATHER, else p. With ACT == SWIGLU,
    w holds 2N rows (gate rows n, up rows N + n) and out[p, n] = silu(gate) * up."""
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
    w_gate = w_e + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_up = w_gate + N * stride_wn
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
            if EVEN_K:
                a_mask = row_ok[:, None]
                w_mask = col_ok[:, None]
            else:
                a_mask = row_ok[:, None] & (k0 + ks < K)[None, :]
                w_mask = col_ok[:, None] & (k0 + ks < K)[None, :]
            a = tl.load(a_ptr + k0, mask=a_mask, other=0.0)
            acc = tl.dot(a, tl.trans(tl.load(w_gate + k0, mask=w_mask, other=0.0)), acc)
            if ACT == 0:
                acc_up = tl.dot(a, tl.trans(tl.load(w_up + k0, mask=w_mask, other=0.0)), acc_up)
        # the first GEMM's output is rounded to out's dtype before the activation, as torch's
        # grouped GEMM rounds it on the other path: both paths round at the same points
        if ACT == 0:
            gate = acc.to(out.dtype.element_ty).to(tl.float32)
            acc = (gate * tl.sigmoid(gate)) * acc_up.to(out.dtype.element_ty).to(tl.float32)
        elif ACT == 1:
            acc = tl.maximum(acc.to(out.dtype.element_ty).to(tl.float32), 0.0)
            acc = acc * acc
        tl.store(out + rows[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class Tiles(NamedTuple):
    """Tile configurations of the two GEMMs for one range of routes per expert."""

    max_routes_per_expert: float  # serves steps of at most this many routes per expert (R <= this * E)
    first: TileConfig
    second: TileConfig


# From the sweep of bench/moe_kernel.py on an H200 (bench/results/moe_kernel_h200.json) at
# Qwen3.5-35B-A3B (E = 256, Hd = 2048, I = 512, top-8) and Nemotron-3-Nano (E = 128, Hd = 2688,
# I = 1856, top-6) expert shapes: per range, the configuration whose worst time over the measured
# steps of both shapes is the lowest, within 1.06x of each step's fastest except 1.09x (Nemotron's
# 1,024-token step, second entry from the end). Past the last entry (more than 64 routes per
# expert) the grouped GEMM is faster (1.1x-2x at 96-192 routes per expert).
TILES = (
    Tiles(0.125, TileConfig(16, 32, 256, 4, 3), TileConfig(16, 128, 128, 4, 3)),
    Tiles(8, TileConfig(16, 64, 128, 4, 4), TileConfig(16, 64, 128, 4, 4)),
    Tiles(24, TileConfig(32, 64, 128, 4, 4), TileConfig(64, 128, 64, 4, 3)),
    Tiles(48, TileConfig(64, 64, 64, 4, 4), TileConfig(64, 128, 64, 8, 3)),
    Tiles(64, TileConfig(128, 128, 64, 8, 3), TileConfig(64, 256, 64, 8, 3)),
)


def covers(num_routes: int, num_experts: int, table: tuple[Tiles, ...]) -> bool:
    """Whether `table` (ascending max_routes_per_expert) has an entry for R routes over E experts."""
    return bool(table) and num_routes <= table[-1].max_routes_per_expert * num_experts


def tiles_for(num_routes: int, num_experts: int, table: tuple[Tiles, ...]) -> Tiles:
    """The first entry of `table` that serves R routes over E experts; ValueError when none does."""
    for tiles in table:
        if num_routes <= tiles.max_routes_per_expert * num_experts:
            return tiles
    raise ValueError(f"no tile configuration for {num_routes} routes over {num_experts} experts "
                     f"(the table ends at {table[-1].max_routes_per_expert if table else 0} per expert)")


class ExpertRows(NamedTuple):
    """Where each expert's rows are in the routes sorted by expert (device tensors, no host sync)."""

    offs: torch.Tensor  # [E] int32: end row of expert e's group (its rows: offs[e-1] .. offs[e])
    active: torch.Tensor  # [E] int32: the experts to run, active[s] for s < num_active (every hit one)
    num_active: torch.Tensor  # [1] int32
    slots: int  # programs along the grid's first axis: >= num_active (min(E, R) when only hit experts are listed)


def expert_gemm(src: torch.Tensor, w: torch.Tensor, rows: ExpertRows, num_routes: int, config: TileConfig, *,
                act: int, rows_of: torch.Tensor | None = None) -> torch.Tensor:
    """One expert GEMM over the sorted routes: returns out [num_routes, N] in src.dtype.

    src: [*, K] with contiguous rows (x [T, Hd] with `rows_of` [R] long giving route row p's token,
    or a [R, K] tensor already in route order); w: [E, N, K] (act NONE / RELU2) or [E, 2N, K]
    (SWIGLU: gate rows, then up rows), any strides but the last (copied unless it is 1)."""
    _, w_rows, k_dim = w.shape
    n_dim = w_rows // 2 if act == SWIGLU else w_rows
    if src.stride(-1) != 1:
        src = src.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty((num_routes, n_dim), dtype=src.dtype, device=src.device)
    if num_routes == 0:
        return out
    grid = (rows.slots, triton.cdiv(n_dim, config.block_n))
    _expert_gemm_kernel[grid](
        src, w, src if rows_of is None else rows_of, rows.offs, rows.active, rows.num_active, out, k_dim, n_dim,
        src.stride(0), w.stride(0), w.stride(1), out.stride(0), GATHER=rows_of is not None, ACT=act,
        EVEN_K=k_dim % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tokens: torch.Tensor, rows: ExpertRows, *,
               gated: bool, table: tuple[Tiles, ...]) -> torch.Tensor:
    """The routed experts' outputs in sorted-route order: ys [R, Hd] in x.dtype, ys[p] =
    w2[e] @ act(w1[e] @ x[tokens[p]]) for route row p of expert e (SwiGLU when `gated`, w1 =
    [E, 2I, Hd]; else relu^2, w1 = [E, I, Hd]); w2: [E, Hd, I]; tokens: [R] long; the tiles of
    `table`'s entry for R routes over E experts (`tiles_for`)."""
    num_routes = tokens.shape[0]
    tiles = tiles_for(num_routes, w1.shape[0], table)
    a = expert_gemm(x, w1, rows, num_routes, tiles.first, act=SWIGLU if gated else RELU2, rows_of=tokens)
    return expert_gemm(a, w2, rows, num_routes, tiles.second, act=NONE)
