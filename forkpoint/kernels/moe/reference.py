"""Routed experts and their routers' selection, plain PyTorch: the spec and the CPU path.

Routers: ``topk_softmax`` (Qwen's softmax top-k) and ``sigmoid_grouped_topk`` (Nemotron-3's
sigmoid scores with a correction bias and expert groups).

SwiGLU experts (``fused_moe``) use transformers' ``Qwen3NextExperts`` layout: ``gate_up[e]`` is
``[gate; up]`` stacked along rows, ``down[e]`` maps back to the hidden size. For token t with
routes (e_j, w_j):

    y_t = sum_j w_j * down[e_j] @ (silu(gate[e_j] @ x_t) * (up[e_j] @ x_t))

Non-gated ReLU^2 experts (``fused_moe_relu2``, Nemotron-H / Nemotron-3: ``up[e]`` [I, Hd],
``down[e]`` [Hd, I]):

    y_t = sum_j w_j * down[e_j] @ relu(up[e_j] @ x_t)^2
"""

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax router's selection: logits [T, E] -> (weights [T, k] in out_dtype, ids [T, k] long).

    Softmax over the E experts in fp32, the k largest probabilities (descending), divided by their
    sum when `renormalize`, then cast to out_dtype."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"logits must be [T, E] with 0 < top_k <= E, got {tuple(logits.shape)} and top_k={top_k}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(out_dtype), top_ids


def check_router(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                 topk_group: int) -> None:
    """Raise ValueError unless logits [T, E] and correction_bias [E] fit a grouped router: E in
    n_group equal groups of at least 2 experts, 1 <= topk_group <= n_group, and
    1 <= top_k <= the experts of topk_group groups. Shapes only: no device work, no host sync."""
    if logits.dim() != 2 or correction_bias.shape != logits.shape[1:]:
        raise ValueError(f"logits must be [T, E] and correction_bias [E], got {tuple(logits.shape)} and "
                         f"{tuple(correction_bias.shape)}")
    num_experts = logits.shape[1]
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group={n_group} must split the {num_experts} experts into equal groups of >= 2")
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"need 1 <= topk_group <= n_group and 1 <= top_k <= topk_group * E / n_group; got "
                         f"topk_group={topk_group}, n_group={n_group}, top_k={top_k}, E={num_experts}")


def _top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """values: [T, n] -> the indices [T, k] of each row's k largest values; a tie at the cut goes
    to the lower index. Rows without such a tie keep torch.topk(sorted=False)'s order (the order
    in which transformers sums the routing weights: the same fp32 sum, bit for bit); rows with one
    list their values in descending order, equal values by index (as the GPU kernel does)."""
    ids = torch.topk(values, k, dim=-1, sorted=False)[1]
    if k == values.shape[1]:
        return ids
    ranked, order = torch.sort(values, dim=-1, descending=True, stable=True)
    tied = ranked[:, k - 1] == ranked[:, k]
    return torch.where(tied[:, None], order[:, :k], ids)


def sigmoid_grouped_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router's selection (Nemotron-3, DeepSeek-V3 style): logits [T, E] fp32 ->
    (weights [T, k] fp32, ids [T, k] long).

    scores = sigmoid(logits); choice = scores + correction_bias. The E experts form n_group
    groups of E / n_group; a group's score is the sum of its two largest choices; the topk_group
    best groups stay, and the top_k largest choices among their experts are the ids. The weights
    are the chosen experts' scores (not choices), divided by (their sum + 1e-20) when
    `renormalize`, times `scale`. Ties (equal group scores or choices at a cut) go to the lowest
    index, here and in the GPU kernel; the ids' order within a row is unspecified."""
    check_router(logits, correction_bias, top_k, n_group, topk_group)
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    num_experts = choice.shape[-1]
    grouped = choice.view(-1, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
    ids = _top_ids(choice.masked_fill(~expert_mask, float("-inf")), top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def check_shapes(x, gate_up, down, topk_weights, topk_ids, *, gated: bool = True) -> tuple[int, int, int]:
    """Raise ValueError unless x [T, Hd], gate_up [E, 2I, Hd] (`gated`; else up [E, I, Hd]), down
    [E, Hd, I] and topk_weights, topk_ids [T, k] fit together; returns (E, rows of gate_up / up, Hd).
    Shapes only: no device work, no host sync."""
    num_experts, rows, hidden = gate_up.shape
    inter = rows // 2 if gated else rows
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, inter):
        first = "gate_up [E, 2I, Hd]" if gated else "up [E, I, Hd]"
        raise ValueError(
            f"expected x [T, Hd], {first}, down [E, Hd, I]; got {tuple(x.shape)}, "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k] with T = {x.shape[0]}, "
            f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    return num_experts, rows, hidden


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply each token's top-k experts and sum them with the routing weights.

    x: [T, Hd]; gate_up: [E, 2I, Hd]; down: [E, Hd, I]; topk_weights: [T, k] (float);
    topk_ids: [T, k] long, in [0, E). Returns y [T, Hd] in x.dtype (computed and summed in fp32).
    Routes are sorted by expert, and each expert that was hit runs once on all its tokens.

    With `shared` [T, Hd] and `shared_gate` [T, 1] (a shared expert's output and gate logit) and/or
    `residual` [T, Hd], all in x.dtype, returns `residual + (y + sigmoid(shared_gate) * shared)`,
    each op rounded to x.dtype as written (the GPU variant fuses them into its combine: one
    rounding).
    """
    out = _routed(x, gate_up, down, topk_weights, topk_ids, _swiglu, gated=True)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate) * shared
    return out if residual is None else residual + out


def fused_moe_relu2(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Non-gated ReLU^2 experts (Nemotron-H's): y_t = sum_j w_j down[e_j] relu(up[e_j] x_t)^2.

    x: [T, Hd]; up: [E, I, Hd]; down: [E, Hd, I]; topk_weights: [T, k] (float); topk_ids: [T, k]
    long in [0, E). Returns y [T, Hd] in x.dtype (computed and summed in fp32), plus `residual`
    [T, Hd] (x.dtype, added after the rounding; the GPU variant adds it in its fp32 sum) when given."""
    out = _routed(x, up, down, topk_weights, topk_ids, _relu2, gated=False)
    return out if residual is None else residual + out


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _relu2(h: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(h))


def routed_sum(x: torch.Tensor, num_experts: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts' weighted sum in fp32, rounded to x.dtype: y_t = sum_j w_j expert(e_j, x_t).
    x: [T, Hd]; topk_weights, topk_ids: [T, k]; expert(e, rows): rows [n, Hd] fp32 -> [n, Hd] fp32, called
    once per expert that was hit, on its tokens in route order. Raises ValueError for an id outside
    [0, num_experts)."""
    flat_ids = topk_ids.flatten()
    counts = torch.bincount(flat_ids, minlength=num_experts)
    if counts.numel() > num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got {int(flat_ids.max())}")
    order = flat_ids.argsort(stable=True)  # routes grouped by expert
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order].float()
    counts_host = counts.tolist()
    starts = list(itertools.accumulate(counts_host, initial=0))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in counts.nonzero().flatten().tolist():
        routes = slice(starts[e], starts[e] + counts_host[e])
        tok = tokens[routes]
        out.index_add_(0, tok, expert(e, x[tok].float()) * weights[routes, None])
    return out.to(x.dtype)


def _routed(x, w1, down, topk_weights, topk_ids, activation, *, gated: bool) -> torch.Tensor:
    """The routed experts' sum: y_t = sum_j w_j down[e_j] @ activation(w1[e_j] @ x_t), in fp32."""
    num_experts, _, _ = check_shapes(x, w1, down, topk_weights, topk_ids, gated=gated)
    return routed_sum(x, num_experts, topk_weights, topk_ids,
                      lambda e, rows: activation(rows @ w1[e].float().T) @ down[e].float().T)
