"""Rotary position embedding in plain PyTorch (the spec and the CPU path): the rotate-half form
of the Hugging Face Qwen / Nemotron / Granite / Falcon models, on the leading `rotary_dim` dims of
each head (partial rotary), the others passed through.

    apply_rotary(x, cos, sin)                          a new tensor
    qk_norm_rotary_(q, k, wq, wk, eps, cos, sin)       Qwen3.5's q/k RMSNorm then rotary, in place
"""

from __future__ import annotations

import torch

from forkpoint.kernels.norms.reference import rms_norm


def check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Shapes of `apply_rotary`'s arguments; returns rotary_dim (ValueError when they do not fit)."""
    if x.dim() != 3 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, heads, head_dim] and cos, sin [T, rotary_dim]; got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    rotary_dim = cos.shape[1]
    if rotary_dim % 2 or rotary_dim > x.shape[2]:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {x.shape[2]}")
    return rotary_dim


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim] (rotary_dim even, <= head_dim). Returns
    a new tensor of x's shape and dtype: the first rotary_dim dims d of each head become
    x[d] * cos[d] + rotate_half(x)[d] * sin[d] (rotate_half = (-x[half:], x[:half])), in x's dtype
    op by op as transformers computes them; the rest are copied."""
    rotary_dim = check(x, cos, sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((x_rot, x_pass), dim=-1)


def check_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Shapes of `qk_norm_rotary_`'s arguments; returns rotary_dim (ValueError when they do not fit)."""
    rotary_dim = check(q, cos, sin)
    check(k, cos, sin)
    if k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(f"q and k must share head_dim and dtype, got {tuple(q.shape)} {q.dtype} "
                         f"and {tuple(k.shape)} {k.dtype}")
    if q_weight.shape != q.shape[2:] or k_weight.shape != k.shape[2:]:
        raise ValueError(f"q_weight and k_weight must be [head_dim] = [{q.shape[2]}], got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    return rotary_dim


def qk_norm_rotary_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's attention prologue, in place: q = apply_rotary(rms_norm(q, q_weight), cos, sin) and
    the same for k with k_weight.

    q: [T, HQ, Dh], k: [T, HKV, Dh], one dtype (row-strided views allowed: the columns of the
    stacked q/gate, k, v projection); q_weight, k_weight: [Dh] zero-centred RMSNorm weights (the
    factor is 1 + w); cos, sin: [T, rotary_dim] (1-D or multi-axis tables alike). Exactly the unfused
    sequence: `rms_norm` (fp32 math, rounded to q's dtype once), then `apply_rotary` (op by op in
    q's dtype). Returns (q, k), the tensors it wrote.
    """
    check_qk(q, k, q_weight, k_weight, cos, sin)
    q.copy_(apply_rotary(rms_norm(q, q_weight, eps), cos, sin))
    k.copy_(apply_rotary(rms_norm(k, k_weight, eps), cos, sin))
    return q, k
