"""Packed varlen SSD prefill on CUDA through fla-core's ``chunk_simple_gla`` (GPU variant of
``reference.chunk_ssd``; same signature and semantics).

Simple GLA runs ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` per head with a
scalar log-decay g_t, which is the SSD recurrence with

    q = C,  k = B,  v = x * dt,  g = A * dt,  scale = 1,

the state stored V-first (``state_v_first=True``: ``[H, V, K] = [H, P, N]``, the pool layout).
fla has no grouped keys here, so B and C are expanded from G groups to H heads (a gather of
T * H * N elements, small beside the scan). D's skip term is added outside the kernel.
"""

from __future__ import annotations

import torch
from fla.ops.simple_gla import chunk_simple_gla

from forkpoint.kernels import check_cu_seqlens
from forkpoint.kernels.ssd.reference import _check, _check_states, _heads


def chunk_ssd(x, dt, A, B, C, initial_state, cu_seqlens, cu_seqlens_host, *, D=None, chunk_size=64):
    """See ``forkpoint.kernels.ssd.reference.chunk_ssd``: x [T, H, P] (bf16/fp16/fp32), dt [T, H],
    A [H] fp32, B/C [T, G, N], initial_state [Nseq, H, P, N] fp32. Returns (y [T, H, P] in x.dtype,
    final_state [Nseq, H, P, N] fp32)."""
    _check(x, dt, A, B, C, D)
    num_segments = check_cu_seqlens(cu_seqlens_host, x.shape[0])
    _check_states(initial_state, num_segments, x, B, "initial_state")
    heads = x.shape[1]
    dtf = dt.float()
    q = _heads(C, heads).to(x.dtype)
    k = _heads(B, heads).to(x.dtype)
    v = (x.float() * dtf[..., None]).to(x.dtype)
    g = dtf * A.float()[None, :]
    cpu = torch.tensor(cu_seqlens_host, dtype=torch.long)
    o, final = chunk_simple_gla(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), scale=1.0,
                                initial_state=initial_state.contiguous(), output_final_state=True,
                                state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cpu,
                                chunk_size=chunk_size)
    y = o[0].float()
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    return y.to(x.dtype), final.float()
