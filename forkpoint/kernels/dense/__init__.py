"""Dense projection ``linear(x, weight, bias=None, out=None)`` = F.linear for x [M, K] and weight
[N, K]. ``reference.py`` is the spec; the GPU variant, ``triton.py`` (a kernel for decode-sized M,
F.linear past its table), has the same signature and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.dense import reference


@functools.wraps(reference.linear)
def linear(x, weight, bias=None, out=None):
    return select_variant("dense", "triton", x.is_cuda).linear(x, weight, bias, out)


__all__ = ["linear"]
