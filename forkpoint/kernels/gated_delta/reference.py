"""Gated delta rule (Gated DeltaNet), plain PyTorch: the spec and the CPU path.

Per value head, with state S [K, V] (fp32), log-decay g_t <= 0 and learning rate beta_t:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t

q and k are l2-normalised first (``x * rsqrt(sum(x*x) + 1e-6)``) when ``use_qk_l2norm``; value head j
reads q/k head ``j // (HV // H)``. The math is that of transformers' ``torch_chunk_gated_delta_rule``
and ``torch_recurrent_gated_delta_rule`` (Qwen3.5 / Qwen3-Next), extended to packed batches.

Chunked form: within a chunk of C tokens, the delta updates condense into a unit lower-triangular
solve (the UT transform); across chunks a scan carries the state. All chunks of all segments run the
intra-chunk part as one batch; the scan then walks chunk index c = 0, 1, ... and at each step
advances every segment that still has a c-th chunk. Segments are ordered by chunk count (most
first), so the segments active at step c are a prefix of that order and the chunks of one step are
contiguous:

    segments (sorted)   chunks           layout, step-major:  step 0    step 1  step 2
    s0: 3 chunks        s0.0 s0.1 s0.2                        s0.0 s1.0 s2.0 | s0.1 s1.1 | s0.2
    s1: 2 chunks        s1.0 s1.1
    s2: 1 chunk         s2.0
    s3: 0 chunks (length 0: final state = initial state)

Padding tokens (the tail of each segment's last chunk) have q = k = v = g = beta = 0: they read
nothing, write nothing and do not decay, so the state leaves a chunk exactly as its real tokens set it.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forkpoint.kernels import check_cu_seqlens

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [tokens, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1] != 0:
        raise ValueError(
            f"v must be [tokens, HV, V] with HV a multiple of H = {q.shape[1]} (grouped value heads), "
            f"got {tuple(v.shape)}"
        )
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(
            f"g and beta must be [tokens, HV] = {tuple(v.shape[:2])}, got {tuple(g.shape)} and {tuple(beta.shape)}"
        )


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q (normalised, scaled) and k (normalised), expanded from H to HV heads: [.., HV, K]."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = num_v_heads // q.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


@dataclass(frozen=True)
class _ChunkLayout:
    """Where the tokens of a packed batch sit once cut into chunks (see the module docstring).

    token_index: [B, C] long, token row of each chunk position; ``num_tokens`` (a zero row) for padding.
    chunk_of_token: [T] long, flat position (chunk * C + offset) of each token.
    order: [N] long, segments sorted by chunk count, most first.
    steps: (first chunk, number of active segments) of each scan step.
    """

    token_index: torch.Tensor
    chunk_of_token: torch.Tensor
    order: torch.Tensor
    steps: list[tuple[int, int]]


def _chunk_layout(cu_seqlens_host: Sequence[int], chunk_size: int, device: torch.device) -> _ChunkLayout:
    cu = torch.tensor(cu_seqlens_host, dtype=torch.long)
    num_tokens = int(cu[-1])
    lens = cu.diff()
    counts, order = ((lens + chunk_size - 1) // chunk_size).sort(descending=True, stable=True)
    step = torch.arange(int(counts[0]) if len(counts) else 0)
    active = counts[None, :] > step[:, None]  # [steps, N]; each row is a prefix of `order`
    seg = order.expand_as(active)[active]  # [B] segment of each chunk, step-major
    start = step[:, None].expand_as(active)[active] * chunk_size  # [B] chunk start within its segment
    offset = start[:, None] + torch.arange(chunk_size)  # [B, C] position within the segment
    valid = offset < lens[seg][:, None]
    token_index = torch.where(valid, cu[seg][:, None] + offset, num_tokens)
    chunk_of_token = torch.empty(num_tokens, dtype=torch.long)
    chunk_of_token[token_index[valid]] = valid.flatten().nonzero().flatten()
    num_active = active.sum(dim=1).tolist()
    firsts = itertools.accumulate(num_active, initial=0)
    return _ChunkLayout(
        token_index=token_index.to(device),
        chunk_of_token=chunk_of_token.to(device),
        order=order.to(device),
        steps=list(zip(firsts, num_active)),
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: Sequence[int],
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a packed variable-length batch (prefill), chunk by chunk.

    q, k: [T, H, K]; v: [T, HV, V] with HV % H == 0; g: [T, HV] fp32 log-decay (<= 0); beta: [T, HV];
    initial_state: [N, HV, K, V] fp32, the state before each segment; cu_seqlens: [N + 1] long
    (unused here: the reference reads ``cu_seqlens_host``, the same offsets on the host).
    ``scale`` defaults to K ** -0.5. ``chunk_size`` (tokens per chunk) trades work for parallelism;
    results agree across chunk sizes to rounding. Segments may have length 0 (their state passes
    through).

    Returns (o [T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32, a new tensor). Equals
    running the token recurrence (module docstring) on each segment separately.
    """
    num_tokens, _, head_k = q.shape
    _check_heads(q, k, v, g, beta)
    num_seqs = check_cu_seqlens(cu_seqlens_host, num_tokens)
    num_v_heads, head_v = v.shape[1:]
    if initial_state.shape != (num_seqs, num_v_heads, head_k, head_v):
        raise ValueError(
            f"initial_state must be [N, HV, K, V] = {(num_seqs, num_v_heads, head_k, head_v)}, "
            f"got {tuple(initial_state.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if num_tokens == 0:
        return v.new_empty(v.shape), initial_state.float().clone()

    out_dtype = v.dtype
    # When every segment fits in one chunk, shrinking the chunk to the longest segment moves no chunk
    # boundary; it only drops padding (a batch of short suffixes then costs little).
    chunk_size = min(chunk_size, max(b - a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:])))
    layout = _chunk_layout(cu_seqlens_host, chunk_size, q.device)
    q, k = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        """[T, HV, ...] -> fp32 [B, HV, C, ...], padding positions zero."""
        x = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
        return x[layout.token_index].transpose(1, 2).contiguous()

    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))

    # Intra-chunk part, all chunks at once. decay[i, j] = prod of exp(g) over (j, i], zero above the diagonal.
    g_cum = g.cumsum(dim=-1)  # [B, HV, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # UT transform: (I + strict_lower(diag(beta) K K^T * decay))^{-1} applied to [beta V, beta K exp(g_cum)]
    # gives the pseudo-values u and the keys w that read the state entering the chunk.
    solved = torch.linalg.solve_triangular(
        (k_beta @ k.transpose(-1, -2)) * decay,
        torch.cat([v * beta[..., None], k_beta * g_cum.exp()[..., None]], dim=-1),
        upper=False,
        unitriangular=True,
    )
    u, w = solved.split([head_v, head_k], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, HV, C, C], causal, diagonal included
    q_decayed = q * g_cum.exp()[..., None]  # reads the state entering the chunk
    k_decayed = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # writes, decayed to the chunk end
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [B, HV, 1, 1]

    # Inter-chunk scan; `state` rows follow `layout.order`, so step c updates the prefix state[:n].
    state = initial_state.float()[layout.order]
    o = torch.empty_like(u)
    for first, n in layout.steps:
        rows = slice(first, first + n)
        s = state[:n]
        v_new = u[rows] - w[rows] @ s
        o[rows] = q_decayed[rows] @ s + attn[rows] @ v_new
        state[:n] = s * chunk_decay[rows] + k_decayed[rows].transpose(-1, -2) @ v_new

    final_state = torch.empty_like(state)
    final_state[layout.order] = state
    o = o.transpose(1, 2).flatten(0, 1)[layout.chunk_of_token]  # [T, HV, V]
    return o.to(out_dtype), final_state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule for each of N sequences (decode).

    q, k: [N, H, K]; v: [N, HV, V] with HV % H == 0; g: [N, HV] fp32 log-decay (<= 0); beta: [N, HV];
    initial_state: [N, HV, K, V] fp32. ``scale`` defaults to K ** -0.5.
    Returns (o [N, HV, V] in v.dtype, final_state [N, HV, K, V] fp32, a new tensor).
    """
    _check_heads(q, k, v, g, beta)
    if initial_state.shape != (*v.shape[:2], q.shape[2], v.shape[2]):
        raise ValueError(
            f"initial_state must be [N, HV, K, V] = {(*v.shape[:2], q.shape[2], v.shape[2])}, "
            f"got {tuple(initial_state.shape)}"
        )
    q, k = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm)
    state = initial_state.float() * g.float().exp()[..., None, None]
    predicted = (k[..., None, :] @ state).squeeze(-2)  # S^T k: [N, HV, V]
    delta = (v.float() - predicted) * beta.float()[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = (q[..., None, :] @ state).squeeze(-2)
    return o.to(v.dtype), state


def recurrent_gated_delta_rule_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of N sequences whose states live in a pool, updated in place.

    q, k: [N, H, K]; v: [N, HV, V] with HV % H == 0; g: [N, HV] fp32 log-decay (<= 0); beta: [N, HV];
    state_pool: [S, HV, K, V] fp32, rows ``slots`` read and overwritten, every other row untouched;
    slots: [N] long on the pool's device. Precondition (not checked: that would sync the host):
    ``slots`` are distinct, otherwise the rows' final contents are unspecified.
    Returns o [N, HV, V] in v.dtype, written into ``out`` (contiguous [N, HV, V] of v.dtype) when
    given. Same math as ``recurrent_gated_delta_rule`` on ``state_pool[slots]``, followed by the
    write-back.
    """
    _check_heads(q, k, v, g, beta)
    _check_pool(state_pool, slots, v.shape[1], q.shape[2], v.shape[2], v.shape[0])
    _check_out(out, tuple(v.shape), v.dtype)
    o, state = recurrent_gated_delta_rule(
        q, k, v, g, beta, state_pool.index_select(0, slots), scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    state_pool.index_copy_(0, slots, state)
    return o if out is None else out.copy_(o)


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """`out` when it is a contiguous tensor of `shape` and `dtype` (or None); else ValueError."""
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)} (contiguous: {out.is_contiguous()})")
    return out


def _check_pool(state_pool: torch.Tensor, slots: torch.Tensor, num_v_heads: int, head_k: int, head_v: int,
                num_seqs: int) -> None:
    """Shape and dtype checks of ``recurrent_gated_delta_rule_inplace``'s pool (metadata only, no sync)."""
    if state_pool.dim() != 4 or state_pool.shape[1:] != (num_v_heads, head_k, head_v):
        raise ValueError(
            f"state_pool must be [S, HV, K, V] = [S, {num_v_heads}, {head_k}, {head_v}], got {tuple(state_pool.shape)}"
        )
    if state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be float32, got {state_pool.dtype}: the recurrent state is kept in fp32")
    if slots.shape != (num_seqs,) or slots.dtype != torch.long:
        raise ValueError(f"slots must be a LongTensor [N] = [{num_seqs}] (one pool row per sequence), "
                         f"got {slots.dtype} {tuple(slots.shape)}")
