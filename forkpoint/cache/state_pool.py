"""Recurrent state storage: conv and SSM state rows for every recurrent layer.

What a row holds is declared by the model's recurrent mixer as a `RecurrentStateSpec` (Gated
DeltaNet: conv [conv_dim, W-1] and SSM [HV, K, V]; Mamba2: conv [conv_dim, W-1] and SSM
[H, P, N]); the pool knows nothing else about the mixer.

Row layout of every state tensor (one row = one sequence's or checkpoint's state)::

    row 0                      always zero: the initial state of a fresh sequence
    rows 1 .. R                request slots (one per running request)
    rows R+1 .. R+C            checkpoint slots (one per checkpoint)
    row R+C+1                  scratch: written by the padding rows of captured decode steps and by
                               the start-up warm-up (runner/decode_graphs.py, runner/warmup.py); never
                               read by a request, its content is meaningless (finite)

Keeping requests and checkpoints in one tensor lets a layer gather any segment's initial state
with a single `index_select` and scatter final states with one `index_copy_`.

The states of all L recurrent layers are one tensor each, `conv_stack` [L, S, ...] and
`ssm_stack` [L, S, ...]; `conv[i]` and `ssm[i]` are views of layer i's slice. Flattened to
[L * S, ...], layer i's rows are i * S .. i * S + S - 1: the same slot indices plus a row offset
address any layer, so one CUDA graph of the GDN core serves every layer (runner/piecewise.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    ssm_shape: one row of the SSM state (GDN (HV, K, V); Mamba2 (H, P, N)), in ssm_dtype.
    """

    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    ssm_dtype: torch.dtype = torch.float32

    @property
    def bytes(self) -> int:
        """Bytes of one row of both states."""
        conv = _numel(self.conv_shape) * torch.finfo(self.conv_dtype).bits // 8
        return conv + _numel(self.ssm_shape) * torch.finfo(self.ssm_dtype).bits // 8


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class StatePool:
    """conv_stack: [L, rows, *spec.conv_shape] (spec.conv_dtype); ssm_stack: [L, rows, *spec.ssm_shape]
    (spec.ssm_dtype, float32 for both mixers); conv[i] / ssm[i]: views of layer i's slice (contiguous,
    sharing the stacks' storage). All L recurrent layers share one spec (one stacked tensor each).
    rows = 1 + R + C + 1 (zero row, requests, checkpoints, `scratch_slot`)."""

    def __init__(self, num_request_slots: int, num_checkpoint_slots: int, num_layers: int,
                 spec: RecurrentStateSpec, device: torch.device) -> None:
        if num_request_slots < 1:
            raise ValueError("the state pool needs at least one request slot")
        rows = 1 + num_request_slots + num_checkpoint_slots + 1
        self.spec = spec
        self.conv_stack = torch.zeros(num_layers, rows, *spec.conv_shape, dtype=spec.conv_dtype, device=device)
        self.ssm_stack = torch.zeros(num_layers, rows, *spec.ssm_shape, dtype=spec.ssm_dtype, device=device)
        # single views (not unbind's multi-output views, which autograd forbids writing in place)
        self.conv = [self.conv_stack[i] for i in range(num_layers)]
        self.ssm = [self.ssm_stack[i] for i in range(num_layers)]
        self.requests = SlotAllocator(1, num_request_slots, "request state")
        self.checkpoints = SlotAllocator(1 + num_request_slots, num_checkpoint_slots, "checkpoint state")
        self.scratch_slot = rows - 1  # see the row layout above

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state of every layer from row `src` to row `dst` (asynchronous on the device)."""
        if dst == ZERO_SLOT:
            raise ValueError("the zero state row is never written")
        self.conv_stack[:, dst].copy_(self.conv_stack[:, src])
        self.ssm_stack[:, dst].copy_(self.ssm_stack[:, src])

    @staticmethod
    def bytes_per_slot(num_layers: int, spec: RecurrentStateSpec) -> int:
        """Bytes of one slot (row) over all `num_layers` recurrent layers."""
        return num_layers * spec.bytes

    def check_integrity(self) -> None:
        self.requests.check_integrity()
        self.checkpoints.check_integrity()
        for layer, (conv, ssm) in enumerate(zip(self.conv, self.ssm)):
            stacked = self.conv_stack[layer], self.ssm_stack[layer]
            if conv.data_ptr() != stacked[0].data_ptr() or ssm.data_ptr() != stacked[1].data_ptr():
                raise AssertionError(f"the states of recurrent layer {layer} are no longer views of the stacked "
                                     "tensors")
        if self.conv_stack[:, ZERO_SLOT].any() or self.ssm_stack[:, ZERO_SLOT].any():
            raise AssertionError("the zero state row was written")
