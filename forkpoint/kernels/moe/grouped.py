"""Routed-expert MLP on CUDA through `torch._grouped_mm` (GPU variant of `reference.py`).

Same signature and semantics as `forkpoint.kernels.moe.reference.fused_moe`. Two grouped GEMMs
for all experts at once (CUTLASS on Hopper), no Python loop over experts and no host sync: the
per-expert row counts stay on the device and reach the GEMM as cumulative offsets.

    routes r = t * k + j (token t, its j-th expert), sorted by expert:
    xs    = x[token of route]                  [T*k, Hd]      rows grouped by expert
    h     = grouped_mm(xs, gate_up^T, offs)    [T*k, 2I]      expert e's rows times gate_up[e]^T
    a     = silu(gate) * up                    [T*k, I]       fp32, then bf16
    ys    = grouped_mm(a, down^T, offs)        [T*k, Hd]
    y[t]  = sum_j w[t, j] * ys[route (t, j)]   fp32, back in token order (no atomics)

bf16 only (what the grouped GEMM takes); other dtypes go to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forkpoint.kernels.moe import reference

if not hasattr(torch, "_grouped_mm"):
    # the dispatch falls back to the reference on ModuleNotFoundError
    raise ModuleNotFoundError("torch._grouped_mm is missing in this torch build: the grouped MoE needs torch >= 2.8")


def fused_moe(x, gate_up, down, topk_weights, topk_ids):
    """x: [T, Hd] bf16; gate_up: [E, 2I, Hd] bf16; down: [E, Hd, I] bf16; topk_weights: [T, k] float;
    topk_ids: [T, k] long in [0, E). Returns y [T, Hd] in x.dtype (summed over experts in fp32).
    Hd and I must be multiples of 8 (16-byte rows for the grouped GEMM)."""
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return reference.fused_moe(x, gate_up, down, topk_weights, topk_ids)
    num_experts, two_inter, hidden = reference.check_shapes(x, gate_up, down, topk_weights, topk_ids)
    if hidden % 8 or (two_inter // 2) % 8:
        raise ValueError(f"hidden size {hidden} and expert size {two_inter // 2} must be multiples of 8 "
                         "for torch._grouped_mm (16-byte rows)")
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)                         # [T*k] routes grouped by expert
    # counts without bincount (its CUDA version reads max() on the host)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)                    # [E] end row of each expert
    xs = x.index_select(0, order // top_k)                        # [T*k, Hd]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = h.float().chunk(2, dim=-1)
    a = (F.silu(gate) * up).to(torch.bfloat16)
    ys = torch._grouped_mm(a, down.transpose(1, 2), offs=offs)     # [T*k, Hd], sorted routes
    y_routes = torch.empty_like(ys).index_copy_(0, order, ys)      # back to route order t * k + j
    y = (y_routes.view(num_tokens, top_k, hidden).float() * topk_weights.float()[..., None]).sum(dim=1)
    return y.to(x.dtype)
