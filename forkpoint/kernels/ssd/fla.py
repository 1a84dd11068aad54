"""Packed varlen SSD prefill on CUDA through fla-core's simple-GLA kernels (GPU variant of
``reference.chunk_ssd``; same signature and semantics).

Simple GLA runs ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` per head with a
scalar log-decay g_t, which is the SSD recurrence with

    q = C,  k = B,  v = x * dt,  g = A * dt,  scale = 1,

the state stored V-first (``state_v_first=True``: ``[H, V, K] = [H, P, N]``, the pool layout).
fla's output kernel reads grouped q and k (G key heads for H value heads), its chunk-state kernel
does not, so B is expanded from G groups to H heads for that one (T * H * N elements). The
elementwise work around fla's kernels is one launch each side (``triton.ssd_prologue``: q, k,
k per head, v = x dt and the in-chunk cumulative decay g in one pass over the chunk list;
``triton.ssd_epilogue``: D's skip term, written in x.dtype into the caller's ``out`` view).

No host synchronisation, so the call can be captured in a CUDA graph once warm (runner/piecewise.py
replays one graph of a step's first Mamba2 core for every other Mamba2 layer): instead of
``chunk_simple_gla`` (which uploads ``cu_seqlens_cpu`` with a blocking copy per call and reads the
chunk count back with ``.item()``), this module runs its stages itself -- the prologue (which
also does fla's ``chunk_local_cumsum``), the chunk states (``chunk_fwd_kernel_h``), the outputs
(``chunk_fwd_o``) and the epilogue -- with the chunk list and the per-segment chunk offsets built on the
host from ``cu_seqlens_host`` and uploaded without a sync, cached per offsets (shared with the
conv and the other layers of the step: ``conv1d.triton.chunk_indices``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
from fla.ops.common.chunk_h import chunk_fwd_kernel_h
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.utils.constant import RCP_LN2

from forkpoint.kernels import check_cu_seqlens
from forkpoint.kernels.conv1d.triton import chunk_indices
from forkpoint.kernels.ssd.reference import _check, _check_states, check_out
from forkpoint.kernels.ssd.triton import ssd_epilogue, ssd_prologue


@functools.lru_cache(maxsize=64)
def _chunk_offsets_cached(offsets: tuple[int, ...], chunk_size: int, device: torch.device) -> torch.Tensor:
    counts = (np.diff(np.asarray(offsets, dtype=np.int64)) + chunk_size - 1) // chunk_size
    host = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    return host.pin_memory().to(device, non_blocking=True)  # queued on the stream, the host does not wait


def chunk_offsets(cu_seqlens_host, chunk_size: int, device) -> tuple[torch.Tensor, int]:
    """(offsets [N+1] long on `device`: the first chunk of each segment in the packed chunk list,
    total chunk count NT) from the host offsets; cached per (offsets, chunk_size, device)."""
    key = tuple(int(v) for v in cu_seqlens_host)
    total = int(sum(-(-(b - a) // chunk_size) for a, b in zip(key[:-1], key[1:])))
    return _chunk_offsets_cached(key, int(chunk_size), torch.device(device)), total


def _chunk_states(k, v, g, h0, cu_seqlens, offsets, num_chunks, chunk_size):
    """fla's `chunk_fwd_h` (V-first states) with the chunk offsets and count given, so nothing is
    read back from the device. k: [1, T, H, N]; v: [1, T, H, P]; g: [1, T, H] fp32 (cumulative, log2
    scale); h0: [Nseq, H, P, N] fp32. Returns (h [1, NT, H, P, N] in k.dtype, ht [Nseq, H, P, N] fp32)."""
    _, tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    h = k.new_empty(1, num_chunks, heads, value_dim, key_dim)
    ht = k.new_empty(h0.shape[0], heads, value_dim, key_dim, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(key_dim, meta["BK"]) * triton.cdiv(value_dim, meta["BV"]) * h0.shape[0] * heads,)

    chunk_fwd_kernel_h[grid](k=k, v=v, h=h, g=g, g_gamma=None, gk=None, gv=None, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
                             split_offsets=offsets, T=tokens, H=heads, K=key_dim, V=value_dim, BT=chunk_size,
                             BS=chunk_size, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
                             STATE_V_FIRST=True)
    return h, ht


def chunk_ssd(x, dt, A, B, C, initial_state, cu_seqlens, cu_seqlens_host, *, D=None, chunk_size=64, out=None):
    """See ``forkpoint.kernels.ssd.reference.chunk_ssd``: x [T, H, P] (bf16/fp16/fp32), dt [T, H],
    A [H] fp32, B/C [T, G, N] (last dims contiguous, e.g. views of the conv output),
    initial_state [Nseq, H, P, N] fp32, out [T, H, P] in x.dtype (strided view allowed) or None.
    Returns (y [T, H, P] in x.dtype, `out` when given; final_state [Nseq, H, P, N] fp32). Four
    launches (prologue, chunk states, outputs, epilogue), no host sync once the offsets' uploads are cached."""
    _check(x, dt, A, B, C, D)
    check_out(out, x)
    num_segments = check_cu_seqlens(cu_seqlens_host, x.shape[0])
    _check_states(initial_state, num_segments, x, B, "initial_state")
    idx = chunk_indices(cu_seqlens_host, chunk_size, x.device)
    offsets, num_chunks = chunk_offsets(cu_seqlens_host, chunk_size, x.device)
    # g: cumulative decay within each chunk, pre-scaled by 1/ln 2 (the kernels use exp2)
    q, k, k_heads, v, g = (t.unsqueeze(0) for t in ssd_prologue(x, dt, A, B, C, cu_seqlens, idx,
                                                                chunk_size=chunk_size, scale=RCP_LN2))
    h, final = _chunk_states(k_heads, v, g, initial_state.contiguous(), cu_seqlens, offsets, num_chunks, chunk_size)
    o = chunk_fwd_o(q=q, k=k, v=v, h=h, g=g, scale=1.0, state_v_first=True, cu_seqlens=cu_seqlens,
                    chunk_size=chunk_size, chunk_indices=idx)
    if out is None:
        out = torch.empty_like(v[0])
    return ssd_epilogue(o[0], x, D, out), final
