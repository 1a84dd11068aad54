"""Applying packed token bitmasks to logits on the logits' device.

Layout (llguidance's, also xgrammar's): row r of `bitmask` [R, W] int32, W = ceil(V / 32), allows
token t iff bit (t % 32) of word bitmask[r, t // 32] is set. Tokens past 32 * W are disallowed.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 (any device) -> allowed [R, vocab_size] bool on the same device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]: bit b of word w is token 32 * w + b
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[rows[i], t] = -inf for every token t that bitmask[i] disallows, in place.

    logits: [R, V] float on the device; rows: [G] int64 on the device (distinct rows);
    bitmask: [G, W] int32 (host, pinned when CUDA is there, or device); copied once to the device.
    """
    if rows.numel() == 0:
        return
    mask = bitmask.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(mask, logits.shape[1])
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill(~allowed, float("-inf")))
