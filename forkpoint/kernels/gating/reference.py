"""Gated DeltaNet gating, plain PyTorch: the spec and the CPU path.

Per token t and value head h, from the projections a = in_proj_a(x), b = in_proj_b(x):

    beta[t, h] = sigmoid(b[t, h])                                          in b.dtype
    g[t, h]    = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])           fp32 log-decay, <= 0

softplus is torch's (beta 1, threshold 20: identity above 20).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_shapes(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Raise ValueError unless a, b are [T, HV] and A_log, dt_bias [HV]. Shapes only."""
    if a.dim() != 2 or a.shape != b.shape or A_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(
            f"expected a, b [T, HV] and A_log, dt_bias [HV]; got a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}"
        )


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, HV] (any float dtype, row strides allowed); A_log, dt_bias: [HV].
    Returns (g [T, HV] fp32, beta [T, HV] in b.dtype), new tensors."""
    check_shapes(a, b, A_log, dt_bias)
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta
