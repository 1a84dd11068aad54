"""Depthwise causal 1-D convolution with carried state (the short conv of Gated DeltaNet layers).

Per channel d and segment, with kernel width W and state = the W-1 inputs before the segment
(oldest first), output t reads the W inputs ending at t:

    y_t = act(bias + sum_{w < W} weight[d, w] * x_{t - (W-1) + w})      (x_{<0} taken from the state)

as transformers' ``causal_conv1d_update``: ``act(conv1d(cat(state, x)))``. Compute is fp32.

Packed layout used by ``causal_conv1d_varlen``: each segment's state rows go in front of its
tokens, the whole sequence runs through one convolution, and rows whose window straddles two
segments are dropped:

    ext = [ s0 s0 s0 | x0 x1 x2 x3 | s1 s1 s1 | x4 x5 ]      (W = 4)
    out = conv(ext)[j] for j = token + segment * (W-1)
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from forkpoint.kernels import check_cu_seqlens

ACTIVATIONS = (None, "silu")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D, W] with D = {x.shape[-1]} and W >= 2, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [D] = [{x.shape[-1]}] or None, got {tuple(bias.shape)}")
    if state.dim() != 3 or state.shape[1:] != (x.shape[-1], weight.shape[1] - 1):
        raise ValueError(
            f"conv state must be [N, D, W-1] = [N, {x.shape[-1]}, {weight.shape[1] - 1}], got {tuple(state.shape)}"
        )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: Sequence[int],
    *,
    activation: str | None = "silu",
    split: Sequence[int] | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """Causal depthwise conv over a packed variable-length batch (prefill).

    x: [T, D]; weight: [D, W]; bias: [D] or None; initial_state: [N, D, W-1], the W-1 inputs before
    each segment, oldest first; cu_seqlens: [N + 1] long (unused here: the reference reads
    ``cu_seqlens_host``). activation: "silu" or None.

    Returns (y [T, D] in x.dtype, final_state [N, D, W-1] in initial_state.dtype, a new tensor):
    final_state holds each segment's last W-1 inputs, taken partly from initial_state when the
    segment is shorter than W-1 (a length-0 segment returns its initial state).

    split: up to 3 channel counts summing to D: y is then returned as that many contiguous tensors
    [T, split[i]], the channel groups of y in order (the GDN conv's q, k and v, which the chunked
    delta rule takes contiguous).
    """
    _check(x, weight, bias, initial_state, activation)
    check_split(split, weight.shape[0])
    y, final_state = _varlen(x, weight, bias, initial_state, cu_seqlens_host, activation)
    if split is None:
        return y, final_state
    return tuple(part.contiguous() for part in y.split(tuple(split), dim=-1)), final_state


def check_split(split: Sequence[int] | None, dim: int) -> None:
    """ValueError unless `split` is None or 1 to 3 positive channel counts summing to `dim`."""
    if split is not None and not (1 <= len(split) <= 3 and all(int(n) > 0 for n in split) and sum(split) == dim):
        raise ValueError(f"split must be 1 to 3 positive channel counts summing to D = {dim}, got {tuple(split)}")


def _varlen(x, weight, bias, initial_state, cu_seqlens_host, activation):
    num_tokens, dim = x.shape
    num_seqs = check_cu_seqlens(cu_seqlens_host, num_tokens)
    if initial_state.shape[0] != num_seqs:
        raise ValueError(f"initial_state has {initial_state.shape[0]} rows for {num_seqs} segments")
    if num_tokens == 0:
        return x.new_empty(x.shape), initial_state.clone()
    hist = weight.shape[1] - 1

    cu = torch.tensor(cu_seqlens_host, dtype=torch.long)
    seg = torch.arange(num_seqs).repeat_interleave(cu.diff(), output_size=num_tokens)
    ext_len = num_tokens + num_seqs * hist
    # Source rows: tokens first, then every segment's state rows. ext_index orders them as in the diagram.
    ext_index = torch.empty(ext_len, dtype=torch.long)
    ext_index[torch.arange(num_tokens) + (seg + 1) * hist] = torch.arange(num_tokens)
    state_pos = torch.arange(num_seqs)[:, None] * hist + cu[:-1, None] + torch.arange(hist)  # [N, W-1]
    ext_index[state_pos.flatten()] = num_tokens + torch.arange(num_seqs * hist)

    device = x.device
    source = torch.cat([x.float(), initial_state.float().transpose(1, 2).flatten(0, 1)])
    ext = source[ext_index.to(device)]  # [T + N(W-1), D]
    conv = F.conv1d(ext.T[None], weight.float()[:, None, :], None if bias is None else bias.float(), groups=dim)
    y = conv[0].T[(torch.arange(num_tokens) + seg * hist).to(device)]
    # The last W-1 rows of each segment in ext (state rows included) form its final state.
    final_pos = cu[1:, None] + torch.arange(num_seqs)[:, None] * hist + torch.arange(hist)  # [N, W-1]
    final_state = ext[final_pos.to(device)].transpose(1, 2)
    return _activate(y, activation).to(x.dtype), final_state.to(initial_state.dtype)


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode).

    x: [N, D]; weight: [D, W]; bias: [D] or None; state: [N, D, W-1], oldest input first.
    Returns (y [N, D] in x.dtype, new_state [N, D, W-1] in state.dtype: the state shifted left by
    one with x appended).
    """
    _check(x, weight, bias, state, activation)
    if state.shape[0] != x.shape[0]:
        raise ValueError(f"state has {state.shape[0]} rows for {x.shape[0]} sequences")
    window = torch.cat([state.float(), x.float()[:, :, None]], dim=2)  # [N, D, W]
    y = (window * weight.float()).sum(dim=2)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:].to(state.dtype)


def causal_conv1d_step_inplace(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per sequence whose conv states live in a pool, updated in place.

    x: [N, D] (rows may be strided); weight: [D, W]; bias: [D] or None; state_pool: [S, D, W-1],
    rows ``slots`` ([N] long, distinct: not checked, that would sync the host) read and
    overwritten with the state shifted left by one with x appended, every other row untouched.
    Returns y [N, D] in x.dtype. Same math as ``causal_conv1d_step`` on ``state_pool[slots]``,
    followed by the write-back.
    """
    if state_pool.dim() != 3 or slots.shape != x.shape[:1]:
        raise ValueError(f"state_pool must be [S, D, W-1] and slots [N] for x [N, D]; got {tuple(state_pool.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(x.shape)}")
    y, state = causal_conv1d_step(x, weight, bias, state_pool.index_select(0, slots), activation=activation)
    state_pool.index_copy_(0, slots, state)
    return y
