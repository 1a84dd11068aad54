"""Paged causal attention on CUDA, in Triton (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.attention.reference`. This module imports Triton
at its top; the op's dispatch imports it only for CUDA tensors, so the CPU install never needs it.

`paged_attention` is one launch for a whole step: prefills, prefills that continue a cached prefix
(consumers pointing at a producer's blocks) and decodes mix freely. One program handles one
segment n, one kv head and a tile of query rows; a tile row is a (query position, q head of the
kv head's group) pair, so the GQA group shares every K/V load and a decode (one position) still
fills G rows of the matrix unit:

    row r of tile m  ->  query i = m * (BLOCK_M // G) + r // G,  q head = kv_head * G + r % G

Query i of segment n sits at position seq_lens[n] - q_len[n] + i and reads kv positions 0..itself
through block_tables[n] (position p lives in slot block_tables[n, p // block_size] * block_size
+ p % block_size). Online softmax in fp32 (exp2). The grid's first axis comes from the host's
largest q_len (`cu_seqlens_q_host`), everything else is read on the device: no host sync.
Not done here: split-KV (flash-decoding) for long decode contexts with few sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Cache writes are one index_copy_ per cache in the reference already: device-side, no host sync.
from forkpoint.kernels.attention.reference import copy_kv_slots, write_kv  # noqa: F401


@triton.jit
def _paged_attn_kernel(Q, Kc, Vc, O, block_tables, cu_q, seq_lens, qk_scale,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
                       block_size, Dh,
                       G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    i_m, i_n, i_hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # BLOCK_P = BLOCK_M // G query positions per tile
    q_start = tl.load(cu_q + i_n).to(tl.int64)
    q_len = tl.load(cu_q + i_n + 1).to(tl.int64) - q_start
    if i_m * BLOCK_P >= q_len:
        return
    kv_len = tl.load(seq_lens + i_n).to(tl.int64)
    ctx = kv_len - q_len                         # position of query 0

    rows = tl.arange(0, BLOCK_M)
    pos = i_m * BLOCK_P + rows // G
    head = i_hk * G + rows % G
    m_row = (pos < q_len) & (rows < BLOCK_P * G)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < Dh
    q = tl.load(Q + (q_start + pos)[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :],
                mask=m_row[:, None] & m_d[None, :], other=0.0)
    q_pos = ctx + pos
    last = tl.minimum((i_m + 1) * BLOCK_P, q_len) - 1
    hi = tl.minimum(kv_len, ctx + last + 1)      # kv positions [0, hi) are visible to this tile

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables + i_n.to(tl.int64) * stride_bt
    for start in range(0, hi, BLOCK_N):
        kv = start + tl.arange(0, BLOCK_N)
        m_kv = kv < hi
        blk = tl.load(bt_row + kv // block_size, mask=m_kv, other=0).to(tl.int64)
        off = kv % block_size
        k = tl.load(Kc + (blk * stride_kb + off * stride_ks + i_hk * stride_kh)[:, None] + o_d[None, :],
                    mask=m_kv[:, None] & m_d[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = (kv[None, :] <= q_pos[:, None]) & m_kv[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows past q_len can see nothing in a tile; keep their arithmetic finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vc + (blk * stride_vb + off * stride_vs + i_hk * stride_vh)[:, None] + o_d[None, :],
                    mask=m_kv[:, None] & m_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (q_start + pos)[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :],
             out.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_q_host,
                    seq_lens, seq_lens_host, *, scale):
    """Causal attention of packed query segments over a paged KV cache, one launch.

    q: [T, HQ, Dh] packed by segment (bf16/fp16; fp32 runs as tf32); k_cache, v_cache:
    [num_blocks, block_size, HKV, Dh] (HQ % HKV == 0); block_tables: [N, max_blocks] int32;
    cu_seqlens_q: [N+1] on the device (cu_seqlens_q_host the same on the host); seq_lens: [N] kv
    length of each segment after this step's tokens (seq_lens_host unused: kept for the contract).
    Returns o [T, HQ, Dh] in q.dtype, a new tensor; every row of it is written.
    """
    T, hq, dh = q.shape
    _, block_size, hkv, dh_k = k_cache.shape
    if hq % hkv != 0:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads: GQA needs HQ % HKV == 0")
    if dh_k != dh:
        raise ValueError(f"q head dim {dh} != kv cache head dim {dh_k}")
    n = len(cu_seqlens_q_host) - 1
    o = torch.empty_like(q)
    if T == 0 or n == 0:
        return o
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv caches need a contiguous head dim")
    g = hq // hkv
    max_q = max(int(b) - int(a) for a, b in zip(cu_seqlens_q_host[:-1], cu_seqlens_q_host[1:]))
    block_d = max(16, _next_pow2(dh))
    # decode-only steps: the smallest tile that still feeds tl.dot; prefill: 64 rows
    block_m = max(16, _next_pow2(g)) if max_q * g <= 16 else max(64, _next_pow2(g))
    block_n = 32 if block_d >= 256 else 64
    num_warps = 8 if block_m * block_d >= 64 * 256 else 4
    positions_per_tile = block_m // g
    grid = (-(-max_q // positions_per_tile), n, hkv)
    log2e = 1.4426950408889634
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, o, block_tables, cu_seqlens_q, seq_lens, float(scale) * log2e,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1), block_tables.stride(0),
        block_size, dh,
        G=g, BLOCK_M=block_m, BLOCK_P=positions_per_tile, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=2,
    )
    return o
