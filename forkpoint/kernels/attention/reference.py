"""Paged KV cache writes and causal attention over block tables, plain PyTorch (spec, CPU path).

Cache layout: ``[num_blocks, block_size, HKV, Dh]``; a flat slot is ``block * block_size + offset``.
KV position p of segment n lives in block ``block_tables[n, p // block_size]`` at offset
``p % block_size``. A segment's query tokens are the last ``q_len`` of its ``seq_len`` positions:

    positions   0 1 2 3 4 5 6 7 8 9          seq_len = 10, q_len = 3
    kv (cache)  ===================          (this step's k, v written by write_kv first)
    queries                   q q q          query i sits at 7 + i, attends to positions <= 7 + i
"""

from collections.abc import Sequence

import torch

from forkpoint.kernels import check_cu_seqlens

# float32 scores ([HQ, queries, kv_len]) one pass of `paged_attention` materialises: a long prefill runs
# its queries in chunks under it, so the longest legal prompt's prefill fits a CPU (rows are independent)
SCORE_BYTES = 128 << 20


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, HKV, Dh], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values in the paged caches, in place.

    k_cache, v_cache: [num_blocks, block_size, HKV, Dh] (contiguous); k, v: [T, HKV, Dh];
    slot_mapping: [T] long, distinct flat slots.
    """
    _check_caches(k_cache, v_cache)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]:
        raise ValueError(
            f"k, v must be [T, HKV, Dh] = [T, {k_cache.shape[2]}, {k_cache.shape[3]}] and slot_mapping [T], "
            f"got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def copy_kv_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Copy-on-write of a shared partial block: ``cache[dst] = cache[src]`` for flat slots, in place.

    k_cache, v_cache: [num_blocks, block_size, HKV, Dh] (contiguous); src_slots, dst_slots: [M] long;
    dst slots are distinct and disjoint from src slots.
    """
    _check_caches(k_cache, v_cache)
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots and dst_slots must both be [M], got {tuple(src_slots.shape)}, {tuple(dst_slots.shape)}"
        )
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, dst_slots.long(), flat[src_slots.long()])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_q_host: Sequence[int],
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries over paged KV (prefill with a cached prefix, and decode).

    q: [T, HQ, Dh] packed by segment; k_cache, v_cache: [num_blocks, block_size, HKV, Dh] with
    HQ % HKV == 0 (query head h reads kv head h // (HQ // HKV)); block_tables: [N, max_blocks] int32;
    cu_seqlens_q: [N + 1]; seq_lens: [N], kv length of each segment including this step's tokens,
    >= its query count. The device tensors cu_seqlens_q and seq_lens are unused here: the
    reference reads their host copies. Every kv position < seq_len must have been written.

    Returns o [T, HQ, Dh] in q.dtype (softmax(scale * q k^T) v computed in fp32).
    """
    _check_caches(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads or head_dim != k_cache.shape[3]:
        raise ValueError(
            f"q must be [T, HQ, Dh] with HQ a multiple of HKV = {num_kv_heads} and Dh = {k_cache.shape[3]}, "
            f"got {tuple(q.shape)}"
        )
    num_seqs = check_cu_seqlens(cu_seqlens_q_host, num_tokens, "cu_seqlens_q_host")
    if len(seq_lens_host) != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens_host ({len(seq_lens_host)}) and block_tables ({block_tables.shape[0]} rows) "
            f"must have one entry per segment ({num_seqs})"
        )
    group = num_q_heads // num_kv_heads
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    block_offsets = torch.arange(block_size, device=q.device)
    o = q.new_empty(q.shape)
    for n in range(num_seqs):
        start, end, kv_len = cu_seqlens_q_host[n], cu_seqlens_q_host[n + 1], seq_lens_host[n]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-kv_len // block_size)
        if kv_len < q_len or num_blocks > block_tables.shape[1]:
            raise ValueError(
                f"segment {n}: seq_len {kv_len} must be >= its {q_len} queries and fit in "
                f"{block_tables.shape[1]} blocks of {block_size}"
            )
        slots = (block_tables[n, :num_blocks, None].long() * block_size + block_offsets).flatten()[:kv_len]
        k, v = k_flat[slots].float(), v_flat[slots].float()  # [L, HKV, Dh]
        chunk = max(1, SCORE_BYTES // (4 * num_q_heads * kv_len))
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            qs = q[start + lo:start + hi].float().view(hi - lo, num_kv_heads, group, head_dim)
            scores = torch.einsum("qhgd,khd->hgqk", qs, k) * scale
            q_pos = torch.arange(kv_len - q_len + lo, kv_len - q_len + hi, device=q.device)
            future = torch.arange(kv_len, device=q.device) > q_pos[:, None]  # [chunk, L]
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            o[start + lo:start + hi] = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(
                hi - lo, num_q_heads, head_dim).to(q.dtype)
    return o
