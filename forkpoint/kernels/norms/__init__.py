"""RMSNorms: ``rms_norm`` (zero-centred or plain weight, optional fused residual add),
``gated_rms_norm`` (the GDN output norm) and ``grouped_gated_rms_norm`` (Mamba2's gated norm over
groups of channels). ``reference.py`` is the spec; the GPU variant, ``triton.py``, has the same
signatures and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.norms import reference
from forkpoint.kernels.norms.reference import group_mean_square


@functools.wraps(reference.rms_norm)
def rms_norm(x, *args, **kwargs):
    return select_variant("norms", "triton", x.is_cuda).rms_norm(x, *args, **kwargs)


@functools.wraps(reference.gated_rms_norm)
def gated_rms_norm(x, *args, **kwargs):
    return select_variant("norms", "triton", x.is_cuda).gated_rms_norm(x, *args, **kwargs)


@functools.wraps(reference.grouped_gated_rms_norm)
def grouped_gated_rms_norm(x, *args, **kwargs):
    return select_variant("norms", "triton", x.is_cuda).grouped_gated_rms_norm(x, *args, **kwargs)


__all__ = ["gated_rms_norm", "group_mean_square", "grouped_gated_rms_norm", "rms_norm"]
