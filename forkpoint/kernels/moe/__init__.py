"""Routed experts: ``topk_softmax`` (the router's selection), ``fused_moe`` (SwiGLU experts) and
``fused_moe_relu2`` (Nemotron's non-gated ReLU^2 experts). ``reference.py`` is
the spec; the GPU variant, ``grouped.py`` (one Triton kernel for the selection, grouped GEMMs for
the experts), has the same signatures and is used for CUDA tensors when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.moe import reference


@functools.wraps(reference.fused_moe)
def fused_moe(x, *args, **kwargs):
    return select_variant("moe", "grouped", x.is_cuda).fused_moe(x, *args, **kwargs)


@functools.wraps(reference.fused_moe_relu2)
def fused_moe_relu2(x, *args, **kwargs):
    return select_variant("moe", "grouped", x.is_cuda).fused_moe_relu2(x, *args, **kwargs)


@functools.wraps(reference.topk_softmax)
def topk_softmax(logits, *args, **kwargs):
    return select_variant("moe", "grouped", logits.is_cuda).topk_softmax(logits, *args, **kwargs)


__all__ = ["fused_moe", "fused_moe_relu2", "topk_softmax"]
