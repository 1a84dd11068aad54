"""Block-wise FP8 (e4m3) weights, plain PyTorch: the spec and the CPU path.

Qwen's FP8 releases (`quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [bn, bk]`) store a
weight W [N, K] as `float8_e4m3fn` values q with one float32 `scale_inv` per bn x bk block:

    W[n, k] = q[n, k] * scale_inv[n // bn, k // bk]          scale_inv: [ceil(N / bn), ceil(K / bk)]

(the last row / column block may be partial). Stacked experts carry a leading expert axis on both.

Activations (`activation_scheme: "dynamic"`) are quantised per token and group of bk channels at run
time, on the GPU's FP8 tensor cores:

    s[m, g] = max(amax(x[m, g*bk : (g+1)*bk]), 1e-10) / 448,   xq = clamp(x / s, -448, 448) in e4m3

`w8a8_block_linear` is that product's spec (what the Triton GEMM computes: xq * s against q *
scale_inv, fp32 accumulation, one rounding). The CPU path, `fp8_linear` and `fused_moe_fp8`,
dequantises the weights into the compute dtype and runs the plain op: no activation quantisation, so
a checkpoint gives the same result as its dequantised copy (the GPU differs from it by the
activation rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forkpoint.kernels.moe.reference import routed_sum

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ACTIVATION_EPS = 1e-10  # floor of a token group's amax (an all-zero group gets a tiny scale, not 0 / 0)


def block_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale_inv shape of a weight of `shape` [..., N, K]: [..., ceil(N / bn), ceil(K / bk)]."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def check_block_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """ValueError unless weight [..., N, K] is float8_e4m3fn and scale_inv is float32 of the block grid's
    shape. Shapes and dtypes only: no device work."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    expected = block_scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(f"weight {tuple(weight.shape)} with blocks {list(block)} needs a float32 scale_inv of "
                         f"shape {expected}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """scale [..., ceil(N/bn), ceil(K/bk)] -> [..., N, K], each block's scale on its elements."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] e4m3 and scale_inv [..., ceil(N/bn), ceil(K/bk)] fp32 -> W [..., N, K] in
    `dtype` (the product in fp32, one rounding)."""
    check_block_scales(weight, scale_inv, block)
    return (weight.float() * _expand(scale_inv, tuple(weight.shape), block)).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block quantiser (dummy weights, tests): W [..., N, K] float -> (q e4m3 [..., N, K], scale_inv
    [..., ceil(N/bn), ceil(K/bk)] fp32) with scale_inv = amax(block) / 448 (1 for an all-zero block),
    q = W / scale_inv rounded to e4m3 (nearest even). The largest magnitude of each block is exact.
    Stacked weights are quantised one [N, K] matrix at a time (fp32 temporaries of one expert's size)."""
    if weight.dim() > 2:
        flat = weight.reshape(-1, *weight.shape[-2:])
        q = torch.empty(flat.shape, dtype=FP8_DTYPE, device=weight.device)
        scale_inv = torch.empty((flat.shape[0], *block_scale_shape(tuple(flat.shape[-2:]), block)),
                                dtype=torch.float32, device=weight.device)
        for i in range(flat.shape[0]):
            q[i], scale_inv[i] = quantize_blocks(flat[i], block)
        return q.view(weight.shape), scale_inv.view(*weight.shape[:-2], *scale_inv.shape[-2:])
    w = weight.float()
    n, k = w.shape
    bn, bk = block
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))  # zeros do not change a block's amax
    rows, cols = padded.shape[0] // bn, padded.shape[1] // bk
    amax = padded.reshape(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale_inv, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantisation: x [M, K] -> (xq e4m3 [M, K], s [M, ceil(K / group)] fp32)
    with s = max(amax of the group, 1e-10) / 448 and xq = clamp(x / s, -448, 448) (fp32 math)."""
    m, k = x.shape
    xf = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    s = xf.abs().amax(dim=-1).clamp(min=ACTIVATION_EPS) / FP8_MAX
    xq = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return xq, s


def w8a8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 tensor-core GEMM's spec: x [M, K] quantised per token and bk-group (`quantize_activations`)
    against the e4m3 weight [N, K] with its block scales; fp32 products and sums, plus bias [N], one
    rounding to x.dtype. Returns [M, N]."""
    check_block_scales(weight, scale_inv, block)
    xq, s = quantize_activations(x, block[1])
    a = xq.float() * s.repeat_interleave(block[1], dim=-1)[:, : x.shape[1]]
    y = a @ dequantize_blocks(weight, scale_inv, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path of an FP8 projection: F.linear(x, W) with W = the dequantised weight in x.dtype.

    x: [M, K]; weight: [N, K] e4m3; scale_inv: [ceil(N/bn), ceil(K/bk)] fp32; bias: [N] or None. Returns
    [M, N] in x.dtype, written into `out` ([M, N], any strides: e.g. columns of a wider buffer) when
    given."""
    y = F.linear(x, dequantize_blocks(weight, scale_inv, block, x.dtype), bias)
    return y if out is None else out.copy_(y)


def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                  down_scale: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, shared: torch.Tensor | None = None,
                  shared_gate: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.moe.fused_moe` with e4m3 experts: gate_up [E, 2I, Hd] and down [E, Hd, I] with their
    block scales [E, ceil(2I/bn), ceil(Hd/bk)] and [E, ceil(Hd/bn), ceil(I/bk)]. Each expert that was hit
    is dequantised into x.dtype and applied to its tokens in fp32, exactly as `kernels.moe.reference`
    applies dequantised experts; the result, plus sigmoid(shared_gate) * shared and residual when
    given, each op rounded to x.dtype."""
    check_block_scales(gate_up, gate_up_scale, block)
    check_block_scales(down, down_scale, block)
    num_experts, rows, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, rows // 2):
        raise ValueError(f"expected x [T, Hd], gate_up [E, 2I, Hd], down [E, Hd, I]; got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(f"topk_ids and topk_weights must both be [T, k] with T = {x.shape[0]}, "
                         f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w1 = dequantize_blocks(gate_up[e], gate_up_scale[e], block, x.dtype).float()
        w2 = dequantize_blocks(down[e], down_scale[e], block, x.dtype).float()
        gate, up = (rows @ w1.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.T

    out = routed_sum(x, num_experts, topk_weights, topk_ids, expert)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate) * shared
    return out if residual is None else residual + out
