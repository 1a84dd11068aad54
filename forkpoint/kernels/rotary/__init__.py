"""Rotary position embedding on the first rotary_dim dims of each head: ``apply_rotary(x, cos, sin)``.
``reference.py`` is the spec; the GPU variant, ``triton.py``, has the same signature and is used for
CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.rotary import reference


@functools.wraps(reference.apply_rotary)
def apply_rotary(x, cos, sin):
    return select_variant("rotary", "triton", x.is_cuda).apply_rotary(x, cos, sin)


__all__ = ["apply_rotary"]
