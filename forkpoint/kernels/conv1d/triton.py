"""Causal depthwise conv1d on CUDA, in Triton (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.conv1d.reference`. This module imports Triton at
its top; the dispatch in `forkpoint.kernels.conv1d` imports it only for CUDA tensors (and falls back
to the reference when Triton is missing), so the CPU install never needs Triton.

Layouts (D channels, W taps, N segments packed along T):

    x        [T, D]        token t of segment n is row cu_seqlens[n] + t
    weight   [D, W]        tap W-1 multiplies the current token, tap 0 the oldest
    state    [N, D, W-1]   the W-1 inputs before a segment, oldest first

    y[t] = act(bias + sum_j weight[:, j] * x[t - (W-1) + j]), reading x[t'] for t' < 0 from state.

`causal_conv1d_varlen` is one launch: grid axis 0 has one program per chunk (VARLEN_TILE.tokens) of every
segment (the chunk list is built on the host from `cu_seqlens_host`, shared with the gated delta
rule: `chunk_indices` below), followed by one program per segment that writes its
final state, so segments of any length (zero too) get a final state and nothing syncs the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from forkpoint.kernels.conv1d import reference

_BD = 128   # channels per program of the decode kernels


class VarlenTile(NamedTuple):
    """The varlen kernel's program tile: `tokens` x `channels`, with `num_warps`."""

    tokens: int
    channels: int
    num_warps: int


# The fastest of bench/conv_kernel.py's sweep on an H200 in all three of its cases (35B GDN steps
# of 2 x 4,096 and 32 x 256 tokens, Nemotron's Mamba2 conv): 167 / 185 / 128 us against 181 / 264 /
# 141 us for the 64 x 128 tile before (bench/results/conv_kernel_h200.json); every tile gives the same bits.
VARLEN_TILE = VarlenTile(16, 256, 4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=64)
def _chunk_indices_cached(offsets: tuple[int, ...], chunk_size: int, device: torch.device) -> torch.Tensor:
    cu = np.asarray(offsets, dtype=np.int64)
    counts = (np.diff(cu) + chunk_size - 1) // chunk_size
    seg = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    intra = np.arange(int(counts.sum()), dtype=np.int64) - starts
    host = torch.from_numpy(np.stack([seg, intra], axis=1))
    if device.type != "cuda":
        return host.to(device)
    # pinned + non_blocking: the copy is queued on the current stream, the host does not wait
    return host.pin_memory().to(device, non_blocking=True)


def chunk_indices(cu_seqlens_host: Sequence[int], chunk_size: int, device) -> torch.Tensor:
    """fla-style chunk list: LongTensor [NT, 2] on `device`, row c = (segment n, chunk i of n), for
    NT = sum_n ceil(len_n / chunk_size) chunks. Built on the host from `cu_seqlens_host` and uploaded
    without a host sync; cached per (offsets, chunk_size, device) so the layers of one step share one
    upload (the cache holds at most 64 small tensors). Shared with `gated_delta.fla`."""
    return _chunk_indices_cached(tuple(int(v) for v in cu_seqlens_host), int(chunk_size), torch.device(device))


@triton.jit(do_not_specialize=["NT"])  # the step's chunk count: one variant for any count
def _varlen_kernel(x, w, b, s0, y, sT, cu_seqlens, chunk_idx, NT, D, stride_xt, TT, S1, S2,
                   W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """y holds up to three channel groups [0, S1), [S1, S2), [S2, D), each a contiguous [TT, width]
    block after the one before (S1 = S2 = D: one group, the plain [TT, D] layout)."""
    i_c, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if i_c < NT:
        i_n = tl.load(chunk_idx + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_idx + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        o_t = i_t * BT + tl.arange(0, BT)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        if i_t == 0:  # a segment's first chunk: its first W-1 rows read inputs before it, from the state
            for j in tl.static_range(W):
                o_x = o_t - (W - 1) + j
                w_j = tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
                m_x = ((o_x >= 0) & (o_x < T))[:, None] & m_d[None, :]
                x_j = tl.load(x + (bos + o_x)[:, None] * stride_xt + o_d[None, :], mask=m_x, other=0.0)
                m_s = (o_x < 0)[:, None] & m_d[None, :]
                s_j = tl.load(s0 + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + (W - 1 + o_x)[:, None],
                              mask=m_s, other=0.0)
                acc += (x_j.to(tl.float32) + s_j.to(tl.float32)) * w_j[None, :]
        else:  # the same sum, tap by tap, with no state (so a token's result is the same bits either way)
            for j in tl.static_range(W):
                o_x = o_t - (W - 1) + j
                w_j = tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
                x_j = tl.load(x + (bos + o_x)[:, None] * stride_xt + o_d[None, :],
                              mask=(o_x < T)[:, None] & m_d[None, :], other=0.0)
                acc += x_j.to(tl.float32) * w_j[None, :]
        if HAS_BIAS:
            acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        m_y = (o_t < T)[:, None] & m_d[None, :]
        start = tl.where(o_d < S1, 0, tl.where(o_d < S2, S1, S2)).to(tl.int64)
        width = tl.where(o_d < S1, S1, tl.where(o_d < S2, S2 - S1, D - S2)).to(tl.int64)
        o_y = start[None, :] * TT + (bos + o_t)[:, None] * width[None, :] + (o_d.to(tl.int64) - start)[None, :]
        tl.store(y + o_y, acc.to(y.dtype.element_ty), mask=m_y)
    else:
        # final state of segment i_n: the last W-1 inputs, from the state when it is shorter
        i_n = (i_c - NT).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        # names differ from the other branch: Triton wants one type per name across branches
        for jf in tl.static_range(W - 1):
            pf = T - (W - 1) + jf
            xf = tl.load(x + (bos + pf) * stride_xt + o_d, mask=m_d & (pf >= 0), other=0.0)
            sf = tl.load(s0 + i_n * D * (W - 1) + o_d * (W - 1) + (W - 1 + pf), mask=m_d & (pf < 0), other=0.0)
            tl.store(sT + i_n * D * (W - 1) + o_d * (W - 1) + jf,
                     (xf.to(tl.float32) + sf.to(tl.float32)).to(sT.dtype.element_ty), mask=m_d)


@triton.jit
def _step_kernel(x, w, b, s0, y, sT, D, W: tl.constexpr, BD: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_n, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x_n = tl.load(x + i_n * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    acc = x_n * tl.load(w + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s_j = tl.load(s0 + i_n * D * (W - 1) + o_d * (W - 1) + j, mask=m_d, other=0.0)
        acc += s_j.to(tl.float32) * tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(sT + i_n * D * (W - 1) + o_d * (W - 1) + (j - 1), s_j, mask=m_d)
    tl.store(sT + i_n * D * (W - 1) + o_d * (W - 1) + (W - 2), x_n.to(sT.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)


@triton.jit
def _step_inplace_kernel(x, w, b, pool, slots, y, D, stride_x, W: tl.constexpr, BD: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """`_step_kernel` on pool row slots[i_n], shifted in place: s_j is read before s_{j-1}'s
    position is overwritten with it, and only this program touches these elements."""
    i_n, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    row = pool + tl.load(slots + i_n).to(tl.int64) * D * (W - 1) + o_d * (W - 1)
    x_n = tl.load(x + i_n * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    acc = x_n * tl.load(w + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s_j = tl.load(row + j, mask=m_d, other=0.0)
        acc += s_j.to(tl.float32) * tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(row + (j - 1), s_j, mask=m_d)
    tl.store(row + (W - 2), x_n.to(pool.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r} is not supported: use 'silu' or None")
    return activation is not None


def causal_conv1d_varlen(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_host, *, activation="silu",
                         split=None):
    """Packed varlen causal depthwise conv1d, one launch (tile VARLEN_TILE).

    x: [T, D] (bf16/fp16/fp32, last dim contiguous); weight: [D, W]; bias: [D] or None;
    initial_state: [N, D, W-1] (the W-1 inputs before each segment, oldest first; read only);
    cu_seqlens: LongTensor [N+1] on the device; cu_seqlens_host: the same offsets on the host.
    Returns (y [T, D] in x.dtype, final_state [N, D, W-1] in initial_state.dtype, new tensors);
    with `split` (reference.causal_conv1d_varlen) y is the tuple of its contiguous channel groups,
    written so by the kernel (views of one buffer, no copy).
    """
    return _varlen(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_host, activation, split, VARLEN_TILE)


def _varlen(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_host, activation, split, tile: VarlenTile):
    """`causal_conv1d_varlen` with the tile given (bench/conv_kernel.py sweeps it)."""
    silu = _check_activation(activation)
    D, W = weight.shape
    reference.check_split(split, D)
    n = len(cu_seqlens_host) - 1
    if W < 2:
        raise ValueError(f"conv width W={W}: the state path needs W >= 2")
    if tile.tokens < W - 1:
        raise ValueError(f"tile of {tile.tokens} tokens: only a segment's first chunk reads the state, so a chunk "
                         f"must hold the W-1 = {W - 1} tokens that do")
    if initial_state.shape != (n, D, W - 1):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(n, D, W - 1)} "
                         "(one [D, W-1] row per segment)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight, s0 = weight.contiguous(), initial_state.contiguous()
    idx = chunk_indices(cu_seqlens_host, tile.tokens, x.device)
    nt = idx.shape[0]
    num_tokens = x.shape[0]
    y = torch.empty((num_tokens, D), dtype=x.dtype, device=x.device)
    final_state = torch.empty_like(s0)
    bounds = np.cumsum(list(split or (D,)))  # group ends: S1 and S2 (D when absent)
    s1, s2 = int(bounds[0]), int(bounds[1]) if len(bounds) > 1 else D
    grid = (nt + n, _cdiv(D, tile.channels))  # axis 0 may exceed 65535
    _varlen_kernel[grid](x, weight, bias if bias is not None else weight, s0, y, final_state, cu_seqlens, idx,
                         nt, D, x.stride(0), num_tokens, s1, s2, W=W, BT=tile.tokens, BD=tile.channels,
                         HAS_BIAS=bias is not None, SILU=silu, num_warps=tile.num_warps)
    if split is None:
        return y, final_state
    flat = y.view(-1)
    parts, offset = [], 0
    for width in split:
        parts.append(flat[offset: offset + num_tokens * width].view(num_tokens, width))
        offset += num_tokens * width
    return tuple(parts), final_state


def causal_conv1d_step(x, weight, bias, state, *, activation="silu"):
    """One token per sequence (decode). x: [N, D]; weight: [D, W]; bias: [D] or None;
    state: [N, D, W-1] (read only). Returns (y [N, D] in x.dtype, new_state [N, D, W-1], new tensors)."""
    silu = _check_activation(activation)
    D, W = weight.shape
    if W < 2:
        raise ValueError(f"conv width W={W}: the state path needs W >= 2")
    x, weight, s0 = x.contiguous(), weight.contiguous(), state.contiguous()
    y = torch.empty_like(x)
    new_state = torch.empty_like(s0)
    grid = (x.shape[0], _cdiv(D, _BD))
    _step_kernel[grid](x, weight, bias if bias is not None else weight, s0, y, new_state,
                       D, W=W, BD=_BD, HAS_BIAS=bias is not None, SILU=silu, num_warps=4)
    return y, new_state


def causal_conv1d_step_inplace(x, weight, bias, state_pool, slots, *, activation="silu"):
    """One decode token per sequence, its conv state updated in place in the pool; one launch, no
    host sync (capturable). x: [N, D] (row-strided allowed, last dim contiguous); weight: [D, W];
    bias: [D] or None; state_pool: [S, D, W-1], contiguous, rows ``slots`` ([N] long, distinct:
    not checked) read and overwritten. Returns y [N, D] in x.dtype, a new tensor."""
    silu = _check_activation(activation)
    D, W = weight.shape
    if W < 2:
        raise ValueError(f"conv width W={W}: the state path needs W >= 2")
    if state_pool.dim() != 3 or state_pool.shape[1:] != (D, W - 1) or slots.shape != x.shape[:1]:
        raise ValueError(f"state_pool must be [S, {D}, {W - 1}] and slots [N] for x [N, {D}]; got "
                         f"{tuple(state_pool.shape)}, {tuple(slots.shape)}, {tuple(x.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel writes its rows in place")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty((x.shape[0], D), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    grid = (x.shape[0], _cdiv(D, _BD))
    _step_inplace_kernel[grid](x, weight, bias if bias is not None else weight, state_pool, slots, y, D, x.stride(0),
                               W=W, BD=_BD, HAS_BIAS=bias is not None, SILU=silu, num_warps=4)
    return y
