"""Routed experts: ``fused_moe``. ``reference.py`` is the spec; a GPU variant goes in ``triton.py``
with the same signature and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.moe import reference


@functools.wraps(reference.fused_moe)
def fused_moe(x, *args, **kwargs):
    return select_variant("moe", "triton", x.is_cuda).fused_moe(x, *args, **kwargs)


__all__ = ["fused_moe"]
