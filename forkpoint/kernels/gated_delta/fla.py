"""Gated delta rule on CUDA through fla-core's Triton kernels (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.gated_delta.reference`; inputs bf16 (or fp16),
recurrent state float32. This module imports fla-core at its top; the dispatch in
`forkpoint.kernels.gated_delta` imports it only for CUDA tensors (falling back to the reference when
fla-core is missing), so the CPU install never needs fla-core or Triton.

How the fla calls are made:

- Packed variable-length input: fla wants `[B=1, T, ...]` plus `cu_seqlens [N+1]`; we add the
  batch axis with a view.
- Grouped value heads (HV > H) are native in fla: value head j reads q/k head j // (HV // H),
  the same rule as INTERFACES.md, so q and k are never repeated.
- No host synchronisation: fla derives `chunk_indices [NT, 2]` (segment, chunk-in-segment) from
  `cu_seqlens`, and its own `cu_seqlens_cpu` path still makes a blocking host-to-device copy
  (a stream sync). We pass `chunk_indices` built from `cu_seqlens_host` by
  `forkpoint.kernels.conv1d.triton.chunk_indices` (numpy, pinned, `non_blocking=True`, cached per
  offsets), so the conv and the 30 GDN layers of one step share one upload, and once warm the call
  is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule

from forkpoint.kernels.conv1d.triton import chunk_indices


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_host,
                           *, scale=None, use_qk_l2norm=True, chunk_size=64):
    """Packed varlen chunked gated delta rule (prefill), one fla launch sequence for all segments.

    q, k: [T, H, K] bf16; v: [T, HV, V] bf16 (HV % H == 0); g: [T, HV] fp32 log-decay (<= 0);
    beta: [T, HV]; initial_state: [N, HV, K, V] fp32 (read only); cu_seqlens: LongTensor [N+1] on
    the device; cu_seqlens_host: the same offsets on the host.
    Returns (o [T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32, a new tensor).
    """
    n = len(cu_seqlens_host) - 1
    if initial_state.shape[0] != n:
        raise ValueError(f"initial_state has {initial_state.shape[0]} rows but cu_seqlens_host describes {n} "
                         "segments: pass one state row per segment")
    if initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32, got {initial_state.dtype}: "
                         "the recurrent state is kept in fp32")
    idx = chunk_indices(cu_seqlens_host, chunk_size, q.device)
    o, final_state = fla_chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        chunk_indices=idx,
        chunk_size=chunk_size,
    )
    return o[0].to(v.dtype), final_state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, *, scale=None, use_qk_l2norm=True):
    """One token per sequence (decode) through fla's fused recurrent kernel.

    q, k: [N, H, K]; v: [N, HV, V]; g: [N, HV] fp32; beta: [N, HV];
    initial_state: [N, HV, K, V] fp32 (read only). Returns (o [N, HV, V] in v.dtype,
    final_state [N, HV, K, V] fp32, a new tensor).
    """
    if initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32, got {initial_state.dtype}: "
                         "the recurrent state is kept in fp32")
    # [N, 1, ...]: batch of N sequences of one token each, no cu_seqlens needed.
    # fla's signature is (q, k, v, g, gk, gv, beta, ...): pass g and beta by name
    o, final_state = fla_fused_recurrent_gated_delta_rule(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g=g.unsqueeze(1), beta=beta.unsqueeze(1),
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o[:, 0].to(v.dtype), final_state
