"""Block-wise FP8 (e4m3) weights: ``fp8_linear`` (a projection with block-scaled weights) and
``fused_moe_fp8`` (routed experts with block-scaled weights). ``reference.py`` is the spec and the
CPU path (it dequantises, then runs the plain op) and holds the block quantiser; the GPU variant,
``triton.py`` (per-token-group activation quantisation and a block-scaled FP8 tensor-core GEMM;
``moe_fp8.py``'s weight-only FP8 expert tiles), has the same signatures and is used for CUDA tensors
when it imports."""

import functools

from forkpoint.kernels import select_variant
from forkpoint.kernels.fp8 import reference


@functools.wraps(reference.fp8_linear)
def fp8_linear(x, weight, scale_inv, block, bias=None, out=None):
    return select_variant("fp8", "triton", x.is_cuda).fp8_linear(x, weight, scale_inv, block, bias, out)


@functools.wraps(reference.fused_moe_fp8)
def fused_moe_fp8(x, *args, **kwargs):
    return select_variant("fp8", "triton", x.is_cuda).fused_moe_fp8(x, *args, **kwargs)


__all__ = ["fp8_linear", "fused_moe_fp8"]
