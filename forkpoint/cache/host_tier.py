"""The host tier: checkpoints evicted from the device pools, kept in (pinned) host memory.

A spilled checkpoint holds copies of its recurrent state rows (every layer's conv and SSM state)
and of the KV blocks covering its prefix. Spilling and restoring are copies enqueued on the device
stream (non-blocking into and out of pinned memory on CUDA), ordered before any later kernel that
reuses the freed rows and blocks; nothing waits on the host. Least recently used entries leave
first when `capacity_bytes` would be exceeded; an entry larger than the whole tier is not kept.
A miss in both tiers is a recompute, never wrong data.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.state_pool import StatePool


@dataclass(frozen=True)
class SpilledCheckpoint:
    """conv: [L, conv...]; ssm: [L, ssm...]; k, v: one [n_blocks, block_size, HKV, Dh] tensor per
    attention layer; `kind` is the checkpoint's CheckpointKind (kept opaque here)."""

    num_tokens: int
    state_tokens: int
    kind: object
    conv: torch.Tensor
    ssm: torch.Tensor
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @property
    def num_bytes(self) -> int:
        tensors = (self.conv, self.ssm, *self.k, *self.v)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] if self.k else 0


@dataclass
class TierCounters:
    spilled: int = 0
    restored: int = 0
    dropped: int = 0  # left the host tier (LRU) or never fitted in it


class HostTier:
    def __init__(self, capacity_bytes: int, states: StatePool, blocks: BlockPool) -> None:
        self.capacity_bytes = capacity_bytes
        self._states = states
        self._blocks = blocks
        self._pinned = states.conv_stack.device.type == "cuda"
        self._entries: OrderedDict[bytes, SpilledCheckpoint] = OrderedDict()
        self.num_bytes = 0
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lengths(self) -> set[int]:
        return {entry.num_tokens for entry in self._entries.values()}

    def spill(self, key: bytes, num_tokens: int, state_tokens: int, kind: object, slot: int, blocks: list[int]) -> None:
        """Copy a checkpoint's state row `slot` and KV `blocks` to the host (before the device pools
        free them), evicting least recently used host entries to make room."""
        index = torch.tensor(blocks, dtype=torch.long, device=self._states.conv_stack.device)
        entry = SpilledCheckpoint(
            num_tokens, state_tokens, kind, self._to_host(self._states.conv_stack[:, slot]),
            self._to_host(self._states.ssm_stack[:, slot]),
            tuple(self._to_host(k.index_select(0, index)) for k in self._blocks.k),
            tuple(self._to_host(v.index_select(0, index)) for v in self._blocks.v))
        if entry.num_bytes > self.capacity_bytes:
            self.counters.dropped += 1
            return
        self.discard(key)
        while self.num_bytes + entry.num_bytes > self.capacity_bytes:
            self._drop_oldest()
        self._entries[key] = entry
        self.num_bytes += entry.num_bytes
        self.counters.spilled += 1

    def restore(self, key: bytes, slot: int, allocate_blocks: Callable[[int], list[int] | None]
                ) -> tuple[SpilledCheckpoint, list[int]] | None:
        """Copy entry `key` back into state row `slot` and freshly allocated KV blocks (from
        `allocate_blocks(n)`, None when the pool cannot give n). The entry leaves the host tier.
        Returns (entry, blocks) or None when no blocks could be had (the entry stays)."""
        entry = self._entries[key]
        blocks = allocate_blocks(entry.num_blocks)
        if blocks is None:
            return None
        del self._entries[key]
        self.num_bytes -= entry.num_bytes
        device = self._states.conv_stack.device
        self._states.conv_stack[:, slot].copy_(entry.conv, non_blocking=True)
        self._states.ssm_stack[:, slot].copy_(entry.ssm, non_blocking=True)
        if blocks:
            index = torch.tensor(blocks, dtype=torch.long, device=device)
            for cache, saved in zip(self._blocks.k + self._blocks.v, entry.k + entry.v):
                cache.index_copy_(0, index, saved.to(device, non_blocking=True))
        self.counters.restored += 1
        return entry, blocks

    def discard(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.num_bytes
        self.counters.dropped += 1

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
        host.copy_(tensor, non_blocking=self._pinned)
        return host

    def check_integrity(self) -> None:
        if self.num_bytes != sum(e.num_bytes for e in self._entries.values()) or self.num_bytes > self.capacity_bytes:
            raise AssertionError("host tier byte count is wrong or over capacity")
