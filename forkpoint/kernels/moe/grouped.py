"""Routed-expert MLP on CUDA through `torch._grouped_mm` and Triton (GPU variant of `reference.py`).

Same signatures and semantics as `forkpoint.kernels.moe.reference`. The router's selection
(`topk_softmax`: softmax, top-k, renormalisation, cast) is one Triton kernel. The experts run for
all experts at once, no Python loop over experts and no host sync: the per-expert row counts stay
on the device. Steps with up to 64 routes per expert (`tiled.TILES`) run them as two Triton tile
kernels (`tiled.py`: gather and activation fused, each hit expert's weights read once); larger
steps as two grouped GEMMs (CUTLASS on Hopper), faster once every expert has many rows
(bench/moe_kernel.py), which take the counts as cumulative offsets:

    routes r = t * k + j (token t, its j-th expert), sorted by expert (order[p] = route at row p):
    order, pos, offs, hit experts                             one Triton launch up to 16,384 routes
    ys    = tiled.expert_mlp(x, ...)           [T*k, Hd]      up to 64 routes per expert, else:
    xs    = x[token of route]                  [T*k, Hd]      rows grouped by expert
    h     = grouped_mm(xs, gate_up^T, offs)    [T*k, 2I]      expert e's rows times gate_up[e]^T
    a     = silu(gate) * up                    [T*k, I]       fp32 math, bf16 out (silu_and_mul)
    ys    = grouped_mm(a, down^T, offs)        [T*k, Hd]
    pos   = inverse of order                   [T*k]          route r sits at row pos[r] of ys
    y[t]  = sum_j w[t, j] * ys[pos[t*k + j]]   fp32, one Triton kernel (gather, no atomics)

`fused_moe_relu2` (Nemotron's non-gated experts) is the same pipeline with one first GEMM into
[T*k, I] and relu(h)^2 in place (relu is exact in bf16, so squaring the bf16 value rounds once, as
the fp32 math rounded once would).

bf16 only (what the grouped GEMM takes); other dtypes go to the reference. Imports Triton at its
top: without Triton the dispatch falls back to the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from forkpoint.kernels.activation import silu_and_mul
from forkpoint.kernels.moe import reference, tiled

if not hasattr(torch, "_grouped_mm"):
    # the dispatch falls back to the reference on ModuleNotFoundError
    raise ModuleNotFoundError("torch._grouped_mm is missing in this torch build: the grouped MoE needs torch >= 2.8")


@triton.jit
def _topk_softmax_kernel(logits, w_out, ids_out, E, stride_l, K: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token per program: softmax over its E logits (fp32), K rounds of argmax (the lowest
    index wins a tie), the K probabilities divided by their sum when RENORMALIZE."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits + t * stride_l + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(cols < E, p, -1.0)                  # probabilities are >= 0: -1 marks "not available"
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, 0)
        index = tl.minimum(tl.min(tl.where(p == best, cols, BLOCK_E), 0), E - 1)  # in range even for NaN rows
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, index, top_i)
        p = tl.where(cols == index, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots < K, top_w, 0.0), 0)
    tl.store(w_out + t * K + slots, top_w.to(w_out.dtype.element_ty), mask=slots < K)
    tl.store(ids_out + t * K + slots, top_i.to(tl.int64), mask=slots < K)


def topk_softmax(logits, top_k, renormalize, out_dtype):
    """Same result as `reference.topk_softmax` (up to fp32 evaluation order, and ties: equal
    probabilities go to the lowest expert index), one launch. logits: [T, E] (last dim contiguous)."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"logits must be [T, E] with 0 < top_k <= E, got {tuple(logits.shape)} and top_k={top_k}")
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.long, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    _topk_softmax_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), K=top_k, BLOCK_E=block_e,
                                        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize),
                                        num_warps=4 if block_e <= 1024 else 8)
    return weights, ids


@triton.jit
def _combine_kernel(ys, pos, w, y, shared, gate, residual, Hd, stride_w, stride_s, stride_g, stride_r,
                    K: tl.constexpr, BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < Hd
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos + t * K + j).to(tl.int64)
        w_j = tl.load(w + t * stride_w + j).to(tl.float32)
        acc += w_j * tl.load(ys + row * Hd + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        g = tl.load(gate + t * stride_g).to(tl.float32)
        acc += tl.sigmoid(g) * tl.load(shared + t * stride_s + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual + t * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + t * Hd + cols, acc.to(y.dtype.element_ty), mask=m)


# Routes sorted by one program (`_route_sort_kernel`, a bitonic sort: its time grows as R log^2 R on one
# SM) up to MAX_ONE_PROGRAM_ROUTES; by one program per expert (`_route_rank_kernel`: each counts and
# ranks its own routes, so its time grows as R) up to MAX_RANK_ROUTES; above, torch's stable sort and
# searchsorted. H200, E = 256, GPU us per sort (bench/route_sort.py, bench/results/route_sort_h200.json):
# one program / rank / torch at 512 routes 4.8 / 5.5 / 41.9, at 2,424 (a 303-token step) 84.4 / 13.4 /
# 51.5, at 16,384 - / 61.2 / 97.1, at 32,768 - / 120.2 / 84.4.
MAX_ONE_PROGRAM_ROUTES = 512
MAX_RANK_ROUTES = 16384
RANK_BLOCK_ROUTES = 1024  # routes a rank program reads at a time


@triton.jit
def _route_sort_kernel(ids, pos, tokens, offs, active, num_active, R, E, K: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """One program: the R routes (expert ids[r] of route r = t * K + j) sorted by expert, ties in
    route order (a stable sort); with route = the route at row p: pos[route] = p, tokens[p] =
    route // K, offs[e] = routes with an expert <= e (int32), for e < E; the experts with routes
    in active[0 .. num_active) (ascending), the rest of `active` unwritten. Padding lanes carry
    expert E, which sorts last and falls in a histogram bin that is not stored (BLOCK_E > E)."""
    lanes = tl.arange(0, BLOCK_R)
    live = lanes < R
    expert = tl.load(ids + lanes, mask=live, other=E).to(tl.int32)
    ranked = tl.sort(expert * BLOCK_R + lanes)  # unique keys: expert-major, then route
    route = ranked % BLOCK_R
    tl.store(tokens + lanes, (route // K).to(tl.int64), mask=live)
    tl.store(pos + route, lanes.to(tl.int64), mask=live)
    bins = tl.arange(0, BLOCK_E)
    counts = tl.histogram(expert, BLOCK_E)
    tl.store(offs + bins, tl.cumsum(counts, 0).to(tl.int32), mask=bins < E)
    hit = (counts > 0) & (bins < E)
    tl.store(active + tl.cumsum(hit.to(tl.int32), 0) - 1, bins, mask=hit)
    tl.store(num_active, tl.sum(hit.to(tl.int32), 0))


@triton.jit
def _route_rank_kernel(ids, pos, tokens, offs, active, num_active, R, E, K: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """Program e of a grid of E: the outputs of `_route_sort_kernel` for expert e. It counts every
    expert's routes (a histogram of all R ids, BLOCK_R at a time: the rows before expert e's are those
    of the experts below it), stores offs[e], lists e in `active` at its rank among the hit experts when
    it has routes (program 0 stores num_active), and places its own routes at consecutive rows in
    route order (a running cumulative sum of `ids == e`): a stable sort in R * E / BLOCK_R block
    steps spread over E programs instead of one program's R log^2 R."""
    e = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in tl.range(0, R, BLOCK_R):
        lanes = start + tl.arange(0, BLOCK_R)
        counts += tl.histogram(tl.load(ids + lanes, mask=lanes < R, other=E).to(tl.int32), BLOCK_E)
    own = tl.sum(tl.where(bins == e, counts, 0), 0)
    row = tl.sum(tl.where(bins < e, counts, 0), 0)  # the first row of expert e's routes
    tl.store(offs + e, (row + own).to(tl.int32))
    hit = ((counts > 0) & (bins < E)).to(tl.int32)
    if own > 0:
        tl.store(active + tl.sum(tl.where(bins < e, hit, 0), 0), e)
    if e == 0:
        tl.store(num_active, tl.sum(hit, 0))
    for start in tl.range(0, R, BLOCK_R):
        lanes = start + tl.arange(0, BLOCK_R)
        live = lanes < R
        mine = (tl.load(ids + lanes, mask=live, other=E).to(tl.int32) == e) & live
        at = row + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(tokens + at, (lanes // K).to(tl.int64), mask=mine)
        tl.store(pos + lanes, at.to(tl.int64), mask=mine)
        row += tl.sum(mine.to(tl.int32), 0)


def _rows(tensor: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor | None:
    """`tensor` with contiguous rows of `shape` (None stays None); ValueError on another shape."""
    if tensor is None:
        return None
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def moe_combine(ys: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, *,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """ys: [T*k, Hd] expert outputs in sorted-route order (row p holds route order[p]);
    order: [T*k] long, a permutation of the routes t * k + j; topk_weights: [T, k] float.
    Returns y [T, Hd] in ys.dtype with y[t] = sum_j w[t, j] * ys[row of route (t, j)], in fp32,
    plus sigmoid(shared_gate[t]) * shared[t] (shared [T, Hd], shared_gate [T, 1]) and residual[t]
    [T, Hd] when given, still in fp32: one rounding at the end."""
    num_tokens, top_k = topk_weights.shape
    hidden = ys.shape[1]
    if ys.shape[0] != num_tokens * top_k or order.shape != (num_tokens * top_k,):
        raise ValueError(f"ys [T*k, Hd] and order [T*k] must match topk_weights [T, k] = {tuple(topk_weights.shape)}; "
                         f"got ys {tuple(ys.shape)} and order {tuple(order.shape)}")
    shared, shared_gate, residual = _extras(num_tokens, hidden, shared, shared_gate, residual)
    if num_tokens * hidden == 0:
        return torch.empty((num_tokens, hidden), dtype=ys.dtype, device=ys.device)
    routes = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    pos = torch.empty_like(order).scatter_(0, order, routes)  # inverse permutation, no host sync
    return _combine(ys, pos, topk_weights, shared, shared_gate, residual)


def _extras(num_tokens: int, hidden: int, shared, shared_gate, residual) -> tuple:
    """The combine's optional inputs with contiguous rows, checked: shared [T, Hd] and shared_gate
    [T, 1] come together, residual [T, Hd]."""
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared and shared_gate come together (the shared expert's output and its gate logit)")
    return (_rows(shared, (num_tokens, hidden), "shared"), _rows(shared_gate, (num_tokens, 1), "shared_gate"),
            _rows(residual, (num_tokens, hidden), "residual"))


def _combine(ys, pos, topk_weights, shared, shared_gate, residual):
    """`moe_combine` with the inverse permutation given (pos [T*k]: route r's row of ys) and the
    optional inputs already checked."""
    num_tokens, top_k = topk_weights.shape
    hidden = ys.shape[1]
    y = torch.empty((num_tokens, hidden), dtype=ys.dtype, device=ys.device)
    if y.numel() == 0:
        return y
    ys = ys.contiguous()
    if topk_weights.stride(-1) != 1:
        topk_weights = topk_weights.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block))
    _combine_kernel[grid](ys, pos, topk_weights, y, ys if shared is None else shared,
                          ys if shared_gate is None else shared_gate, ys if residual is None else residual,
                          hidden, topk_weights.stride(0), 0 if shared is None else shared.stride(0),
                          0 if shared_gate is None else shared_gate.stride(0),
                          0 if residual is None else residual.stride(0), K=top_k, BLOCK=block,
                          HAS_SHARED=shared is not None, HAS_RESIDUAL=residual is not None, num_warps=4)
    return y


class SortedRoutes(NamedTuple):
    """The T*k routes (r = t * k + j: token t's j-th expert) grouped by expert, ties in route order."""

    pos: torch.Tensor  # [T*k] long: the row of route r in the grouped order (inverse of the sort)
    tokens: torch.Tensor  # [T*k] long: the token of the route at row p
    rows: tiled.ExpertRows  # each expert's rows (rows.offs is what torch._grouped_mm takes)


def _sorted_routes(topk_ids, num_experts) -> SortedRoutes:
    """Sorts the routes of topk_ids [T, k] by expert on the device, no host sync: one Triton
    program up to MAX_ONE_PROGRAM_ROUTES routes (small decode steps), one Triton program per expert up
    to MAX_RANK_ROUTES, else torch's stable sort and searchsorted (the end row of expert e = routes with
    an id <= e; no bincount, whose CUDA version syncs), where `rows.active` lists every expert. All
    three give the same order and offsets; the Triton ones list only the hit experts."""
    num_routes, top_k = topk_ids.numel(), topk_ids.shape[1]
    device = topk_ids.device
    if num_routes <= MAX_RANK_ROUTES:
        pos = torch.empty(num_routes, dtype=torch.long, device=device)
        tokens = torch.empty_like(pos)
        offs = torch.empty(num_experts, dtype=torch.int32, device=device)
        active = torch.empty_like(offs)
        num_active = torch.empty(1, dtype=torch.int32, device=device)
        args = (topk_ids.contiguous(), pos, tokens, offs, active, num_active, num_routes, num_experts)
        bins = triton.next_power_of_2(num_experts + 1)
        if num_routes <= MAX_ONE_PROGRAM_ROUTES:
            _route_sort_kernel[(1,)](*args, K=top_k, BLOCK_R=triton.next_power_of_2(num_routes), BLOCK_E=bins,
                                     num_warps=4 if num_routes <= 1024 else 8)
        else:
            _route_rank_kernel[(num_experts,)](*args, K=top_k, BLOCK_R=RANK_BLOCK_ROUTES, BLOCK_E=bins, num_warps=4)
        return SortedRoutes(pos, tokens, tiled.ExpertRows(offs, active, num_active, min(num_experts, num_routes)))
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    experts = torch.arange(num_experts, dtype=sorted_ids.dtype, device=device)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    routes = torch.arange(num_routes, dtype=order.dtype, device=device)
    pos = torch.empty_like(order).scatter_(0, order, routes)
    # every expert gets a program (the empty ones run no rows): no compaction launches on these steps
    every = tiled.ExpertRows(offs, experts.to(torch.int32), torch.full((1,), num_experts, dtype=torch.int32,
                                                                        device=device), num_experts)
    return SortedRoutes(pos, order // top_k, every)


def _expert_outputs(x, w1, w2, routes: SortedRoutes, *, gated: bool) -> torch.Tensor:
    """ys [T*k, Hd] in sorted-route order: ys[p] = w2[e] @ act(w1[e] @ x[routes.tokens[p]]) for
    the route at row p (expert e), act = SwiGLU (`gated`, w1 [E, 2I, Hd]) or relu^2 (w1 [E, I, Hd]).
    Triton tiles while `tiled.TILES` covers the step's routes per expert, else two grouped GEMMs."""
    num_routes, num_experts = routes.tokens.shape[0], w1.shape[0]
    if tiled.covers(num_routes, num_experts, tiled.TILES):
        return tiled.expert_mlp(x, w1, w2, routes.tokens, routes.rows, gated=gated, table=tiled.TILES)
    return _grouped_mm_outputs(x, w1, w2, routes, gated=gated)


def _grouped_mm_outputs(x, w1, w2, routes: SortedRoutes, *, gated: bool) -> torch.Tensor:
    """`_expert_outputs` through torch._grouped_mm: the gather, two grouped GEMMs, the activation."""
    xs = x.index_select(0, routes.tokens)
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=routes.rows.offs)  # [T*k, 2I] or [T*k, I]
    a = silu_and_mul(*h.chunk(2, dim=-1)) if gated else h.relu_().square_()
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=routes.rows.offs)


def _check_grouped_sizes(hidden: int, inter: int) -> None:
    if hidden % 8 or inter % 8:
        raise ValueError(f"hidden size {hidden} and expert size {inter} must be multiples of 8 "
                         "for torch._grouped_mm (16-byte rows)")


def fused_moe(x, gate_up, down, topk_weights, topk_ids, *, shared=None, shared_gate=None, residual=None):
    """x: [T, Hd] bf16; gate_up: [E, 2I, Hd] bf16; down: [E, Hd, I] bf16; topk_weights: [T, k] float;
    topk_ids: [T, k] long in [0, E). Returns y [T, Hd] in x.dtype (summed over experts in fp32), plus
    the shared expert's sigmoid-gated output and the residual when given (reference.fused_moe),
    added in the combine's fp32 sum. Hd and I must be multiples of 8 (16-byte rows for the
    grouped GEMM)."""
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return reference.fused_moe(x, gate_up, down, topk_weights, topk_ids, shared=shared, shared_gate=shared_gate,
                                   residual=residual)
    num_experts, two_inter, hidden = reference.check_shapes(x, gate_up, down, topk_weights, topk_ids)
    _check_grouped_sizes(hidden, two_inter // 2)
    if topk_ids.shape[0] == 0:
        return x.new_zeros(x.shape)  # shared and residual have no rows either
    routes = _sorted_routes(topk_ids, num_experts)
    ys = _expert_outputs(x, gate_up, down, routes, gated=True)
    extras = _extras(x.shape[0], hidden, shared, shared_gate, residual)
    return _combine(ys, routes.pos, topk_weights, *extras).to(x.dtype)


def fused_moe_relu2(x, up, down, topk_weights, topk_ids, *, residual=None):
    """x: [T, Hd] bf16; up: [E, I, Hd] bf16; down: [E, Hd, I] bf16; topk_weights: [T, k] float;
    topk_ids: [T, k] long in [0, E). Returns sum_j w_j down[e_j] relu(up[e_j] x)^2 [T, Hd] in x.dtype
    (summed in fp32), plus `residual` [T, Hd] in the same fp32 sum (reference.fused_moe_relu2).
    Hd and I must be multiples of 8. No host sync (capturable in a CUDA graph)."""
    if not (x.dtype == up.dtype == down.dtype == torch.bfloat16):
        return reference.fused_moe_relu2(x, up, down, topk_weights, topk_ids, residual=residual)
    num_experts, inter, hidden = reference.check_shapes(x, up, down, topk_weights, topk_ids, gated=False)
    _check_grouped_sizes(hidden, inter)
    if topk_ids.shape[0] == 0:
        return x.new_zeros(x.shape)
    routes = _sorted_routes(topk_ids, num_experts)
    ys = _expert_outputs(x, up, down, routes, gated=False)
    return _combine(ys, routes.pos, topk_weights, *_extras(x.shape[0], hidden, None, None, residual)).to(x.dtype)
