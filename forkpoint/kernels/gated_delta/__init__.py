"""Gated DeltaNet: ``chunk_gated_delta_rule`` (packed prefill), ``recurrent_gated_delta_rule``
(decode, states in and out) and ``recurrent_gated_delta_rule_inplace`` (decode on a state pool, rows
updated in place). ``reference.py`` is the spec; the GPU variants have the same signatures and are
used for CUDA tensors when they import: ``fla.py`` (fla-core) for the first two, ``triton.py`` (our
own Triton kernel, no fla needed) for the in-place step."""

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


@functools.wraps(reference.recurrent_gated_delta_rule_inplace)
def recurrent_gated_delta_rule_inplace(q, *args, **kwargs):
    return select_variant("gated_delta", "triton", q.is_cuda).recurrent_gated_delta_rule_inplace(q, *args, **kwargs)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "recurrent_gated_delta_rule_inplace"]
