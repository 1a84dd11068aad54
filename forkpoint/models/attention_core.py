"""The attention core every family shares: write the step's K/V into the paged cache, copy shared
partial blocks (copy-on-write), attend with the step's block tables.

Qwen's gated attention (models/qwen3_5.py) and the Mamba2 hybrids' plain attention
(models/mamba2.py) differ in their projections and outputs only; their cores are this function.
"""

from __future__ import annotations

import torch

from forkpoint.kernels.attention import copy_kv_slots, paged_attention, write_kv
from forkpoint.step.batch import ForwardBatch


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, HQ, Dh]; k, v: [T, HKV, Dh] (the step's T tokens exactly, rotated where the model
    rotates); k_cache, v_cache: [num_blocks, block_size, HKV, Dh]. Writes k and v (cast to the
    cache dtype) at `batch.attention.slot_mapping`, then the copy-on-write block copies, then attends
    with softmax scale `scale` -> [T, HQ, Dh] (copied into `out` when given, else a new tensor)."""
    meta = batch.attention
    write_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), meta.slot_mapping)
    if meta.cow_src.numel():
        copy_kv_slots(k_cache, v_cache, meta.cow_src, meta.cow_dst)
    attended = paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.cu_seqlens_q_host,
        meta.seq_lens,
        meta.seq_lens_host,
        scale=scale,
    )
    return attended if out is None else out.copy_(attended)
