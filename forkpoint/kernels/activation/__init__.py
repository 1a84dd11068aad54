"""SwiGLU activation: ``silu_and_mul(gate, up)``. ``reference.py`` is the spec; the GPU variant,
``triton.py``, has the same signature and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.activation import reference


@functools.wraps(reference.silu_and_mul)
def silu_and_mul(gate, up):
    return select_variant("activation", "triton", gate.is_cuda).silu_and_mul(gate, up)


__all__ = ["silu_and_mul"]
