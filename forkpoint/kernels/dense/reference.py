"""Dense projection y = x @ weight^T (+ bias), plain PyTorch: the spec and the CPU path.

    linear(x, weight, bias=None, out=None) = F.linear(x, weight, bias)

x [M, K], weight [N, K], bias [N] or None, all of one dtype and device; the result [M, N] is in
x.dtype. With ``out`` ([M, N], contiguous, x's dtype and device) the result is written there (by
torch.addmm / torch.mm, the ops F.linear runs for 2-D inputs) and ``out`` is returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """Raise ValueError unless x [M, K], weight [N, K], bias [N] and out [M, N] (contiguous) fit together."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear needs x [M, K] and weight [N, K] with one K, got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} (flatten x's leading dims first)")
    for name, t in (("weight", weight), ("bias", bias), ("out", out)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"linear: {name} is {t.dtype} on {t.device} but x is {x.dtype} on {x.device}: "
                             "they must match")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"linear: bias must be [N] = [{n}], got {tuple(bias.shape)}")
    if out is not None and (tuple(out.shape) != (x.shape[0], n) or not out.is_contiguous()):
        raise ValueError(f"linear: out must be a contiguous [M, N] = [{x.shape[0]}, {n}] tensor, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None -> x @ weight^T + bias, [M, N] in x.dtype (into
    ``out`` when given: [M, N] contiguous). Exactly F.linear."""
    check_linear(x, weight, bias, out)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)
