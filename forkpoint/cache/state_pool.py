"""Recurrent state rows: which row of the state tensors belongs to which request or checkpoint.

What a row holds is declared by the model's recurrent mixer as a `RecurrentStateSpec` (Gated
DeltaNet: conv [conv_dim, W-1] and SSM [HV, K, V]; Mamba2: conv [conv_dim, W-1] and SSM
[H, P, N]); the rows' tensors are the runner's (runner/storage.py), this module hands out row
indices. Row layout of every state tensor (one row = one sequence's or checkpoint's state)::

    row 0                      always zero: the initial state of a fresh sequence
    rows 1 .. R                request slots (one per running request)
    rows R+1 .. R+C            checkpoint slots (one per checkpoint)
    row R+C+1                  scratch: written by the padding rows of captured decode steps and by
                               the start-up warm-up (runner/decode_graphs.py, runner/warmup.py); never
                               read by a request, its content is meaningless (finite)

Keeping requests and checkpoints in one tensor lets a layer gather any segment's initial state
with a single `index_select` and scatter final states with one `index_copy_`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The per-sequence state of one recurrent layer, as its mixer declares it.

    conv_shape: one row of the causal-conv state (e.g. (conv_dim, W-1)), in conv_dtype;
    ssm_shape: one row of the SSM state (GDN (HV, K, V); Mamba2 (H, P, N)), in ssm_dtype (float32
    for both mixers). The dtypes are only read for their `itemsize` here.
    """

    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    ssm_dtype: torch.dtype

    @property
    def bytes(self) -> int:
        """Bytes of one row of both states."""
        return _numel(self.conv_shape) * self.conv_dtype.itemsize + _numel(self.ssm_shape) * self.ssm_dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class StatePool:
    """The rows of the state tensors: `requests` and `checkpoints` allocate rows 1 .. R and
    R+1 .. R+C; rows = 1 + R + C + 1 (zero row, requests, checkpoints, `scratch_slot`)."""

    def __init__(self, num_request_slots: int, num_checkpoint_slots: int) -> None:
        if num_request_slots < 1:
            raise ValueError("the state pool needs at least one request slot")
        self.num_rows = 1 + num_request_slots + num_checkpoint_slots + 1
        self.requests = SlotAllocator(1, num_request_slots, "request state")
        self.checkpoints = SlotAllocator(1 + num_request_slots, num_checkpoint_slots, "checkpoint state")
        self.scratch_slot = self.num_rows - 1  # see the row layout above

    @staticmethod
    def bytes_per_slot(num_layers: int, spec: RecurrentStateSpec) -> int:
        """Bytes of one slot (row) over all `num_layers` recurrent layers."""
        return num_layers * spec.bytes

    def check_integrity(self) -> None:
        self.requests.check_integrity()
        self.checkpoints.check_integrity()
