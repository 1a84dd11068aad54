"""Packed varlen SSD prefill on CUDA through fla-core's simple-GLA kernels (GPU variant of
``reference.chunk_ssd``; same signature and semantics).

Simple GLA runs ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` per head with a
scalar log-decay g_t, which is the SSD recurrence with

    q = C,  k = B,  v = x * dt,  g = A * dt,  scale = 1,

the state stored V-first (``state_v_first=True``: ``[H, V, K] = [H, P, N]``, the pool layout).
fla has no grouped keys here, so B and C are expanded from G groups to H heads (a gather of
T * H * N elements, small beside the scan). D's skip term is added outside the kernel.

No host synchronisation, so the call can be captured in a CUDA graph once warm (runner/piecewise.py
replays one graph of a step's first Mamba2 core for every other Mamba2 layer): instead of
``chunk_simple_gla`` (which uploads ``cu_seqlens_cpu`` with a blocking copy per call and reads the
chunk count back with ``.item()``), this module runs its three stages itself -- the in-chunk
cumulative decay (``chunk_local_cumsum``), the chunk states (``chunk_fwd_kernel_h``) and the
outputs (``chunk_fwd_o``) -- with the chunk list and the per-segment chunk offsets built on the
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
from fla.ops.utils import chunk_local_cumsum
from fla.ops.utils.constant import RCP_LN2

from forkpoint.kernels import check_cu_seqlens
from forkpoint.kernels.conv1d.triton import chunk_indices
from forkpoint.kernels.ssd.reference import _check, _check_states, _heads


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


def chunk_ssd(x, dt, A, B, C, initial_state, cu_seqlens, cu_seqlens_host, *, D=None, chunk_size=64):
    """See ``forkpoint.kernels.ssd.reference.chunk_ssd``: x [T, H, P] (bf16/fp16/fp32), dt [T, H],
    A [H] fp32, B/C [T, G, N], initial_state [Nseq, H, P, N] fp32. Returns (y [T, H, P] in x.dtype,
    final_state [Nseq, H, P, N] fp32). No host sync once the offsets' uploads are cached."""
    _check(x, dt, A, B, C, D)
    num_segments = check_cu_seqlens(cu_seqlens_host, x.shape[0])
    _check_states(initial_state, num_segments, x, B, "initial_state")
    heads = x.shape[1]
    dtf = dt.float()
    q = _heads(C, heads).to(x.dtype).contiguous().unsqueeze(0)
    k = _heads(B, heads).to(x.dtype).contiguous().unsqueeze(0)
    v = (x.float() * dtf[..., None]).to(x.dtype).unsqueeze(0)
    idx = chunk_indices(cu_seqlens_host, chunk_size, x.device)
    offsets, num_chunks = chunk_offsets(cu_seqlens_host, chunk_size, x.device)
    # cumulative decay within each chunk, pre-scaled by 1/ln 2: the kernels use exp2
    g = chunk_local_cumsum((dtf * A.float()[None, :]).unsqueeze(0), chunk_size=chunk_size, scale=RCP_LN2,
                           cu_seqlens=cu_seqlens, chunk_indices=idx)
    h, final = _chunk_states(k, v, g, initial_state.contiguous(), cu_seqlens, offsets, num_chunks, chunk_size)
    o = chunk_fwd_o(q=q, k=k, v=v, h=h, g=g, scale=1.0, state_v_first=True, cu_seqlens=cu_seqlens,
                    chunk_size=chunk_size, chunk_indices=idx)
    y = o[0].float()
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    return y.to(x.dtype), final
