"""Rank 0's pools for a tensor-parallel engine: pool writes made outside the forward reach the workers.

Every rank's pools hold the rank's heads in the same rows and blocks (every rank's local config has
the same head counts, so the pools and their rows have the same shapes on every rank), and the
forward writes them only from the step plan, which every rank runs. Two kinds of write happen
outside the forward, on rank 0's pools:

    ("copy", src, dst)             the engine copies a finished request's row into a turn-end
                                   checkpoint row (`StatePool.copy_slot`, engine/auto_checkpoints.py)
    ("spill", key, n, s, kind, slot, blocks, kept)
    ("restore", key, slot, blocks) the host tier (cache/host_tier.py) copies an evicted checkpoint's
                                   state row and KV blocks to the host, or back into a row and blocks

`MirroredStatePool` and `MirroredHostTier` record them, in order, in one log; the runner sends the
log with the next plan and each worker applies it (`apply_pool_ops`) before that step's forward,
the first point at which any of those rows or blocks can be read or written again. Each worker's
host tier has rank 0's capacity and sees the same calls with entries of the same byte size, so it
keeps and drops exactly what rank 0's does; `kept` checks that, and a worker whose tier disagrees
raises (the engine then fails with that error, never serves a wrong state).
"""

from __future__ import annotations

import torch

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool


class MirroredStatePool(StatePool):
    """A `StatePool` whose `copy_slot` calls (and its host tier's spills and restores) are also
    logged for the workers (`take_ops`)."""

    def __init__(self, num_request_slots: int, num_checkpoint_slots: int, num_layers: int,
                 spec: RecurrentStateSpec, device: torch.device) -> None:
        super().__init__(num_request_slots, num_checkpoint_slots, num_layers, spec, device)
        self._pending: list[tuple] = []

    def copy_slot(self, src: int, dst: int) -> None:
        super().copy_slot(src, dst)
        self.record(("copy", src, dst))

    def record(self, op: tuple) -> None:
        """Log one pool operation for the workers (see the module docstring for the kinds)."""
        self._pending.append(op)

    def take_ops(self) -> tuple[tuple, ...]:
        """The operations logged since the last call, in order; the log is emptied."""
        ops, self._pending = tuple(self._pending), []
        return ops


class MirroredHostTier(HostTier):
    """Rank 0's `HostTier`: each spill and each restore that took place is logged in `states`."""

    def __init__(self, capacity_bytes: int, states: MirroredStatePool, blocks: BlockPool) -> None:
        super().__init__(capacity_bytes, states, blocks)
        self._log = states

    def spill(self, key: bytes, num_tokens: int, state_tokens: int, kind: object, slot: int, blocks: list[int]) -> None:
        super().spill(key, num_tokens, state_tokens, kind, slot, blocks)
        self._log.record(("spill", key, num_tokens, state_tokens, kind, slot, tuple(blocks), key in self))

    def restore(self, key: bytes, slot: int, allocate_blocks):
        restored = super().restore(key, slot, allocate_blocks)
        if restored is not None:
            self._log.record(("restore", key, slot, tuple(restored[1])))
        return restored


def apply_pool_ops(ops: tuple[tuple, ...], states: StatePool, host: HostTier) -> None:
    """A worker's side: replay rank 0's logged operations on the worker's pools and host tier."""
    for op in ops:
        if op[0] == "copy":
            states.copy_slot(op[1], op[2])
        elif op[0] == "spill":
            key, num_tokens, state_tokens, kind, slot, blocks, kept = op[1:]
            host.spill(key, num_tokens, state_tokens, kind, slot, list(blocks))
            if (key in host) != kept:
                raise RuntimeError(f"this rank's host tier {'dropped' if kept else 'kept'} a checkpoint that "
                                   f"rank 0's {'kept' if kept else 'dropped'}: the ranks' tiers are out of step")
        elif op[0] == "restore":
            key, slot, blocks = op[1:]
            if key not in host:
                raise RuntimeError("rank 0 restored a checkpoint from the host tier that this rank does not hold")
            host.restore(key, slot, lambda count, blocks=blocks: list(blocks))
        else:
            raise ValueError(f"unknown pool operation {op[0]!r}")
