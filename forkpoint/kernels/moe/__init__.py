"""Routed experts: ``fused_moe``. ``reference.py`` is the spec; the GPU variant, ``grouped.py``
(grouped GEMMs), has the same signature and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.moe import reference


@functools.wraps(reference.fused_moe)
def fused_moe(x, *args, **kwargs):
    return select_variant("moe", "grouped", x.is_cuda).fused_moe(x, *args, **kwargs)


__all__ = ["fused_moe"]
