"""Gated activations, plain PyTorch: the spec and the CPU path.

    silu_and_mul(gate, up)    = (silu(gate) * up) computed in fp32, cast to gate.dtype      SwiGLU
    sigmoid_gate_mul(x, gate) = (x * sigmoid(gate)) computed in fp32, cast to x.dtype       attention output gate

One rounding at the end of each (``silu_and_mul``: the grouped MoE's ``h.float().chunk(2)`` path).
For fp32 inputs they equal ``F.silu(gate) * up`` and ``x * torch.sigmoid(gate)`` bit for bit; in
bf16 they differ from those op-by-op forms (which round after the activation too) by an ulp at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] of one shape and dtype (strided views allowed, e.g. the halves of
    ``h.chunk(2, dim=-1)``). Returns silu(gate) * up, a new contiguous tensor in gate.dtype."""
    check_same("gate", gate, "up", up)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ValueError unless a and b share shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"{name_a} and {name_b} must share shape and dtype, got {tuple(a.shape)} {a.dtype} "
            f"and {tuple(b.shape)} {b.dtype}"
        )


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: x * sigmoid(gate) in fp32, cast to x.dtype.

    x, gate: [..., D] of one shape and dtype (strided views allowed, e.g. x the attention core
    [T, HQ, Dh] and gate [T, HQ, Dh] the gate half of the interleaved q/gate projection, row
    strides (width, 2 * Dh)). Returns a new tensor of x's shape in x.dtype (contiguous when x is).
    """
    check_same("x", x, "gate", gate)
    # contiguous: torch's CPU sigmoid rounds differently in its vectorised and scalar loops, so on a
    # strided view its result would depend on the layout (transformers takes it of a contiguous gate)
    return (x.float() * torch.sigmoid(gate.float().contiguous())).to(x.dtype)
