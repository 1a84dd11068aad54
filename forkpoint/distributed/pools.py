"""Rank 0's state pool for a tensor-parallel engine: row copies made outside the forward reach the workers.

Every rank's pools hold the rank's heads in the same rows and blocks, and the forward writes them
only from the step plan, which every rank runs. One write happens outside the forward: the engine
copies a finished request's row into a turn-end checkpoint row (`StatePool.copy_slot`, from
engine/auto_checkpoints.py). `MirroredStatePool` records those copies; the runner sends them with
the next plan and each worker applies them, in order, before that step's forward, which is the
first point at which either row can be read or written again.
"""

from __future__ import annotations

import torch

from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool


class MirroredStatePool(StatePool):
    """A `StatePool` whose `copy_slot` calls are also queued for the workers (`take_copies`)."""

    def __init__(self, num_request_slots: int, num_checkpoint_slots: int, num_layers: int,
                 spec: RecurrentStateSpec, device: torch.device) -> None:
        super().__init__(num_request_slots, num_checkpoint_slots, num_layers, spec, device)
        self._pending: list[tuple[int, int]] = []

    def copy_slot(self, src: int, dst: int) -> None:
        super().copy_slot(src, dst)
        self._pending.append((src, dst))

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) copies made since the last call, in order; the queue is emptied."""
        copies, self._pending = tuple(self._pending), []
        return copies

