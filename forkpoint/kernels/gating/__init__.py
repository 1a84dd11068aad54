"""Gated DeltaNet gating: ``gdn_gating(a, b, A_log, dt_bias) -> (g, beta)``. ``reference.py`` is
the spec; the GPU variant, ``triton.py``, has the same signature and is used for CUDA tensors when
it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.gating import reference


@functools.wraps(reference.gdn_gating)
def gdn_gating(a, *args, **kwargs):
    return select_variant("gating", "triton", a.is_cuda).gdn_gating(a, *args, **kwargs)


__all__ = ["gdn_gating"]
