"""Recurrent state storage: conv and SSM state rows for every Gated DeltaNet layer.

Row layout of every state tensor (one row = one sequence's or checkpoint's state)::

    row 0                      always zero: the initial state of a fresh sequence
    rows 1 .. R                request slots (one per running request)
    rows R+1 .. R+C            checkpoint slots (one per checkpoint)

Keeping requests and checkpoints in one tensor lets a layer gather any segment's initial state
with a single `index_select` and scatter final states with one `index_copy_`.
"""

from __future__ import annotations

import torch

ZERO_SLOT = 0


class SlotAllocator:
    """Free list over a contiguous range of rows [first, first + count)."""

    def __init__(self, first: int, count: int, kind: str) -> None:
        self.first, self.count, self.kind = first, count, kind
        self._free = list(range(first + count - 1, first - 1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError(f"no free {self.kind} slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"double free of {self.kind} slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used:
            raise AssertionError(f"{self.kind} slot free list corrupt")
        if free | self._used != set(range(self.first, self.first + self.count)):
            raise AssertionError(f"{self.kind} slots leaked or out of range")


class StatePool:
    """conv[i]: [rows, conv_dim, W-1] (model dtype); ssm[i]: [rows, HV, K, V] (float32)."""

    def __init__(self, num_request_slots: int, num_checkpoint_slots: int, num_layers: int, conv_dim: int,
                 conv_width: int, num_v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, ssm_dtype: torch.dtype = torch.float32) -> None:
        if num_request_slots < 1:
            raise ValueError("the state pool needs at least one request slot")
        rows = 1 + num_request_slots + num_checkpoint_slots
        self.conv = [torch.zeros(rows, conv_dim, conv_width - 1, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ssm = [torch.zeros(rows, num_v_heads, k_dim, v_dim, dtype=ssm_dtype, device=device)
                    for _ in range(num_layers)]
        self.requests = SlotAllocator(1, num_request_slots, "request state")
        self.checkpoints = SlotAllocator(1 + num_request_slots, num_checkpoint_slots, "checkpoint state")

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_width: int, num_v_heads: int, k_dim: int, v_dim: int,
                       dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
        conv = conv_dim * (conv_width - 1) * torch.finfo(dtype).bits // 8
        ssm = num_v_heads * k_dim * v_dim * torch.finfo(ssm_dtype).bits // 8
        return num_layers * (conv + ssm)

    def check_integrity(self) -> None:
        self.requests.check_integrity()
        self.checkpoints.check_integrity()
        for conv, ssm in zip(self.conv, self.ssm):
            if conv[ZERO_SLOT].any() or ssm[ZERO_SLOT].any():
                raise AssertionError("the zero state row was written")
