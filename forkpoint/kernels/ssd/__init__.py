"""Mamba2 SSD scan: ``chunk_ssd`` (packed varlen prefill, states in and out), ``ssd_step`` (decode,
states in and out) and ``ssd_step_inplace`` (decode on a state pool, rows updated in place), and
``softplus_dt`` (the step sizes from the raw projection). ``reference.py`` is the spec (with
``ssd_recurrence``, the token-by-token form); the GPU variants have the same signatures and are
used for CUDA tensors when they import: ``fla.py`` (fla-core's simple-GLA kernels between our
fused prologue and epilogue) for the prefill, ``triton.py`` (our Triton kernels) for the in-place
step and the step sizes."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.ssd import reference


@functools.wraps(reference.chunk_ssd)
def chunk_ssd(x, *args, **kwargs):
    return select_variant("ssd", "fla", x.is_cuda).chunk_ssd(x, *args, **kwargs)


@functools.wraps(reference.ssd_step)
def ssd_step(x, *args, **kwargs):
    return reference.ssd_step(x, *args, **kwargs)


@functools.wraps(reference.ssd_step_inplace)
def ssd_step_inplace(x, *args, **kwargs):
    return select_variant("ssd", "triton", x.is_cuda).ssd_step_inplace(x, *args, **kwargs)


@functools.wraps(reference.softplus_dt)
def softplus_dt(dt, *args, **kwargs):
    return select_variant("ssd", "triton", dt.is_cuda).softplus_dt(dt, *args, **kwargs)


__all__ = ["chunk_ssd", "softplus_dt", "ssd_step", "ssd_step_inplace"]
