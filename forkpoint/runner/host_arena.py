"""`HostArena`: the host tier's memory, allocated once as fixed-size pages and reused.

A host entry (a spilled checkpoint, runner/host_copies.py) is a byte string of a size fixed by its
number of KV blocks: the state row (the same bytes for every checkpoint of a model) and the blocks.
Allocating pinned memory per spill is slow (a pinned allocation per tensor, rounded up to a power
of two by PyTorch's host allocator, kept until it is freed), so the tier's memory is one arena of
`num_pages` pages of `page_bytes` each, handed out in page runs and given back on restore or drop.

    chunk 0                           chunk 1
    [ page 0 | page 1 | ... | p - 1 ] [ page p | ... ]       p = pages_per_chunk
      entry 7: runs ((0, 3), (5, 2))   an entry's bytes fill its runs in order

Pages live in chunks of at most `CHUNK_BYTES` (PyTorch's pinned allocator rounds each allocation
up to a power of two: chunks of about 1 GiB waste less than a page each). A chunk is allocated the
first time one of its pages is handed out and kept for the arena's life: the arena pins memory only
as far as the tier has ever filled, and never twice. Pinning a GiB takes a while (and a pinned
allocation may synchronise the device), so with `prefetch` the chunk after the one just taken is
allocated at once on a background thread, off the step loop: the tier fills without waiting for it
unless it fills faster than memory is pinned. With `ahead` the background thread allocates every
chunk, in order, from construction on: the whole arena is pinned while the engine starts, not while
it serves (pinning runs in the driver beside the step loop's launches), at the price of holding the
tier's full size from the start. `ahead_seconds` is then how long that took, once it is done.
Allocation takes the lowest free pages, so an entry's pages are few runs (one on a fresh arena) and
each run one copy per tensor piece.

`PageAllocator` is the bookkeeping alone (no torch): free runs sorted by start page, merged on free.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30

Run = tuple[int, int]  # (first page, number of pages)


class ArenaFull(RuntimeError):
    """More pages asked for than are free (the host tier's accounting and the arena disagree)."""


class PageAllocator:
    """Page ids 0 .. num_pages - 1, handed out as runs of consecutive pages, lowest first.

    Invariant: the free runs are sorted, disjoint, non-adjacent (merged) and inside the range; with
    the runs held by the entries they cover every page exactly once (`check_integrity`)."""

    def __init__(self, num_pages: int, pages_per_chunk: int) -> None:
        if num_pages < 0 or pages_per_chunk < 1:
            raise ValueError(f"an arena needs num_pages >= 0 and pages_per_chunk >= 1, got {num_pages}, "
                             f"{pages_per_chunk}")
        self.num_pages = num_pages
        self.pages_per_chunk = pages_per_chunk
        self._free: list[Run] = [(0, num_pages)] if num_pages else []
        self.num_free = num_pages

    def allocate(self, count: int) -> tuple[Run, ...]:
        """`count` pages as runs (lowest pages first; no run crosses a chunk boundary). Raises
        ArenaFull, changing nothing, when fewer are free."""
        if count > self.num_free:
            raise ArenaFull(f"the host arena has {self.num_free} free pages of {self.num_pages}, {count} asked for")
        taken: list[Run] = []
        need = count
        while need:
            start, length = self._free[0]
            used = min(length, need)
            if used == length:
                self._free.pop(0)
            else:
                self._free[0] = (start + used, length - used)
            taken.extend(self._split_at_chunks(start, used))
            need -= used
        self.num_free -= count
        return tuple(taken)

    def free(self, runs: Iterable[Run]) -> None:
        """Give runs back (merged with their free neighbours). Raises ValueError, changing nothing,
        for a run that is out of range or already free."""
        runs = sorted(runs)
        for (start, length), following in zip(runs, runs[1:] + [None]):
            if length < 1 or start < 0 or start + length > self.num_pages:
                raise ValueError(f"page run ({start}, {length}) is outside the arena's {self.num_pages} pages")
            i = bisect.bisect_left(self._free, (start, 0))
            before = self._free[i - 1] if i else None
            after = self._free[i] if i < len(self._free) else None
            if (before is not None and before[0] + before[1] > start) or (
                    after is not None and start + length > after[0]) or (
                    following is not None and start + length > following[0]):
                raise ValueError(f"page run ({start}, {length}) is freed twice")
        for start, length in runs:
            self.num_free += length
            i = bisect.bisect_left(self._free, (start, 0))
            if i and self._free[i - 1][0] + self._free[i - 1][1] == start:
                i -= 1
                start, length = self._free[i][0], self._free[i][1] + length
                self._free.pop(i)
            if i < len(self._free) and self._free[i][0] == start + length:
                length += self._free.pop(i)[1]
            self._free.insert(i, (start, length))

    def free_runs(self) -> tuple[Run, ...]:
        return tuple(self._free)

    def check_integrity(self, held: Iterable[Iterable[Run]]) -> None:
        """The free runs and the `held` entries' runs tile the pages exactly once; raises AssertionError."""
        runs = sorted([run for entry in held for run in entry] + self._free)
        at = 0
        for start, length in runs:
            if start != at or length < 1:
                raise AssertionError(f"host arena page {min(start, at)} is lost or held twice")
            at = start + length
        if at != self.num_pages:
            raise AssertionError(f"host arena pages {at} .. {self.num_pages - 1} are lost")
        if self.num_free != sum(n for _, n in self._free) or any(
                a[0] + a[1] >= b[0] for a, b in zip(self._free, self._free[1:])):
            raise AssertionError("host arena free runs are unsorted, unmerged or miscounted")

    def _split_at_chunks(self, start: int, length: int) -> list[Run]:
        runs, end = [], start + length
        while start < end:
            stop = min(end, (start // self.pages_per_chunk + 1) * self.pages_per_chunk)
            runs.append((start, stop - start))
            start = stop
        return runs


@dataclass(frozen=True)
class ArenaSpan:
    """The pages of one entry: `runs` in order hold its `num_bytes` bytes; run i starts at byte
    `starts[i]` of the entry (page_bytes times the pages of the runs before it)."""

    runs: tuple[Run, ...]
    num_bytes: int
    starts: tuple[int, ...]


class HostArena:
    """`num_pages` pages of `page_bytes` bytes (pinned when `pinned`), in chunks allocated on first use
    (and, with `prefetch`, the next one in the background), or with `ahead` all of them in the
    background from construction on."""

    def __init__(self, num_pages: int, page_bytes: int, pinned: bool, chunk_bytes: int = CHUNK_BYTES,
                 prefetch: bool = False, ahead: bool = False) -> None:
        if page_bytes < 1:
            raise ValueError(f"host arena pages need at least one byte, got {page_bytes}")
        self.page_bytes = page_bytes
        self.pinned = pinned
        self.pages_per_chunk = max(1, chunk_bytes // page_bytes)
        self.pages = PageAllocator(num_pages, self.pages_per_chunk)
        self._chunks: list[torch.Tensor | None] = [None] * -(-num_pages // self.pages_per_chunk)
        self._coming: dict[int, Future] = {}  # chunks being allocated in the background
        self._prefetcher = None
        self.ahead_seconds: float | None = None  # with `ahead`: seconds to allocate every chunk, once done
        if prefetch or ahead:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkpoint-host-arena")
            weakref.finalize(self, self._prefetcher.shutdown, wait=False)
        if ahead:
            began = time.perf_counter()
            for index in range(len(self._chunks)):
                self._coming[index] = self._prefetcher.submit(self._new_chunk, index)
            if self._coming:
                self._coming[len(self._chunks) - 1].add_done_callback(lambda last: self._ahead_done(last, began))
            else:
                self.ahead_seconds = 0.0

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    @property
    def allocated_bytes(self) -> int:
        """Host memory the arena holds now (its chunks taken so far, and any allocated ahead)."""
        ahead = sum(c.result().numel() for c in self._coming.values() if c.done() and c.exception() is None)
        return sum(chunk.numel() for chunk in self._chunks if chunk is not None) + ahead

    def settle(self) -> set[int]:
        """Wait for the chunks being allocated in the background; returns their indices (for tests
        and benchmarks: the arena itself waits only for a chunk it needs)."""
        for coming in self._coming.values():
            coming.exception()
        return set(self._coming)

    def allocate(self, num_bytes: int) -> ArenaSpan:
        """Pages for `num_bytes` bytes (ArenaFull when they are not free)."""
        runs = self.pages.allocate(-(-num_bytes // self.page_bytes))
        try:
            for start, _ in runs:
                self._chunk(start // self.pages_per_chunk)
        except BaseException:
            self.pages.free(runs)
            raise
        starts, at = [], 0
        for _, count in runs:
            starts.append(at)
            at += count * self.page_bytes
        return ArenaSpan(runs, num_bytes, tuple(starts))

    def free(self, span: ArenaSpan) -> None:
        self.pages.free(span.runs)

    def pieces(self, span: ArenaSpan, offset: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """The bytes [offset, offset + length) of an entry as (offset in that range, uint8 view of
        arena memory) pairs, in order: one per page run the range touches."""
        if offset < 0 or offset + length > span.num_bytes:
            raise ValueError(f"bytes {offset}..{offset + length} are outside an entry of {span.num_bytes} bytes")
        pieces, end = [], offset + length
        first = max(bisect.bisect_right(span.starts, offset) - 1, 0)
        for (start, count), run_begin in zip(span.runs[first:], span.starts[first:]):
            run_end = run_begin + count * self.page_bytes
            lo, hi = max(offset, run_begin), min(end, run_end)
            if lo < hi:
                chunk = self._chunk(start // self.pages_per_chunk)
                base = (start % self.pages_per_chunk) * self.page_bytes + lo - run_begin
                pieces.append((lo - offset, chunk[base: base + hi - lo]))
            if run_end >= end:
                break
        return pieces

    def read(self, span: ArenaSpan) -> torch.Tensor:
        """A new CPU uint8 tensor of the entry's bytes (a copy; for checks and tests)."""
        out = torch.empty(span.num_bytes, dtype=torch.uint8)
        for at, piece in self.pieces(span, 0, span.num_bytes):
            out[at: at + piece.numel()].copy_(piece)
        return out

    def check_integrity(self, held: Iterable[ArenaSpan]) -> None:
        spans = list(held)
        self.pages.check_integrity(span.runs for span in spans)
        for span in spans:
            if sum(n for _, n in span.runs) != -(-span.num_bytes // self.page_bytes):
                raise AssertionError(f"a host entry of {span.num_bytes} bytes holds the wrong number of pages")

    def _chunk(self, index: int) -> torch.Tensor:
        chunk = self._chunks[index]
        if chunk is None:
            coming = self._coming.pop(index, None)
            chunk = coming.result() if coming is not None else self._new_chunk(index)
            self._chunks[index] = chunk
            following = index + 1
            if self._prefetcher is not None and following < len(self._chunks) and \
                    self._chunks[following] is None and following not in self._coming:
                self._coming[following] = self._prefetcher.submit(self._new_chunk, following)
        return chunk

    def _ahead_done(self, last: Future, began: float) -> None:
        """The background thread allocated the last chunk (or failed to): log what was pinned and how fast."""
        self.ahead_seconds = time.perf_counter() - began
        total = self.num_pages * self.page_bytes
        if last.exception() is not None:
            logger.warning("host tier: allocating %.1f GiB ahead failed after %.1f s: %s", total / 2**30,
                           self.ahead_seconds, last.exception())
            return
        logger.info("host tier: %.1f GiB %s ahead in %.1f s (%.2f GB/s), off the step loop", total / 2**30,
                    "pinned" if self.pinned else "allocated", self.ahead_seconds,
                    total / 1e9 / max(self.ahead_seconds, 1e-9))

    def _new_chunk(self, index: int) -> torch.Tensor:
        pages = min(self.pages_per_chunk, self.num_pages - index * self.pages_per_chunk)
        return torch.empty(pages * self.page_bytes, dtype=torch.uint8, pin_memory=self.pinned)
