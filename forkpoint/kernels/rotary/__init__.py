"""Rotary position embedding on the first rotary_dim dims of each head: ``apply_rotary(x, cos, sin)``,
and Qwen3.5's attention prologue fused with it, ``qk_norm_rotary_(q, k, q_weight, k_weight, eps,
cos, sin)`` (q/k RMSNorm then rotary, in place). ``reference.py`` is the spec; the GPU variant,
``triton.py``, has the same signatures and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.rotary import reference


@functools.wraps(reference.apply_rotary)
def apply_rotary(x, cos, sin):
    return select_variant("rotary", "triton", x.is_cuda).apply_rotary(x, cos, sin)


@functools.wraps(reference.qk_norm_rotary_)
def qk_norm_rotary_(q, *args, **kwargs):
    return select_variant("rotary", "triton", q.is_cuda).qk_norm_rotary_(q, *args, **kwargs)


__all__ = ["apply_rotary", "qk_norm_rotary_"]
