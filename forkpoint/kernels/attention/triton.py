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
Prefill tiles (BLOCK_M rows, BLOCK_N keys per step, warps, pipeline stages) are autotuned once per
(G, head dim, short/long step) and cached; decode steps use one fixed small tile (see below).

Decode steps split each segment's keys (flash-decoding): a batch-1 decode has only HKV programs,
each walking its whole context alone (at 880 cached tokens, Qwen3.5-35B-A3B's 2 kv heads: 28 steps
of 32 keys in sequence). `_paged_decode_split_kernel` gives split s of segment n the keys
[s * chunk, (s + 1) * chunk), chunk = max(DECODE_MIN_CHUNK, ceil(kv_len / DECODE_SPLITS)) rounded
up to the tile's BLOCK_N, and writes its unnormalised partial (accumulator, running max, sum); one
`_combine_splits_kernel` program per (token, head) merges the splits in order 0..S-1. The chunking
depends on the segment's own kv length only, so a sequence's result does not depend on the others
in the step; the grid is fixed (DECODE_SPLITS), so the decode CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Cache writes are one index_copy_ per cache in the reference already: device-side, no host sync.
from forkpoint.kernels.attention.reference import copy_kv_slots, write_kv  # noqa: F401
from forkpoint.kernels.cache_dirs import autotune_choices_kept


@triton.jit
def _attn_block(acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, stride_kb, stride_ks,
                stride_vb, stride_vs, block_size, o_d, m_d, qk_scale,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over kv positions [start, start + BLOCK_N). MASKED=False: every one
    of them is < hi and visible to every row of the tile (no causal or bounds masks)."""
    kv = start + tl.arange(0, BLOCK_N)
    if MASKED:
        m_kv = kv < hi
        blk = tl.load(bt_row + kv // block_size, mask=m_kv, other=0).to(tl.int64)
        m_load = m_kv[:, None] & m_d[None, :]
    else:
        blk = tl.load(bt_row + kv // block_size).to(tl.int64)
        m_load = m_d[None, :]
    off = kv % block_size
    k = tl.load(k_base + (blk * stride_kb + off * stride_ks)[:, None] + o_d[None, :], mask=m_load, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where((kv[None, :] <= q_pos[:, None]) & m_kv[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that sees no key yet keeps its arithmetic finite
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + (blk * stride_vb + off * stride_vs)[:, None] + o_d[None, :], mask=m_load, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


# stride_bt is the step's block-table width: not specialised (== 1, % 16), so steps of any width
# share one compiled variant (runner/warmup.py cannot enumerate widths)
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attn_kernel(Q, Kc, Vc, O, block_tables, cu_q, seq_lens, qk_scale,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
                       block_size, Dh,
                       G: tl.constexpr, BLOCK_D: tl.constexpr, Q_BUCKET: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Q_BUCKET is unused here: it only keys the prefill autotuner (see `_q_bucket`)
    i_m, i_n, i_hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_P = BLOCK_M // G                       # query positions per tile
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
    # kv positions [0, full) are visible to every row (padding rows sit at later positions):
    # whole BLOCK_N steps there need no mask; the causal diagonal and the tail after it do
    full = (ctx + i_m * BLOCK_P + 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables + i_n.to(tl.int64) * stride_bt
    k_base = Kc + i_hk * stride_kh
    v_base = Vc + i_hk * stride_vh
    for start in range(0, full, BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, stride_kb, stride_ks,
                                    stride_vb, stride_vs, block_size, o_d, m_d, qk_scale, BLOCK_N, False)
    for start in range(full, hi, BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, stride_kb, stride_ks,
                                    stride_vb, stride_vs, block_size, o_d, m_d, qk_scale, BLOCK_N, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (q_start + pos)[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :],
             out.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


# T (the step's tokens) is not specialised either: decode steps of any size share one variant
@triton.jit(do_not_specialize=["stride_bt", "T"])
def _paged_decode_split_kernel(Q, Kc, Vc, Part, Stats, block_tables, cu_q, seq_lens, qk_scale,
                               stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh, stride_bt,
                               block_size, Dh, T, HQ,
                               G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Split i_s of segment i_n, kv head i_hk, in a decode step (q_len <= BLOCK_M // G: one tile
    holds every query of the segment). Part [S, T, HQ, BLOCK_D] fp32: the unnormalised output;
    Stats [S, T, HQ, 2] fp32: (running max, exp2-sum); a split with no visible key writes max -inf
    and sum 0 (and no Part row)."""
    i_s, i_n, i_hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_P = BLOCK_M // G
    q_start = tl.load(cu_q + i_n).to(tl.int64)
    q_len = tl.load(cu_q + i_n + 1).to(tl.int64) - q_start
    if q_len == 0:
        return
    kv_len = tl.load(seq_lens + i_n).to(tl.int64)
    ctx = kv_len - q_len
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = i_s * chunk
    end = tl.minimum(lo + chunk, kv_len)

    rows = tl.arange(0, BLOCK_M)
    pos = rows // G
    head = i_hk * G + rows % G
    m_row = (pos < q_len) & (rows < BLOCK_P * G)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < Dh
    q = tl.load(Q + (q_start + pos)[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :],
                mask=m_row[:, None] & m_d[None, :], other=0.0)
    q_pos = ctx + pos
    full = (ctx + 1) // BLOCK_N * BLOCK_N        # kv positions [0, full) are visible to every row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables + i_n.to(tl.int64) * stride_bt
    k_base = Kc + i_hk * stride_kh
    v_base = Vc + i_hk * stride_vh
    for start in range(lo, tl.minimum(full, end), BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, start, end, bt_row, k_base, v_base, stride_kb,
                                    stride_ks, stride_vb, stride_vs, block_size, o_d, m_d, qk_scale, BLOCK_N, False)
    for start in range(tl.maximum(lo, full), end, BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, start, end, bt_row, k_base, v_base, stride_kb,
                                    stride_ks, stride_vb, stride_vs, block_size, o_d, m_d, qk_scale, BLOCK_N, True)
    token = (q_start + pos).to(tl.int64)
    row = (i_s * T + token) * HQ + head
    seen = l_i > 0.0
    tl.store(Stats + row * 2, tl.where(seen, m_i, float("-inf")), mask=m_row)
    tl.store(Stats + row * 2 + 1, l_i, mask=m_row)
    tl.store(Part + row[:, None] * BLOCK_D + o_d[None, :], acc, mask=(m_row & seen)[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["T"])
def _combine_splits_kernel(Part, Stats, O, stride_ot, stride_oh, Dh, T, HQ,
                           BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """O[t, h] = sum_s Part[s, t, h] * 2^(m_s - m) / sum_s l_s * 2^(m_s - m), m = max_s m_s, the
    splits taken in order (every row has at least one visible key: its own position)."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, BLOCK_D)
    m = float("-inf")
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(Stats + ((s * T + t) * HQ + h) * 2))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for s in range(NUM_SPLITS):
        row = (s * T + t) * HQ + h
        m_s = tl.load(Stats + row * 2)
        w = tl.exp2(m_s - m)  # 0 for a split without visible keys (max -inf, sum 0, Part not written)
        total += tl.load(Stats + row * 2 + 1) * w
        written = (tl.zeros([BLOCK_D], dtype=tl.float32) + m_s) > float("-inf")
        acc += tl.load(Part + row * BLOCK_D + o_d, mask=written, other=0.0) * w
    tl.store(O + t * stride_ot + h * stride_oh + o_d, (acc / total).to(O.dtype.element_ty), mask=o_d < Dh)


# ---------------------------------------------------------------- tile configs
#
# A tile is BLOCK_M rows = BLOCK_M // G query positions x the G heads of one kv head; every K/V
# block of the context is read once per tile, so long prefixes want many positions per tile.
# Prefill steps pick their tile by autotuning over PREFILL_CONFIGS, once per key (G, BLOCK_D,
# Q_BUCKET, dtypes): values that do not change from step to step, so the tuning (a few seconds:
# every config is compiled and timed on that call's inputs) happens in the engine's warm-up.
# Decode-only steps (max_q * G <= 16) keep one small fixed tile: no tuning, graph-capturable.

PREFILL_CONFIGS = tuple(
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
    for m in (64, 128) for n in (32, 64) for w in (4, 8) for s in (1, 2, 3)
)
_REGS_PER_THREAD = 128       # fp32 accumulator registers a thread may hold (of 255)
# Shared memory a tile may plan for: the device's per-block limit less this margin, which the estimate in
# `_fits` leaves out (Triton's barriers and layout-conversion scratch). On an H200 (227 KB) that admits the
# 192 KB of BLOCK_M=128, BLOCK_N=64 with 2 pipeline stages at head dim 256, which the old fixed 160 KB
# pruned: 13-16% faster on long prefills than the 1 stage the autotuner had to take, with bit-identical
# outputs (stages change when K/V tiles load, not the arithmetic; docs/kernels_h200.md, session 22).
_SMEM_MARGIN_BYTES = 16 * 1024


def _smem_budget(device: torch.device | None) -> int:
    """Shared memory bytes a prefill tile may plan for on `device` (None: the current CUDA device)."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin - _SMEM_MARGIN_BYTES


def _fits(config: triton.Config, g: int, block_d: int, smem_budget: int, elem_bytes: int = 2) -> bool:
    """Whether a prefill tile is plausible: BLOCK_M covers a whole GQA group, the fp32 accumulator
    [BLOCK_M, BLOCK_D] leaves registers to spare, and the pipelined K/V tiles plus q fit in
    `smem_budget` bytes of shared memory (what Triton asks for them: 327,680 B for 128x128 with 2
    stages at head dim 256, as its out-of-resources error said; it may keep q in registers)."""
    m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    if m < _next_pow2(g):
        return False
    if m * block_d > _REGS_PER_THREAD * 32 * config.num_warps:
        return False
    smem = (max(1, config.num_stages) * 2 * n * block_d + m * block_d) * elem_bytes
    return smem <= smem_budget


def _prune_prefill(configs, named_args, **kwargs):
    g, block_d = kwargs["G"], kwargs["BLOCK_D"]
    kc = named_args.get("Kc")
    elem = kc.element_size() if kc is not None else 2
    budget = _smem_budget(kc.device if kc is not None else None)
    kept = [c for c in configs if _fits(c, g, block_d, budget, elem)]
    if kept:
        return kept
    # a group wider than every tile: one tile of the whole group
    return [triton.Config({"BLOCK_M": _next_pow2(g), "BLOCK_N": 32}, num_warps=8, num_stages=1)]


# cache_results: the choices persist in Triton's cache directory (kernels/cache_dirs.py), so a restart
# loads them instead of timing every tile again; not in the start-up compile workers, whose timings
# run side by side (runner/precompile.py)
_paged_attn_prefill = triton.autotune(
    configs=list(PREFILL_CONFIGS), key=["G", "BLOCK_D", "Q_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_prefill}, cache_results=autotune_choices_kept(),
)(_paged_attn_kernel)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _q_bucket(max_q: int) -> int:
    """Autotune key for the step's longest query segment: short prefills (<= 16 positions, a
    chunk of a few tokens among decodes) and long ones tune separately. Not raw max_q: that would
    re-tune on every new prompt length."""
    return 0 if max_q <= 16 else 1


def decode_config(g: int, block_d: int) -> triton.Config:
    """The fixed tile of decode-only steps: the smallest that still feeds tl.dot."""
    m = max(16, _next_pow2(g))
    return triton.Config({"BLOCK_M": m, "BLOCK_N": 32 if block_d >= 256 else 64},
                         num_warps=8 if m * block_d >= 64 * 256 else 4, num_stages=2)


def is_decode_step(max_q: int, g: int) -> bool:
    return max_q * g <= 16


# Decode steps: each segment's keys in at most DECODE_SPLITS chunks of at least DECODE_MIN_CHUNK
# keys (contexts up to DECODE_MIN_CHUNK keys run as one split).
DECODE_SPLITS = 16
DECODE_MIN_CHUNK = 128


def _split_decode(q, k_cache, v_cache, o, block_tables, cu_seqlens_q, seq_lens, scale, g, block_d,
                  config: triton.Config) -> None:
    """Decode attention as DECODE_SPLITS partial programs per (segment, kv head) and one merge
    program per (token, q head) (module docstring); writes every row of `o`. Workspace: fp32
    partials [DECODE_SPLITS, T, HQ, BLOCK_D] and stats [DECODE_SPLITS, T, HQ, 2], from the caching
    allocator (67 MB at 256 sequences of Qwen3.5-35B-A3B: 16 heads of 256)."""
    T, hq, dh = q.shape
    n, hkv = block_tables.shape[0], k_cache.shape[2]
    block_n = config.kwargs["BLOCK_N"]
    part = torch.empty(DECODE_SPLITS, T, hq, block_d, dtype=torch.float32, device=q.device)
    stats = torch.empty(DECODE_SPLITS, T, hq, 2, dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(DECODE_SPLITS, n, hkv)](
        q, k_cache, v_cache, part, stats, block_tables, cu_seqlens_q, seq_lens, float(scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), k_cache.shape[1], dh, T, hq,
        G=g, BLOCK_D=block_d, BLOCK_M=config.kwargs["BLOCK_M"], BLOCK_N=block_n, NUM_SPLITS=DECODE_SPLITS,
        MIN_CHUNK=max(block_n, DECODE_MIN_CHUNK // block_n * block_n),
        num_warps=config.num_warps, num_stages=config.num_stages)
    _combine_splits_kernel[(T, hq)](part, stats, o, o.stride(0), o.stride(1), dh, T, hq,
                                    BLOCK_D=block_d, NUM_SPLITS=DECODE_SPLITS, num_warps=4 if block_d >= 256 else 2)


def prefill_tuned_configs() -> dict:
    """What the prefill autotuner chose so far: {(G, BLOCK_D, Q_BUCKET, dtypes...): config string}."""
    return {k: str(c) for k, c in _paged_attn_prefill.cache.items()}


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_q_host,
                    seq_lens, seq_lens_host, *, scale):
    """Causal attention of packed query segments over a paged KV cache, one launch.

    q: [T, HQ, Dh] packed by segment (bf16/fp16; fp32 runs as tf32); k_cache, v_cache:
    [num_blocks, block_size, HKV, Dh] (HQ % HKV == 0); block_tables: [N, max_blocks] int32;
    cu_seqlens_q: [N+1] on the device (cu_seqlens_q_host the same on the host); seq_lens: [N] kv
    length of each segment after this step's tokens (seq_lens_host unused: kept for the contract).
    Returns o [T, HQ, Dh] in q.dtype, a new tensor; every row of it is written. The first prefill
    call per (G, Dh, short/long) autotunes its tile (synchronises; not inside a CUDA graph capture).
    """
    return paged_attention_with_config(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_q_host,
                                       seq_lens, seq_lens_host, scale=scale)


def paged_attention_with_config(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_q_host,
                                seq_lens, seq_lens_host, *, scale, config: triton.Config | None = None):
    """`paged_attention` with the tile forced to `config` (tests, benchmarks); None: decode steps
    use `decode_config`, prefill steps the autotuner."""
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
    if max_q == 0:
        return o
    block_d = max(16, _next_pow2(dh))
    if config is None and is_decode_step(max_q, g):
        _split_decode(q, k_cache, v_cache, o, block_tables, cu_seqlens_q, seq_lens, scale, g, block_d,
                      decode_config(g, block_d))
        return o
    if config is not None and config.kwargs["BLOCK_M"] < _next_pow2(g):
        raise ValueError(f"BLOCK_M {config.kwargs['BLOCK_M']} < GQA group {g}: a tile must hold a whole group")

    def grid(meta):
        return (triton.cdiv(max_q, meta["BLOCK_M"] // g), n, hkv)

    args = (q, k_cache, v_cache, o, block_tables, cu_seqlens_q, seq_lens, float(scale) * 1.4426950408889634,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
            block_tables.stride(0), block_size, dh)
    consts = {"G": g, "BLOCK_D": block_d, "Q_BUCKET": _q_bucket(max_q)}
    if config is None:
        _paged_attn_prefill[grid](*args, **consts)
    else:
        _paged_attn_kernel[grid](*args, **consts, **config.all_kwargs())
    return o
