"""Mamba2 state-space duality (SSD) scan, plain PyTorch: the spec and the CPU path.

Per head h with state H_t [P, N] (fp32; P = head_dim, N = d_state), step dt_t > 0 (already
softplus'd and clamped by the caller), decay A_h < 0, and B/C shared by the heads of a group
(head h reads group ``h // (H // G)``):

    H_t = exp(dt_t * A_h) * H_{t-1} + dt_t * x_t B_t^T          x_t: [P], B_t: [N]
    y_t = H_t C_t + D_h * x_t                                   C_t: [N]

This is transformers' ``mamba2_chunk_scan`` / ``mamba2_selective_state_update`` (Mamba2, Bamba,
Nemotron-H, Granite-4.0-H, Falcon-H1) with the state layout ``[H, P, N]`` of their caches,
extended to packed variable-length batches with per-segment initial and final states.

Chunked form (``chunk_ssd``), per segment split into chunks of ``chunk_size`` tokens: with
a_t = dt_t A and the in-chunk cumulative sums s_t = a_1 + ... + a_t,

    y_t  = sum_{u <= t in chunk} exp(s_t - s_u) (C_t . B_u) dt_u x_u      (intra-chunk, one matmul)
         + exp(s_t) H_start C_t                                          (carried state)
    H_end = exp(s_last) H_start + sum_u exp(s_last - s_u) dt_u x_u B_u^T

The intra-chunk part of every chunk of every segment runs as one batch; the scan then carries
the states chunk by chunk (the layout of ``forkpoint.kernels.gated_delta.reference``: segments
ordered by chunk count, so the chunks advanced at scan step c are contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from forkpoint.kernels import check_cu_seqlens


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None) -> None:
    """Shapes of x [T, H, P], dt [T, H], A [H], B and C [T, G, N] with H % G == 0, D [H] or None."""
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, H, P], got {tuple(x.shape)}")
    tokens, heads, _ = x.shape
    if dt.shape != (tokens, heads) or A.shape != (heads,):
        raise ValueError(f"dt must be [tokens, H] = {(tokens, heads)} and A [H] = {(heads,)}, got "
                         f"{tuple(dt.shape)} and {tuple(A.shape)}")
    if B.dim() != 3 or B.shape != C.shape or B.shape[0] != tokens or heads % B.shape[1]:
        raise ValueError(f"B and C must both be [tokens, G, N] with H = {heads} a multiple of G, got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    if D is not None and D.shape != (heads,):
        raise ValueError(f"D must be [H] = {(heads,)}, got {tuple(D.shape)}")


def _check_states(states: torch.Tensor, rows: int | None, x: torch.Tensor, B: torch.Tensor, name: str) -> None:
    expected = (x.shape[1], x.shape[2], B.shape[2])
    if states.dim() != 4 or tuple(states.shape[1:]) != expected or (rows is not None and states.shape[0] != rows):
        raise ValueError(f"{name} must be [{'N' if rows is None else rows}, H, P, N] = [..., {expected[0]}, "
                         f"{expected[1]}, {expected[2]}], got {tuple(states.shape)}")
    if states.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {states.dtype}: the SSM state is kept in fp32")


def check_out(out: torch.Tensor | None, x: torch.Tensor) -> None:
    """``out`` (when given) must have x's shape and dtype [T, H, P] and a contiguous last dim."""
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with a contiguous last dim (a strided view is "
                         f"fine), got {out.dtype} {tuple(out.shape)} with strides {out.stride()}")


def _written(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y (already in the output dtype), or `out` with y copied into it when given."""
    return y if out is None else out.copy_(y)


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """Mamba2's step sizes from the raw projection: ``clamp(softplus(dt + dt_bias), dt_min, dt_max)``
    in fp32 (torch's softplus: beta 1, identity above 20). dt: [T, H] (any float dtype, row
    strides allowed); dt_bias: [H]; 0 <= dt_min <= dt_max (dt_max may be inf). Returns [T, H] fp32,
    a new tensor."""
    if dt.dim() != 2 or dt_bias.shape != (dt.shape[1],):
        raise ValueError(f"dt must be [T, H] and dt_bias [H], got {tuple(dt.shape)} and {tuple(dt_bias.shape)}")
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each head reads its group's row."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              initial_state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: Sequence[int], *,
              D: torch.Tensor | None = None, chunk_size: int = 64,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen SSD scan (prefill).

    x: [T, H, P]; dt: [T, H] (positive, used in fp32); A: [H] fp32 (negative); B, C: [T, G, N];
    initial_state: [Nseq, H, P, N] fp32 (read only); cu_seqlens [Nseq+1] long (device) and
    cu_seqlens_host (the same offsets on the host); D: [H] or None; out: [T, H, P] in x.dtype (may
    be a strided view, last dim contiguous) or None.
    Returns (y [T, H, P] in x.dtype: `out` itself when given, every row written; final_state
    [Nseq, H, P, N] fp32, a new tensor). A segment of length 0 returns its initial state.
    """
    del cu_seqlens  # the reference walks the host offsets
    _check(x, dt, A, B, C, D)
    check_out(out, x)
    num_segments = check_cu_seqlens(cu_seqlens_host, x.shape[0])
    _check_states(initial_state, num_segments, x, B, "initial_state")
    tokens, heads, head_dim = x.shape
    device = x.device
    lengths = [cu_seqlens_host[i + 1] - cu_seqlens_host[i] for i in range(num_segments)]
    num_chunks = [-(-n // chunk_size) for n in lengths]
    order = sorted(range(num_segments), key=lambda i: -num_chunks[i])
    total = sum(num_chunks)
    final = initial_state.clone()
    y = torch.zeros(tokens, heads, head_dim, dtype=torch.float32, device=device)
    if total == 0:
        return _written(y.to(x.dtype), out), final

    # step-major chunk layout: chunk c of the segments that have one, in `order`
    index = torch.full((total, chunk_size), tokens, dtype=torch.long)  # `tokens` = the zero padding row
    chunk = 0
    for c in range(num_chunks[order[0]]):
        for seg in order:
            if num_chunks[seg] <= c:
                break
            lo = cu_seqlens_host[seg] + c * chunk_size
            hi = min(lo + chunk_size, cu_seqlens_host[seg + 1])
            index[chunk, : hi - lo] = torch.arange(lo, hi)
            chunk += 1
    index = index.to(device)
    valid = index < tokens

    def gather(t: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([t.float(), t.new_zeros((1, *t.shape[1:]), dtype=torch.float32)])
        return padded[index]  # [total, L, ...]

    dt_c = gather(dt)  # padding: dt = 0, so no decay and no write
    xdt = gather(x) * dt_c[..., None]  # [total, L, H, P]
    b = _heads(gather(B), heads)  # [total, L, H, N]
    c_ = _heads(gather(C), heads)
    cum = torch.cumsum(dt_c * A.float(), dim=1)  # [total, L, H]
    # intra-chunk: exp(s_t - s_u) for u <= t (masked before exp so no inf * 0)
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [total, t, u, H]
    causal = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device))
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("cthn,cuhn->ctuh", c_, b) * decay
    y_chunk = torch.einsum("ctuh,cuhp->cthp", scores, xdt)
    # each chunk's own contribution to its end state, and the decay of a carried state across it
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [total, L, H]
    chunk_states = torch.einsum("cuh,cuhp,cuhn->chpn", to_end, xdt, b)
    chunk_decay = torch.exp(cum[:, -1, :])  # [total, H]
    from_start = torch.exp(cum)  # [total, L, H]

    state = initial_state[torch.tensor(order, device=device)].float()  # [Nseq, H, P, N] in `order`
    first = 0
    for c in range(num_chunks[order[0]]):
        active = sum(1 for seg in order if num_chunks[seg] > c)
        rows = slice(first, first + active)
        carried = state[:active]
        y_chunk[rows] += torch.einsum("cthn,chpn->cthp", c_[rows], carried) * from_start[rows][..., None]
        state = torch.cat([carried * chunk_decay[rows][:, :, None, None] + chunk_states[rows], state[active:]])
        first += active
    final[torch.tensor(order, device=device)] = state

    flat_index, flat_valid = index.flatten(), valid.flatten()
    y[flat_index[flat_valid]] = y_chunk.flatten(0, 1)[flat_valid]
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    return _written(y.to(x.dtype), out), final


def ssd_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_state: torch.Tensor, cu_seqlens_host: Sequence[int], *,
                   D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence (the spec; slow): same arguments and results as ``chunk_ssd``."""
    _check(x, dt, A, B, C, D)
    num_segments = check_cu_seqlens(cu_seqlens_host, x.shape[0])
    _check_states(initial_state, num_segments, x, B, "initial_state")
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    final = initial_state.clone()
    for seg in range(num_segments):
        state = initial_state[seg].float()
        for t in range(cu_seqlens_host[seg], cu_seqlens_host[seg + 1]):
            out, state = _step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], state[None], D)
            y[t], state = out[0], state[0]
        final[seg] = state
    return y.to(x.dtype), final


def _step(x, dt, A, B, C, state, D):
    """fp32 single step of N sequences: x [N, H, P], dt [N, H], B/C [N, G, N], state [N, H, P, N]."""
    heads = x.shape[1]
    xf, dtf = x.float(), dt.float()
    state = state * torch.exp(dtf * A.float())[:, :, None, None] + torch.einsum(
        "nhp,nhs->nhps", xf * dtf[..., None], _heads(B.float(), heads))
    y = torch.einsum("nhps,nhs->nhp", state, _heads(C.float(), heads))
    if D is not None:
        y = y + D.float()[None, :, None] * xf
    return y, state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, *, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode). x: [N, H, P]; dt: [N, H]; B, C: [N, G, N]; state:
    [N, H, P, N] fp32 (read only). Returns (y [N, H, P] in x.dtype, new_state [N, H, P, N] fp32)."""
    _check(x, dt, A, B, C, D)
    _check_states(state, x.shape[0], x, B, "state")
    y, new_state = _step(x, dt, A, B, C, state, D)
    return y.to(x.dtype), new_state


def check_pool(state_pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, B: torch.Tensor) -> None:
    """Shape and dtype checks of ``ssd_step_inplace``'s pool (metadata only, no sync)."""
    _check_states(state_pool, None, x, B, "state_pool")
    if slots.shape != (x.shape[0],) or slots.dtype != torch.long:
        raise ValueError(f"slots must be a LongTensor [N] = [{x.shape[0]}] (one pool row per sequence), "
                         f"got {slots.dtype} {tuple(slots.shape)}")


def ssd_step_inplace(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     state_pool: torch.Tensor, slots: torch.Tensor, *,
                     D: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``ssd_step`` on rows ``slots`` [N] (distinct, never row 0) of state_pool [S, H, P, N] fp32,
    written back in place; other rows are untouched. Returns y [N, H, P] in x.dtype: `out` itself
    when given ([N, H, P] in x.dtype, may be a strided view with a contiguous last dim)."""
    _check(x, dt, A, B, C, D)
    check_pool(state_pool, slots, x, B)
    check_out(out, x)
    y, new_state = _step(x, dt, A, B, C, state_pool.index_select(0, slots), D)
    state_pool.index_copy_(0, slots, new_state)
    return _written(y.to(x.dtype), out)
