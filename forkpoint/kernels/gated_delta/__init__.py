"""Gated DeltaNet: ``chunk_gated_delta_rule`` (packed prefill) and ``recurrent_gated_delta_rule``
(decode). ``reference.py`` is the spec; the GPU variant, ``fla.py``, has the same signatures and
is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.gated_delta import reference


def _impl(q):
    return select_variant("gated_delta", "fla", q.is_cuda)


@functools.wraps(reference.chunk_gated_delta_rule)
def chunk_gated_delta_rule(q, *args, **kwargs):
    return _impl(q).chunk_gated_delta_rule(q, *args, **kwargs)


@functools.wraps(reference.recurrent_gated_delta_rule)
def recurrent_gated_delta_rule(q, *args, **kwargs):
    return _impl(q).recurrent_gated_delta_rule(q, *args, **kwargs)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]
