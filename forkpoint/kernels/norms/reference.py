"""RMSNorms, plain PyTorch: the spec and the CPU path.

All normalise in float32: ``n = x / sqrt(mean(x^2) + eps)``, over the last dim or (grouped) over
each group of it.

    rms_norm                y = n * (1 + w)                    zero-centred weight (Qwen3.5 / Qwen3-Next)
    rms_norm(centred=False) y = n * w                          the Mamba2 hybrids' block norms
    gated_rms_norm          y = (w * n.to(dtype)) * silu(gate) GDN output norm (weight not centred)
    grouped_gated_rms_norm  y = w * n_g(x * silu(z))           Mamba2's gated norm over groups of I
                         or y = w * n_g(x) * silu(z)           (norm_before_gate), all in fp32

The rounding steps below are part of the spec: the Triton variant reproduces them (same casts at the
same points), so the two differ only by fp32 evaluation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def check_shapes(
    x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None
) -> None:
    """Raise ValueError unless weight is [D] for x [..., D], residual (if given) matches x in shape
    and dtype, and gate (if given) has x's shape. Shapes only: no device work."""
    if weight.dim() != 1 or x.dim() < 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be [D] with D = x.shape[-1]; got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x: x {tuple(x.shape)} {x.dtype}, "
            f"residual {tuple(residual.shape)} {residual.dtype}"
        )
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    centred: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, computed in fp32: zero-centred ``x / rms(x) * (1 + w)`` (Qwen), or
    ``x / rms(x) * w`` with ``centred=False`` (the Mamba2 hybrids' PlainRMSNorm); one rounding, at
    the end.

    x: [..., D] (any leading dims, e.g. [T, hidden] or q/k heads [T, heads, Dh]); weight: [D].
    Returns y (x's shape, x.dtype, a new contiguous tensor).

    With ``residual`` (same shape and dtype as x): the pre-norm residual add is fused in,
    ``s = residual + x`` (rounded to x.dtype, as the unfused ``hidden = residual + hidden``), and
    the result is the pair ``(rms_norm(s), s)``; ``s`` is the next residual.
    """
    check_shapes(x, weight, residual=residual)
    if residual is not None:
        s = residual + x
        return rms_norm(s, weight, eps, centred=centred), s
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * ((1.0 + weight.float()) if centred else weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output: ``(w * norm(x).to(dtype)) * silu(gate.float())``, cast to x.dtype.

    x, gate: [..., D] of the same shape (e.g. [T, HV, V]); weight: [D] (not centred). Returns a new
    tensor of x's shape in x.dtype. ``w * norm(x)`` is a product in the promoted dtype of w and x
    (bf16 for a bf16 model), as transformers' ``Qwen3NextRMSNormGated``.
    """
    check_shapes(x, weight, gate=gate)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(dtype)
    out = out * F.silu(gate.float())
    return out.to(dtype)


def group_mean_square(grouped: torch.Tensor) -> torch.Tensor:
    """grouped: [T, G, I / G] fp32 -> the mean of squares of each group, [T, G, 1] fp32."""
    return grouped.pow(2).mean(-1, keepdim=True)


def check_grouped_shapes(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    """Raise ValueError unless x and gate are [T, I] of one shape, weight is [I] and `groups`
    divides I. Shapes only: no device work."""
    if x.dim() != 2 or gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"expected x and gate [T, I] and weight [I]; got x {tuple(x.shape)}, "
                         f"gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    if groups < 1 or x.shape[1] % groups:
        raise ValueError(f"groups must divide the {x.shape[1]} channels, got {groups}")


def grouped_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
    norm_before_gate: bool = False, *, mean_square: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mamba2's gated RMSNorm over `groups` equal groups of the I channels, all in fp32, one
    rounding at the end: ``w * norm_g(x * silu(z))``, or ``w * norm_g(x) * silu(z)`` when
    `norm_before_gate` (Falcon-H1's option); the weight is not centred.

    x, gate: [T, I] (rows may be strided, the last dim contiguous or not); weight: [I] (any float
    dtype). Returns a new [T, I] tensor in x.dtype.

    `mean_square` ([T, G, I / G] fp32 -> [T, G, 1]) replaces `group_mean_square`: a tensor-parallel
    rank that holds part of a norm group all-reduces the group's sum of squares there
    (distributed/parallel_layers.py); the GPU variant runs this reference when it is given.
    """
    check_grouped_shapes(x, gate, weight, groups)
    reduce = group_mean_square if mean_square is None else mean_square
    h = x.float()
    silu_gate = F.silu(gate.float())
    if not norm_before_gate:
        h = h * silu_gate
    grouped = h.reshape(h.shape[0], groups, h.shape[1] // groups)
    h = (grouped * torch.rsqrt(reduce(grouped) + eps)).view(h.shape)
    h = h * weight.float()
    if norm_before_gate:
        h = h * silu_gate
    return h.to(x.dtype)
