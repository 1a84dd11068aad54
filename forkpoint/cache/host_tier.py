"""The host tier's directory: which evicted checkpoints are kept in (pinned) host memory.

A spilled checkpoint is a host entry holding copies of its recurrent state row (every layer's conv
and SSM state) and of the KV blocks covering its prefix. The copies themselves are device writes of
the step plan (step/plan.py `Spill`, `Restore`, `HostDrop`), applied by the runner's storage
(runner/storage.py) before the next forward, in the order they were decided: a spill reads its row
and blocks before any later write reuses them. This class decides and counts: least recently used
entries leave first when `capacity_bytes` would be exceeded; an entry larger than the whole tier is
not kept. A miss in both tiers is a recompute, never wrong data.

Entry sizes are computed from the declarations (`slot_bytes`: one state row over every recurrent
layer; `block_bytes`: K and V of one block over every attention layer), equal to the bytes the
storage copies.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class HostEntry:
    """Entry `entry_id` (the id the plan's writes name); `kind` is the checkpoint's CheckpointKind
    (kept opaque here)."""

    entry_id: int
    num_tokens: int
    state_tokens: int
    kind: object
    num_blocks: int
    num_bytes: int


@dataclass
class TierCounters:
    spilled: int = 0
    restored: int = 0
    dropped: int = 0  # left the host tier (LRU) or never fitted in it


class HostTier:
    def __init__(self, capacity_bytes: int, slot_bytes: int, block_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._ids = itertools.count()
        self.num_bytes = 0
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lengths(self) -> set[int]:
        return {entry.num_tokens for entry in self._entries.values()}

    def entry_ids(self) -> set[int]:
        """The ids of the entries held (a storage that applied every plan holds exactly these)."""
        return {entry.entry_id for entry in self._entries.values()}

    def entry(self, key: bytes) -> HostEntry:
        return self._entries[key]

    def spill(self, key: bytes, num_tokens: int, state_tokens: int, kind: object,
              num_blocks: int) -> tuple[HostEntry | None, list[int]]:
        """Keep a checkpoint of `num_blocks` KV blocks, evicting least recently used entries to make
        room. Returns (the new entry, or None when it is larger than the tier; the ids of the
        entries that left to make room): the caller records the `HostDrop`s and the `Spill`."""
        num_bytes = self.slot_bytes + num_blocks * self.block_bytes
        if num_bytes > self.capacity_bytes:
            self.counters.dropped += 1
            return None, []
        dropped = [] if key not in self._entries else [self.discard(key)]
        while self.num_bytes + num_bytes > self.capacity_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.num_bytes -= oldest.num_bytes
            self.counters.dropped += 1
            dropped.append(oldest.entry_id)
        entry = HostEntry(next(self._ids), num_tokens, state_tokens, kind, num_blocks, num_bytes)
        self._entries[key] = entry
        self.num_bytes += num_bytes
        self.counters.spilled += 1
        return entry, dropped

    def take(self, key: bytes) -> HostEntry:
        """Entry `key` leaves the tier to be restored (the caller records the `Restore`)."""
        entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes
        self.counters.restored += 1
        return entry

    def discard(self, key: bytes) -> int:
        """Entry `key` leaves without a restore; returns its id (the caller records the `HostDrop`)."""
        entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes
        return entry.entry_id

    def clear(self) -> list[int]:
        """Every entry leaves without a restore; returns their ids (the caller records the `HostDrop`s)."""
        ids = [entry.entry_id for entry in self._entries.values()]
        self._entries.clear()
        self.num_bytes = 0
        return ids

    def check_integrity(self) -> None:
        if self.num_bytes != sum(e.num_bytes for e in self._entries.values()) or self.num_bytes > self.capacity_bytes:
            raise AssertionError("host tier byte count is wrong or over capacity")
