"""Routed experts: ``topk_softmax`` (the softmax router's selection), ``sigmoid_grouped_topk``
(Nemotron-3's grouped sigmoid router), ``fused_moe`` (SwiGLU experts) and ``fused_moe_relu2``
(Nemotron's non-gated ReLU^2 experts). ``reference.py`` is the spec; the GPU variants,
``grouped.py`` (one Triton kernel for the softmax selection, grouped GEMMs for the experts) and
``router.py`` (one Triton kernel for the sigmoid selection), have the same signatures and are used
for CUDA tensors when they import."""

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


@functools.wraps(reference.sigmoid_grouped_topk)
def sigmoid_grouped_topk(logits, *args, **kwargs):
    return select_variant("moe", "router", logits.is_cuda).sigmoid_grouped_topk(logits, *args, **kwargs)


__all__ = ["fused_moe", "fused_moe_relu2", "sigmoid_grouped_topk", "topk_softmax"]
