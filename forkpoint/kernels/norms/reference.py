"""RMSNorms of Qwen3.5, plain PyTorch: the spec and the CPU path.

Both normalise over the last dim in float32: ``n = x / sqrt(mean(x^2) + eps)``.

    rms_norm        y = n * (1 + w)                          zero-centred weight (Qwen3.5 / Qwen3-Next)
    gated_rms_norm  y = (w * n.to(dtype)) * silu(gate)        GDN output norm (weight not centred)

The rounding steps below are part of the spec: the Triton variant reproduces them (same casts at the
same points), so the two differ only by fp32 evaluation order.
"""

from __future__ import annotations

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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)`` over the last dim, computed in fp32.

    x: [..., D] (any leading dims, e.g. [T, hidden] or q/k heads [T, heads, Dh]); weight: [D].
    Returns y (x's shape, x.dtype, a new contiguous tensor).

    With ``residual`` (same shape and dtype as x): the pre-norm residual add is fused in,
    ``s = residual + x`` (rounded to x.dtype, as the unfused ``hidden = residual + hidden``), and
    the result is the pair ``(rms_norm(s), s)``; ``s`` is the next residual.
    """
    check_shapes(x, weight, residual=residual)
    if residual is not None:
        s = residual + x
        return rms_norm(s, weight, eps), s
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).type_as(x)


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
