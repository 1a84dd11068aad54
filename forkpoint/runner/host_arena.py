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
up to a power of two: chunks of about 1 GiB waste less than a page each). Two ways to get them:

- on first use (the default): a chunk is allocated the first time one of its pages is handed out
  and kept for the arena's life: the arena pins memory only as far as the tier has ever filled, and
  never twice. With `prefetch` the chunk after the one just taken is allocated at once on a
  background thread, so the tier fills without waiting unless it fills faster than memory is pinned.
- `ahead`: every chunk, in order, on `pin_threads` background threads from construction on
  (runner/host_pinning.py), at the price of holding the tier's full size from the start. The arena
  hands out only pages of the chunks pinned so far, a prefix (`usable_pages()`, which only grows):
  the host tier's directory keeps its entries within it (cache/host_tier.py `limit_pages`), so a
  spill never waits for pinning and never lands in memory not yet pinned; one that does not fit
  is handled as in a full tier. A chunk that fails to pin ends the pinning; the tier keeps what
  was pinned before it. `ahead_seconds` is how long the pinning took, once it is over.

Allocation takes the lowest free pages, so an entry's pages are few runs (one on a fresh arena) and
each run one copy per tensor piece.

`PageAllocator` is the bookkeeping alone (no torch): free runs sorted by start page, merged on free.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from forkpoint.runner.host_pinning import ChunkPinner

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30
# Threads pinning a tier ahead. Conservative until measured: bench/pin_contention.py's rows of 1, 2, 4
# and 8 threads on the H200 (total GB/s, and the launch stalls beside them) decide it.
PIN_THREADS = 4

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


def host_chunk(num_bytes: int, pinned: bool) -> torch.Tensor:
    """`num_bytes` of (pinned when `pinned`) host memory: PyTorch's pinned allocator, cudaHostAlloc."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)


class HostArena:
    """`num_pages` pages of `page_bytes` bytes (pinned when `pinned`), in chunks allocated on first use
    (and, with `prefetch`, the next one in the background), or with `ahead` all of them in the
    background from construction on, on `pin_threads` threads (module docstring).
    `allocate_chunk(num_bytes, pinned)` allocates one chunk (tests give one that is slow or fails).

    Invariants (`check_integrity`): the free runs and the entries' runs tile the pages once; with
    `ahead`, every page at or past `usable_pages` is free and every chunk below it is held."""

    def __init__(self, num_pages: int, page_bytes: int, pinned: bool, chunk_bytes: int = CHUNK_BYTES,
                 prefetch: bool = False, ahead: bool = False, pin_threads: int = PIN_THREADS,
                 allocate_chunk: Callable[[int, bool], torch.Tensor] = host_chunk) -> None:
        if page_bytes < 1:
            raise ValueError(f"host arena pages need at least one byte, got {page_bytes}")
        self.page_bytes = page_bytes
        self.pinned = pinned
        self.ahead = ahead
        self.pages_per_chunk = max(1, chunk_bytes // page_bytes)
        self.pages = PageAllocator(num_pages, self.pages_per_chunk)
        self._allocate_chunk = allocate_chunk
        self._chunks: list[torch.Tensor | None] = [None] * -(-num_pages // self.pages_per_chunk)
        self._coming: dict[int, Future] = {}  # on first use: chunks being prefetched
        self._prefetcher = None
        self._pinner = None
        self._ready_chunks = 0  # ahead: chunks 0 .. this - 1 are pinned and in `_chunks`
        if prefetch and not ahead:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkpoint-host-arena")
            weakref.finalize(self, self._prefetcher.shutdown, wait=False, cancel_futures=True)
        if ahead:
            self._pinner = ChunkPinner([self._chunk_pages(i) * page_bytes for i in range(len(self._chunks))],
                                       partial(allocate_chunk, pinned=pinned), pin_threads,
                                       partial(_log_ahead, num_pages * page_bytes, pinned))

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def usable_pages(self) -> int:
        """Pages the arena may hand out now: all of them on first use; with `ahead`, those of the
        chunks pinned so far (a prefix: it only grows). Takes in the chunks pinned since last asked."""
        if self._pinner is None:
            return self.num_pages
        while self._ready_chunks < len(self._chunks):
            chunk = self._pinner.ready(self._ready_chunks)
            if chunk is None:
                break
            self._chunks[self._ready_chunks] = chunk
            self._ready_chunks += 1
        return min(self.num_pages, self._ready_chunks * self.pages_per_chunk)

    @property
    def ahead_seconds(self) -> float | None:
        """With `ahead`: seconds the pinning took, once it is over (every chunk, a failure or `close`)."""
        return self._pinner.seconds if self._pinner is not None else None

    @property
    def allocated_bytes(self) -> int:
        """Host memory the arena holds now (its chunks taken so far, and any allocated ahead)."""
        if self._pinner is not None:
            return self._pinner.allocated_bytes()
        ahead = sum(c.result().numel() for c in self._coming.values() if c.done() and c.exception() is None)
        return sum(chunk.numel() for chunk in self._chunks if chunk is not None) + ahead

    def settle(self) -> set[int]:
        """Wait for the chunks being allocated in the background; returns the indices of those now
        held (for tests and benchmarks: the arena itself never waits for pinning ahead)."""
        if self._pinner is not None:
            self._pinner.wait()
            self.usable_pages()
            return set(range(self._ready_chunks))
        for coming in self._coming.values():
            coming.exception()
        return {index for index, coming in self._coming.items() if coming.exception() is None}

    def close(self) -> None:
        """Stop pinning ahead (each thread finishes its chunk) and join the threads; the pages pinned
        so far stay usable. Idempotent."""
        if self._pinner is not None:
            self._pinner.close()

    def allocate(self, num_bytes: int) -> ArenaSpan:
        """Pages for `num_bytes` bytes (ArenaFull when they are not free, or with `ahead` not pinned yet)."""
        count = -(-num_bytes // self.page_bytes)
        unpinned = self.num_pages - self.usable_pages()  # ahead: all free (nothing is handed out past the prefix)
        if count > self.pages.num_free - unpinned:
            raise ArenaFull(f"the host arena has {self.pages.num_free - unpinned} free pinned pages "
                            f"({unpinned} of its {self.num_pages} not pinned yet), {count} asked for")
        runs = self.pages.allocate(count)  # the lowest free pages: all below the pinned prefix
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
        if self._pinner is not None:
            usable = min(self.num_pages, self._ready_chunks * self.pages_per_chunk)
            if any(start + count > usable for span in spans for start, count in span.runs):
                raise AssertionError(f"a host entry holds pages past the {usable} pinned so far")
            if any((chunk is None) != (index >= self._ready_chunks) for index, chunk in enumerate(self._chunks)):
                raise AssertionError("the host arena's pinned chunks are not the prefix it hands pages out of")

    def _chunk(self, index: int) -> torch.Tensor:
        chunk = self._chunks[index]
        if chunk is None:
            if self._pinner is not None:  # (allocate hands out pinned pages only)
                raise AssertionError(f"host arena chunk {index} is used before it is pinned")
            coming = self._coming.pop(index, None)
            chunk = coming.result() if coming is not None else self._new_chunk(index)
            self._chunks[index] = chunk
            following = index + 1
            if self._prefetcher is not None and following < len(self._chunks) and \
                    self._chunks[following] is None and following not in self._coming:
                self._coming[following] = self._prefetcher.submit(self._new_chunk, following)
        return chunk

    def _chunk_pages(self, index: int) -> int:
        return min(self.pages_per_chunk, self.num_pages - index * self.pages_per_chunk)

    def _new_chunk(self, index: int) -> torch.Tensor:
        return self._allocate_chunk(self._chunk_pages(index) * self.page_bytes, self.pinned)


def _log_ahead(total_bytes: int, pinned: bool, seconds: float, usable_chunks: int, error: Exception | None) -> None:
    """The pinning ahead is over (runs on its last thread): log what was pinned and how fast."""
    if error is not None:
        logger.warning("host tier: allocating %.1f GiB ahead failed at chunk %d after %.1f s (%s); the tier "
                       "holds what was allocated before it", total_bytes / 2**30, usable_chunks, seconds, error)
        return
    logger.info("host tier: %.1f GiB %s ahead in %.1f s (%.2f GB/s), off the step loop", total_bytes / 2**30,
                "pinned" if pinned else "allocated", seconds, total_bytes / 1e9 / max(seconds, 1e-9))
