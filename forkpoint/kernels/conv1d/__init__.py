"""Short causal depthwise conv: ``causal_conv1d_varlen`` (packed prefill), ``causal_conv1d_step``
(decode) and ``causal_conv1d_step_inplace`` (decode on a pool's rows). ``reference.py`` is the spec;
the GPU variant, ``triton.py``, has the same signatures and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.conv1d import reference


def _impl(x):
    return select_variant("conv1d", "triton", x.is_cuda)


@functools.wraps(reference.causal_conv1d_varlen)
def causal_conv1d_varlen(x, *args, **kwargs):
    return _impl(x).causal_conv1d_varlen(x, *args, **kwargs)


@functools.wraps(reference.causal_conv1d_step)
def causal_conv1d_step(x, *args, **kwargs):
    return _impl(x).causal_conv1d_step(x, *args, **kwargs)


@functools.wraps(reference.causal_conv1d_step_inplace)
def causal_conv1d_step_inplace(x, *args, **kwargs):
    return _impl(x).causal_conv1d_step_inplace(x, *args, **kwargs)


__all__ = ["causal_conv1d_step", "causal_conv1d_step_inplace", "causal_conv1d_varlen"]
