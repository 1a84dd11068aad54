"""The host tier pinned ahead while it serves (runner/host_arena.py `ahead`, runner/host_pinning.py):
several threads allocate every chunk once, in order of need; the arena hands out only pages of the
chunks pinned so far, and the tier's directory (cache/host_tier.py `limit_pages`) keeps its entries
within them, so spills decided while the tier is still pinned never wait and never fail; a chunk that
fails to pin ends the pinning with what came before it usable; closing, collecting the arena or
leaving the interpreter while it pins stops the threads after their current chunk."""

from __future__ import annotations

import gc
import logging
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from forkpoint.runner.host_arena import ArenaFull, HostArena
from forkpoint.runner.host_copies import ArenaHostCopies
from forkpoint.step.plan import HostDrop, Spill
from tests.runner.test_host_copies import SIZES, _filled, host_tier, random_writes


class Allocations:
    """A chunk allocator for tests: records each call's size and thread; with `gated`, each call
    first takes a permit (`allow(n)` gives n), so a test decides how far the pinning gets."""

    def __init__(self, gated: bool = False, fail_at_call: int | None = None, delay_s: float = 0.0) -> None:
        self.sizes: list[int] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._permits = threading.Semaphore(0) if gated else None
        self._fail_at_call = fail_at_call
        self._delay_s = delay_s

    def allow(self, count: int) -> None:
        for _ in range(count):
            self._permits.release()

    def __call__(self, num_bytes: int, pinned: bool) -> torch.Tensor:
        if self._permits is not None:
            self._permits.acquire()
        time.sleep(self._delay_s)
        with self._lock:
            call = len(self.sizes)
            self.sizes.append(num_bytes)
            self.threads.add(threading.current_thread().name)
        if call == self._fail_at_call:
            raise RuntimeError("pinned allocation failed")
        return torch.full((num_bytes,), 7, dtype=torch.uint8)


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.002)


def test_parallel_pinning_allocates_every_chunk_exactly_once():
    allocations = Allocations(delay_s=0.03)
    arena = HostArena(num_pages=37, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=4,
                      allocate_chunk=allocations)  # 10 chunks of 4 pages, the last of 1
    assert arena.settle() == set(range(10)) and arena.usable_pages() == 37
    assert sorted(allocations.sizes) == sorted([16] * 9 + [4])
    assert len(allocations.threads) == 4  # (30 ms a chunk: every thread took some)
    assert arena.allocated_bytes == 37 * 4
    span = arena.allocate(37 * 4)
    assert [count for _, count in span.runs] == [4] * 9 + [1]
    arena.check_integrity([span])


def test_allocations_use_only_pinned_pages_and_are_refused_past_them_without_waiting():
    allocations = Allocations(gated=True)
    arena = HostArena(num_pages=12, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=1,
                      allocate_chunk=allocations)  # 3 chunks of 4 pages
    assert arena.usable_pages() == 0
    with pytest.raises(ArenaFull, match="0 free pinned pages .12 of its 12 not pinned yet., 1 asked for"):
        arena.allocate(1)
    arena.check_integrity([])
    allocations.allow(1)
    _wait_until(lambda: arena.usable_pages() == 4)
    first = arena.allocate(10)  # 3 of the 4 pinned pages
    began = time.perf_counter()
    with pytest.raises(ArenaFull, match="1 free pinned pages"):
        arena.allocate(8)  # 2 pages: one is not pinned yet
    assert time.perf_counter() - began < 0.5  # refused at once, not after the pinning
    arena.check_integrity([first])
    allocations.allow(2)
    assert arena.settle() == {0, 1, 2}
    second = arena.allocate(20)  # 5 pages: the free one of chunk 0, then chunk 1
    assert second.runs == ((3, 1), (4, 4)) and arena.ahead_seconds is not None
    arena.check_integrity([first, second])


def test_a_chunk_that_fails_to_pin_ends_the_pinning_and_keeps_what_came_before(caplog):
    allocations = Allocations(fail_at_call=2)  # the third allocation, chunk 2 with one thread
    with caplog.at_level(logging.WARNING, logger="forkpoint.runner.host_arena"):
        arena = HostArena(num_pages=20, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=1,
                          allocate_chunk=allocations)  # 5 chunks
        assert arena.settle() == {0, 1}
    assert len(allocations.sizes) == 3  # chunks 3 and 4 were never allocated
    assert arena.usable_pages() == 8 and arena.allocated_bytes == 32
    assert [r.message for r in caplog.records if "failed at chunk 2" in r.message]
    kept = arena.allocate(30)  # 8 pages: all that is pinned
    with pytest.raises(ArenaFull):
        arena.allocate(1)
    arena.check_integrity([kept])
    arena.free(kept)
    arena.check_integrity([])


def test_with_several_threads_a_failure_lets_the_chunks_after_it_go():
    allocations = Allocations(fail_at_call=0, delay_s=0.02)  # the first call fails; others pin meanwhile
    arena = HostArena(num_pages=32, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=4,
                      allocate_chunk=allocations)  # 8 chunks
    arena.settle()
    # some chunk (whichever thread called first) failed: the usable prefix ends before it, nothing
    # allocated past it is held, and no chunk after the threads saw the failure is allocated
    failed = arena._pinner.failed_chunk
    assert failed is not None and arena.usable_pages() == 4 * failed
    assert arena.allocated_bytes == 16 * failed and len(allocations.sizes) < 8
    arena.check_integrity([])


def test_close_while_pinning_stops_the_threads_after_their_chunk():
    allocations = Allocations(delay_s=0.05)
    arena = HostArena(num_pages=400, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=2,
                      allocate_chunk=allocations)  # 100 chunks: 2.5 s to pin
    _wait_until(lambda: arena.usable_pages() >= 8)
    began = time.perf_counter()
    arena.close()
    assert time.perf_counter() - began < 0.5  # one chunk per thread at most
    assert arena._pinner.done and arena.ahead_seconds is not None
    assert not [t for t in threading.enumerate() if t.name.startswith("forkpoint-host-pin")]
    count = len(allocations.sizes)
    time.sleep(0.15)
    assert len(allocations.sizes) == count < 100
    usable = arena.usable_pages()  # what was pinned stays usable
    span = arena.allocate(usable * 4)
    arena.check_integrity([span])
    arena.close()  # idempotent


def test_an_arena_collected_while_pinning_stops_its_threads():
    allocations = Allocations(delay_s=0.05)
    arena = HostArena(num_pages=400, page_bytes=4, pinned=False, chunk_bytes=16, ahead=True, pin_threads=2,
                      allocate_chunk=allocations)
    _wait_until(lambda: len(allocations.sizes) >= 2)
    del arena
    gc.collect()
    _wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("forkpoint-host-pin")])
    assert len(allocations.sizes) < 100


def test_leaving_the_interpreter_while_pinning_does_not_wait_for_the_tier():
    """A worker pool's queue is drained at interpreter exit: 100 chunks of 0.1 s would hold the exit
    for 10 s. The pinning threads stop after their chunk instead."""
    script = textwrap.dedent("""
        import time, torch
        from forkpoint.runner.host_arena import HostArena
        def slow(num_bytes, pinned):
            time.sleep(0.1)
            return torch.empty(num_bytes, dtype=torch.uint8)
        arena = HostArena(num_pages=100, page_bytes=4, pinned=False, chunk_bytes=4, ahead=True, pin_threads=1,
                          allocate_chunk=slow)
        time.sleep(0.25)
        print("leaving", arena.usable_pages() < 100, flush=True)
        began = time.perf_counter()
        import atexit
        atexit.register(lambda: print("exit took", round(time.perf_counter() - began, 2), flush=True))
    """)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])  # (this checkout's forkpoint)
    assert done.returncode == 0, done.stderr
    assert "leaving True" in done.stdout
    assert time.perf_counter() - began < 8.0  # (the import of torch takes a few seconds on 2 cores)
    exit_s = float(done.stdout.split("exit took")[1])
    assert exit_s < 1.0


@pytest.mark.parametrize("seed", range(4))
def test_spills_decided_within_the_pinned_pages_always_fit_while_the_tier_is_pinned(seed):
    """The engine's loop (engine/engine.py `_follow_host_pinning`): before each plan, the tier's page
    limit follows what is pinned; the plan's writes are then applied to an arena still pinning.
    No spill is refused by the arena, the arena's and the tier's pages agree, integrity holds."""
    rng = random.Random(seed)
    capacity = rng.choice([3000, 10_000])
    tier = host_tier(capacity)
    storage = _filled(capacity, seed)
    host = storage.host
    assert isinstance(host, ArenaHostCopies)
    allocations = Allocations(gated=True)
    host.arena = HostArena(host.arena.num_pages, host.arena.page_bytes, pinned=False,
                           chunk_bytes=3 * host.arena.page_bytes, ahead=True, pin_threads=1,
                           allocate_chunk=allocations)  # chunks of 3 pages
    chunks = len(host.arena._chunks)
    first, spills, dropped_for_room = 0, 0, 0
    for phase in range(chunks + 1):
        tier.limit_pages(host.arena.page_bytes, host.arena.usable_pages())
        before = tier.counters.dropped
        writes = random_writes(rng, tier, 25, SIZES)
        dropped_for_room += tier.counters.dropped - before
        spills += sum(isinstance(w, Spill) for w in writes)
        storage.apply(writes, first=first)
        first += len(writes)
        storage.check_integrity()
        tier.check_integrity()
        used = host.arena.num_pages - host.arena.pages.num_free
        assert used == tier.num_pages <= tier.page_limit.pages <= host.arena.usable_pages()
        clear = [HostDrop(e) for e in tier.clear()]  # (random_writes restores only what it spilled itself)
        storage.apply(clear, first=first)
        first += len(clear)
        storage.check_integrity()
        allocations.allow(1)
        pinned = min(host.arena.num_pages, 3 * (phase + 1))
        _wait_until(lambda: host.arena.usable_pages() >= pinned)  # noqa: B023 (called before the loop goes on)
    assert spills and dropped_for_room  # spills happened, and some were refused or made room, as in a full tier
    assert sorted(host) == sorted(tier.entry_ids()) == []
