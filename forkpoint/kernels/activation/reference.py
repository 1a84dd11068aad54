"""SwiGLU activation, plain PyTorch: the spec and the CPU path.

    silu_and_mul(gate, up) = (silu(gate) * up) computed in fp32, cast to gate.dtype

One rounding at the end (the grouped MoE's ``h.float().chunk(2)`` path; for fp32 inputs it equals
``F.silu(gate) * up`` bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] of one shape and dtype (strided views allowed, e.g. the halves of
    ``h.chunk(2, dim=-1)``). Returns silu(gate) * up, a new contiguous tensor in gate.dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must share shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
