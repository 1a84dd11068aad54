"""The host tier's arena (runner/host_arena.py): page runs handed out lowest first and merged back,
chunks allocated on first use, entries' bytes read back through their runs; a random sequence of
allocations and frees against a set-of-pages model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.runner.host_arena import ArenaFull, HostArena, PageAllocator


def test_runs_lowest_first_split_at_chunks_and_merged_on_free():
    pages = PageAllocator(10, pages_per_chunk=4)
    a = pages.allocate(3)
    b = pages.allocate(3)  # pages 3..5 cross the chunk boundary at 4
    assert a == ((0, 3),) and b == ((3, 1), (4, 2))
    pages.free(a)
    c = pages.allocate(5)  # the hole first, then what follows b
    assert c == ((0, 3), (6, 2)) and pages.num_free == 2
    pages.free(b)
    pages.free(c)
    assert pages.free_runs() == ((0, 10),) and pages.num_free == 10
    pages.check_integrity([])


def test_full_double_free_and_out_of_range_change_nothing():
    pages = PageAllocator(6, pages_per_chunk=6)
    a = pages.allocate(4)
    with pytest.raises(ArenaFull, match="2 free pages of 6, 3 asked for"):
        pages.allocate(3)
    assert pages.num_free == 2
    pages.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        pages.free(a)
    with pytest.raises(ValueError, match="outside"):
        pages.free([(5, 2)])
    b = pages.allocate(2)
    with pytest.raises(ValueError, match="freed twice"):  # the second run is free: nothing is freed
        pages.free([b[0], (4, 1)])
    assert pages.num_free == 4
    pages.check_integrity([b])
    with pytest.raises(AssertionError, match="lost"):
        pages.check_integrity([])
    with pytest.raises(AssertionError, match="held twice"):
        pages.check_integrity([b, b])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 7)), max_size=40),
       st.integers(1, 5))
def test_random_allocations_and_frees_match_a_page_set(ops, per_chunk):
    pages = PageAllocator(24, per_chunk)
    held: list[tuple[tuple[int, int], ...]] = []
    used: set[int] = set()
    for allocate, which, count in ops:
        if allocate:
            if count > 24 - len(used):
                with pytest.raises(ArenaFull):
                    pages.allocate(count)
                continue
            runs = pages.allocate(count)
            got = {p for start, n in runs for p in range(start, start + n)}
            assert len(got) == count and not got & used
            assert got == set(sorted(set(range(24)) - used)[:count])  # the lowest free pages
            assert all(start // per_chunk == (start + n - 1) // per_chunk for start, n in runs)
            used |= got
            held.append(runs)
        elif held:
            runs = held.pop(which % len(held))
            pages.free(runs)
            used -= {p for start, n in runs for p in range(start, start + n)}
        assert pages.num_free == 24 - len(used)
        pages.check_integrity(held)


def test_arena_bytes_round_trip_through_scattered_runs_and_chunks_on_first_use():
    arena = HostArena(num_pages=8, page_bytes=5, pinned=False, chunk_bytes=15)  # 3 pages a chunk
    assert arena.allocated_bytes == 0
    first = arena.allocate(7)  # 2 pages: chunk 0
    assert arena.allocated_bytes == 15
    hole = arena.allocate(5)
    second = arena.allocate(22)  # 5 pages: pages 3..7, chunks 1 and 2
    arena.free(hole)
    third = arena.allocate(4)  # page 2, freed just now
    assert third.runs == ((2, 1),) and second.runs == ((3, 3), (6, 2))
    assert arena.allocated_bytes == 40
    data = torch.arange(22, dtype=torch.uint8) + 100
    for at, piece in arena.pieces(second, 0, 22):
        piece.copy_(data[at: at + piece.numel()])
    assert torch.equal(arena.read(second), data)
    assert [(at, p.numel()) for at, p in arena.pieces(second, 12, 9)] == [(0, 3), (3, 6)]
    with pytest.raises(ValueError, match="outside an entry of 22 bytes"):
        arena.pieces(second, 20, 3)
    arena.check_integrity([first, second, third])
    arena.free(first)
    with pytest.raises(AssertionError):
        arena.check_integrity([first, second, third])


def test_prefetch_allocates_the_next_chunk_in_the_background_and_only_that_one():
    arena = HostArena(num_pages=9, page_bytes=4, pinned=False, chunk_bytes=12, prefetch=True)  # 3 chunks
    assert arena.allocated_bytes == 0  # nothing before the first use
    first = arena.allocate(8)  # pages 0, 1: chunk 0, and chunk 1 comes
    arena._coming[1].result()  # (the test waits for the background allocation)
    assert arena.allocated_bytes == 24 and 2 not in arena._coming
    second = arena.allocate(12)  # pages 2..4: takes chunk 1 from the prefetcher, prefetches chunk 2
    assert arena.settle() == {2} and arena.allocated_bytes == 36
    data = torch.arange(12, dtype=torch.uint8)
    for at, piece in arena.pieces(second, 0, 12):
        piece.copy_(data[at: at + piece.numel()])
    assert torch.equal(arena.read(second), data)
    arena.check_integrity([first, second])


def test_ahead_allocates_every_chunk_in_the_background_from_construction():
    arena = HostArena(num_pages=9, page_bytes=4, pinned=False, chunk_bytes=12, ahead=True)  # 3 chunks
    assert arena.settle() == {0, 1, 2}
    assert arena.allocated_bytes == 36 and arena.ahead_seconds is not None and arena.ahead_seconds >= 0
    first = arena.allocate(30)  # pages 0..7 over all three chunks, each taken from the background's
    assert first.runs == ((0, 3), (3, 3), (6, 2)) and arena.allocated_bytes == 36 and not arena._coming
    data = torch.arange(30, dtype=torch.uint8)
    for at, piece in arena.pieces(first, 0, 30):
        piece.copy_(data[at: at + piece.numel()])
    assert torch.equal(arena.read(first), data)
    arena.check_integrity([first])


def test_ahead_that_fails_fails_the_allocation_that_needs_the_chunk_and_frees_its_pages(monkeypatch):
    failing = HostArena.__dict__["_new_chunk"]

    def no_memory(self, index):
        if index == 1:
            raise RuntimeError("pinned allocation failed")
        return failing(self, index)

    monkeypatch.setattr(HostArena, "_new_chunk", no_memory)
    arena = HostArena(num_pages=6, page_bytes=4, pinned=False, chunk_bytes=12, ahead=True)  # 2 chunks
    arena.settle()
    assert arena.ahead_seconds is not None
    kept = arena.allocate(12)  # chunk 0 only
    with pytest.raises(RuntimeError, match="pinned allocation failed"):
        arena.allocate(4)
    assert arena.pages.num_free == 3
    arena.check_integrity([kept])
