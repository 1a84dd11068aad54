"""Gated activations: ``silu_and_mul(gate, up)`` (SwiGLU) and ``sigmoid_gate_mul(x, gate)`` (the
gated attention's output gate). ``reference.py`` is the spec; the GPU variant, ``triton.py``, has
the same signatures and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.activation import reference


@functools.wraps(reference.silu_and_mul)
def silu_and_mul(gate, up):
    return select_variant("activation", "triton", gate.is_cuda).silu_and_mul(gate, up)


@functools.wraps(reference.sigmoid_gate_mul)
def sigmoid_gate_mul(x, gate):
    return select_variant("activation", "triton", x.is_cuda).sigmoid_gate_mul(x, gate)


__all__ = ["sigmoid_gate_mul", "silu_and_mul"]
