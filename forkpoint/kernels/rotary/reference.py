"""Rotary position embedding in plain PyTorch (the spec and the CPU path): the rotate-half form
of the Hugging Face Qwen / Nemotron / Granite / Falcon models, on the leading `rotary_dim` dims of
each head (partial rotary), the others passed through."""

from __future__ import annotations

import torch


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
