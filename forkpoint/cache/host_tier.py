"""The host tier's directory: which evicted checkpoints are kept in (pinned) host memory.

A spilled checkpoint is a host entry holding copies of its recurrent state row (every layer's conv
and SSM state) and of the KV blocks covering its prefix. The copies themselves are device writes of
the step plan (step/plan.py `Spill`, `Restore`, `HostDrop`), applied by the runner's storage
(runner/storage.py) before the next forward, in the order they were decided: a spill reads its row
and blocks before any later write reuses them. This class decides and counts: least recently used
entries leave first when `capacity_bytes` would be exceeded; an entry larger than the whole tier is
not kept. A miss in both tiers is a recompute, never wrong data.

While the storage's memory is still being pinned (runner/host_arena.py, pinned ahead), the tier
is as large as what is pinned: `limit_pages` says how many pages of which size the storage holds so
far, and the tier keeps its entries' pages (each entry rounded up to whole pages, as the storage
stores it) within them besides `capacity_bytes`. A spill that does not fit is handled as in a full
tier: least recently used entries leave, and an entry larger than the pages pinned is not kept. The
limit only grows, so a spill decided now fits when the storage applies it later.

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


@dataclass(frozen=True)
class PageLimit:
    """The storage holds entries in pages of `page_bytes` and has `pages` of them so far."""

    page_bytes: int
    pages: int


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
        self.page_limit: PageLimit | None = None  # None: the storage holds whatever fits capacity_bytes
        self.num_pages = 0  # the entries' pages under `page_limit` (0 without one)

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
        pages = self._pages(num_bytes)
        if num_bytes > self.capacity_bytes or (self.page_limit is not None and pages > self.page_limit.pages):
            self.counters.dropped += 1
            return None, []
        dropped = [] if key not in self._entries else [self.discard(key)]
        while self.num_bytes + num_bytes > self.capacity_bytes or (
                self.page_limit is not None and self.num_pages + pages > self.page_limit.pages):
            _, oldest = self._entries.popitem(last=False)
            self._leave(oldest)
            self.counters.dropped += 1
            dropped.append(oldest.entry_id)
        entry = HostEntry(next(self._ids), num_tokens, state_tokens, kind, num_blocks, num_bytes)
        self._entries[key] = entry
        self.num_bytes += num_bytes
        self.num_pages += pages
        self.counters.spilled += 1
        return entry, dropped

    def take(self, key: bytes) -> HostEntry:
        """Entry `key` leaves the tier to be restored (the caller records the `Restore`)."""
        entry = self._entries.pop(key)
        self._leave(entry)
        self.counters.restored += 1
        return entry

    def discard(self, key: bytes) -> int:
        """Entry `key` leaves without a restore; returns its id (the caller records the `HostDrop`)."""
        entry = self._entries.pop(key)
        self._leave(entry)
        return entry.entry_id

    def clear(self) -> list[int]:
        """Every entry leaves without a restore; returns their ids (the caller records the `HostDrop`s)."""
        ids = [entry.entry_id for entry in self._entries.values()]
        self._entries.clear()
        self.num_bytes = self.num_pages = 0
        return ids

    def limit_pages(self, page_bytes: int, pages: int) -> None:
        """From now on keep the entries within `pages` pages of `page_bytes` (the storage's memory
        pinned so far; the module docstring). The limit only grows: a smaller one, or one of another
        page size, raises ValueError (the storage would hold entries it has no pages for)."""
        if page_bytes < 1 or pages < 0:
            raise ValueError(f"a page limit needs page_bytes >= 1 and pages >= 0, got {page_bytes}, {pages}")
        limit = self.page_limit
        if limit is not None and (page_bytes != limit.page_bytes or pages < limit.pages):
            raise ValueError(f"the host tier's page limit only grows: {limit.pages} pages of {limit.page_bytes} "
                             f"bytes, then {pages} of {page_bytes}")
        if limit is None:
            self.num_pages = sum(-(-e.num_bytes // page_bytes) for e in self._entries.values())
            if self.num_pages > pages:
                raise ValueError(f"the host tier holds {self.num_pages} pages of {page_bytes} bytes, a limit of "
                                 f"{pages} was given")
        self.page_limit = PageLimit(page_bytes, pages)

    def check_integrity(self) -> None:
        if self.num_bytes != sum(e.num_bytes for e in self._entries.values()) or self.num_bytes > self.capacity_bytes:
            raise AssertionError("host tier byte count is wrong or over capacity")
        if self.page_limit is not None and (
                self.num_pages != sum(self._pages(e.num_bytes) for e in self._entries.values())
                or self.num_pages > self.page_limit.pages):
            raise AssertionError("host tier page count is wrong or over the pages pinned")

    def _pages(self, num_bytes: int) -> int:
        """Pages an entry of `num_bytes` takes under the page limit (0 without one)."""
        return -(-num_bytes // self.page_limit.page_bytes) if self.page_limit is not None else 0

    def _leave(self, entry: HostEntry) -> None:
        self.num_bytes -= entry.num_bytes
        self.num_pages -= self._pages(entry.num_bytes)
