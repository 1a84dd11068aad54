"""The sigmoid router's selection on CUDA, in Triton (GPU variant of `reference.sigmoid_grouped_topk`).

One launch per call for what the reference does in ~12 (sigmoid, bias add, the groups' top-2 sums,
the group top-k, the mask, the expert top-k with its sort, gather, sum, divide, scale). One token
per program: its E logits as a [groups, experts per group] tile in registers, fp32 throughout.

    group score   sum of the group's two largest choices (the largest taken out by index)
    group top-k   TOPK_GROUP rounds of argmax over the group scores (skipped when every group stays)
    expert top-k  K rounds of argmax over the choices of the groups that stay

Every argmax gives a tie to the lowest index, as the reference does; the ids come out in
descending order of choice. No host sync and fixed shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.moe.reference import check_router


@triton.jit
def _sigmoid_grouped_topk_kernel(logits, bias, w_out, ids_out, stride_l, S, scale, K: tl.constexpr,
                                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, BLOCK_G)
    si = tl.arange(0, BLOCK_S)
    e = gi[:, None] * S + si[None, :]  # expert index of each tile element
    valid = (gi < N_GROUP)[:, None] & (si < S)[None, :]
    x = tl.load(logits + t * stride_l + e, mask=valid, other=0.0).to(tl.float32)
    score = tl.sigmoid(x)
    choice = score + tl.load(bias + e, mask=valid, other=0.0).to(tl.float32)
    avail = valid
    if TOPK_GROUP < N_GROUP:
        c = tl.where(valid, choice, float("-inf"))
        m1 = tl.max(c, 1)
        i1 = tl.min(tl.where(c == m1[:, None], si[None, :], BLOCK_S), 1)
        m2 = tl.max(tl.where(si[None, :] == i1[:, None], float("-inf"), c), 1)
        group_score = m1 + m2
        g_avail = gi < N_GROUP
        chosen = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            gs = tl.where(g_avail, group_score, float("-inf"))
            best = tl.max(gs, 0)
            g = tl.min(tl.where(g_avail & (gs == best), gi, BLOCK_G), 0)
            chosen = chosen | (gi == g)
            g_avail = g_avail & (gi != g)
        avail = valid & chosen[:, None]
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        c = tl.where(avail, choice, float("-inf"))
        best = tl.max(tl.max(c, 1), 0)
        index = tl.min(tl.min(tl.where(avail & (c == best), e, BLOCK_G * BLOCK_S), 1), 0)
        index = tl.minimum(index, N_GROUP * S - 1)  # in range even for NaN rows
        w_j = tl.sum(tl.sum(tl.where(valid & (e == index), score, 0.0), 1), 0)  # padding aliases e
        top_w = tl.where(slots == j, w_j, top_w)
        top_i = tl.where(slots == j, index, top_i)
        avail = avail & (e != index)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(tl.where(slots < K, top_w, 0.0), 0) + 1e-20)
    top_w = top_w * scale
    tl.store(w_out + t * K + slots, top_w, mask=slots < K)
    tl.store(ids_out + t * K + slots, top_i.to(tl.int64), mask=slots < K)


def sigmoid_grouped_topk(logits, correction_bias, top_k, n_group, topk_group, renormalize, scale):
    """Same result as `reference.sigmoid_grouped_topk` (the same ids as a set, ties to the lowest
    index; the weights up to fp32 evaluation order), one launch. logits: [T, E] (fp32, the router
    GEMM's output); correction_bias: [E]. Returns (weights [T, k] fp32, ids [T, k] long)."""
    check_router(logits, correction_bias, top_k, n_group, topk_group)
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.long, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    group_size = num_experts // n_group
    block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    _sigmoid_grouped_topk_kernel[(num_tokens,)](
        logits, correction_bias.contiguous(), weights, ids, logits.stride(0), group_size, float(scale), K=top_k,
        N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize),
        num_warps=4 if block_g * block_s <= 1024 else 8)
    return weights, ids
