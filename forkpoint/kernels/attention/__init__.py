"""Paged attention: ``write_kv``, ``copy_kv_slots`` and ``paged_attention``. ``reference.py`` is
the spec; the GPU variant, ``triton.py``, has the same signatures and is used for CUDA tensors
when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.attention import reference


def _impl(t):
    return select_variant("attention", "triton", t.is_cuda)


@functools.wraps(reference.write_kv)
def write_kv(k_cache, *args, **kwargs):
    return _impl(k_cache).write_kv(k_cache, *args, **kwargs)


@functools.wraps(reference.copy_kv_slots)
def copy_kv_slots(k_cache, *args, **kwargs):
    return _impl(k_cache).copy_kv_slots(k_cache, *args, **kwargs)


@functools.wraps(reference.paged_attention)
def paged_attention(q, *args, **kwargs):
    return _impl(q).paged_attention(q, *args, **kwargs)


__all__ = ["copy_kv_slots", "paged_attention", "write_kv"]
