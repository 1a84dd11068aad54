"""`ChunkPinner`: the host tier's memory allocated ahead, chunk by chunk, on background threads.

A tier pinned ahead (runner/host_arena.py `HostArena(ahead=True)`) is tens of GiB; PyTorch's pinned
allocation (cudaHostAlloc) of one 1 GiB chunk takes about half a second on one thread, so the whole
tier takes many seconds. The engine serves meanwhile: the arena uses the chunks pinned so far, a
prefix 0 .. k - 1 (`ready_prefix`), and never waits for one.

    threads:  t0: chunk 0, chunk 4, ...      each thread takes the lowest chunk no thread has taken,
              t1: chunk 1, chunk 5, ...      so chunks finish roughly in order of need
              ...
    prefix:   chunks 0 .. k - 1 all allocated (the arena's usable memory; k only grows)

A chunk whose allocation raises (out of pinned memory, a driver error) stops the pinning: the chunks
before it are kept, those after it are not allocated, or let go when a thread already had them (the
arena could never use them: its usable memory is a prefix). `close` stops the threads after the chunk
each is allocating and joins them; it also runs when the pinner is collected and at interpreter exit.
The threads are daemons that hold no reference to the arena, so neither an unclosed arena nor the
process's exit waits for the rest of the tier to be pinned.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

Finished = Callable[[float, int, Exception | None], None]  # (seconds, chunks usable, the failure if any)


class _Shared:
    """What the threads, the pinner and its finalizer share (never the pinner itself: the pinner is
    collected, and closed, while its threads run).

    Invariants (under `lock`): chunks at or past `limit` are None; `limit` only falls (a failure);
    the chunks before the first None are the ready prefix, which only grows."""

    def __init__(self, sizes: Sequence[int], allocate: Callable[[int], torch.Tensor], threads: int,
                 finished: Finished | None) -> None:
        self.sizes = list(sizes)
        self.allocate = allocate
        self.on_finished = finished
        self.lock = threading.Lock()
        self.stopped = threading.Condition(self.lock)
        self.chunks: list[torch.Tensor | None] = [None] * len(self.sizes)
        self.next = 0  # the lowest chunk no thread has taken
        self.limit = len(self.sizes)  # chunks at or past it are never allocated
        self.closed = False
        self.taking = threads  # threads still taking chunks
        self.running = threads  # threads not yet stopped (after `finished` ran)
        self.began = time.perf_counter()
        self.error: Exception | None = None  # the first failed allocation's
        self.failed_chunk: int | None = None
        self.seconds: float | None = None if threads else 0.0  # once every thread has stopped


class ChunkPinner:
    """Allocates chunks 0 .. len(sizes) - 1 of `sizes[i]` bytes each with `allocate(num_bytes)` on
    `threads` daemon threads (at most one per chunk), lowest index first (module docstring).
    `finished(seconds, usable chunks, error)` runs once on the last thread when the pinning ends by
    itself (every chunk allocated, or a failure), not after `close`."""

    def __init__(self, sizes: Sequence[int], allocate: Callable[[int], torch.Tensor], threads: int,
                 finished: Finished | None = None) -> None:
        if threads < 1:
            raise ValueError(f"pinning ahead needs at least one thread, got {threads}")
        self._shared = shared = _Shared(sizes, allocate, min(threads, len(sizes)), finished)
        self._threads = [threading.Thread(target=_run, args=(shared,), name=f"forkpoint-host-pin-{i}", daemon=True)
                         for i in range(shared.running)]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, shared, self._threads)

    @property
    def num_chunks(self) -> int:
        return len(self._shared.sizes)

    @property
    def done(self) -> bool:
        """Every thread has stopped (all chunks allocated, a failure, or `close`)."""
        with self._shared.lock:
            return self._shared.running == 0

    @property
    def seconds(self) -> float | None:
        """From construction until every thread stopped; None while one runs."""
        return self._shared.seconds

    @property
    def error(self) -> Exception | None:
        """The first failed allocation's exception (None without one)."""
        return self._shared.error

    @property
    def failed_chunk(self) -> int | None:
        return self._shared.failed_chunk

    def ready(self, index: int) -> torch.Tensor | None:
        """Chunk `index` when it is allocated and usable (before any failed chunk), else None; never waits."""
        with self._shared.lock:
            return self._shared.chunks[index]

    def allocated_bytes(self) -> int:
        """Bytes of the usable chunks allocated so far (the ready prefix and any allocated past it)."""
        with self._shared.lock:
            return sum(chunk.numel() * chunk.element_size() for chunk in self._shared.chunks if chunk is not None)

    def wait(self) -> None:
        """Block until every thread has stopped (for benchmarks and tests: the arena never waits)."""
        shared = self._shared
        with shared.stopped:
            while shared.running:
                shared.stopped.wait()

    def close(self) -> None:
        """Stop taking chunks and join the threads (each finishes the chunk it is allocating); the
        chunks allocated so far are kept. Idempotent."""
        self._finalizer()


def _run(shared: _Shared) -> None:
    """One pinning thread: take the lowest chunk not taken, allocate it, until none is left or closed.
    It counts itself stopped whatever happens (a waiter never waits for a thread that died)."""
    try:
        _take_chunks(shared)
    finally:
        _stopping(shared)


def _take_chunks(shared: _Shared) -> None:
    while True:
        with shared.lock:
            if shared.closed or shared.next >= shared.limit:
                return
            index = shared.next
            shared.next += 1
        try:
            chunk = shared.allocate(shared.sizes[index])
        except Exception as error:  # out of pinned memory, a driver error: keep what came before
            with shared.lock:
                if index < shared.limit:  # (else an earlier chunk failed first)
                    shared.limit, shared.error, shared.failed_chunk = index, error, index
                    shared.chunks[index + 1:] = [None] * (len(shared.chunks) - index - 1)
            continue
        with shared.lock:
            if index < shared.limit:
                shared.chunks[index] = chunk


def _stopping(shared: _Shared) -> None:
    """The thread's last step: the last one to stop times the pinning and reports it (unless closed)."""
    with shared.lock:
        shared.taking -= 1
        last = shared.taking == 0
        if last:
            shared.seconds = time.perf_counter() - shared.began
        report = last and not shared.closed and shared.on_finished is not None
    try:
        if report:  # (before `wait` returns: a waiter sees the pinning reported)
            shared.on_finished(shared.seconds, shared.limit, shared.error)
    finally:
        with shared.stopped:
            shared.running -= 1
            if shared.running == 0:
                shared.stopped.notify_all()


def _stop(shared: _Shared, threads: list[threading.Thread]) -> None:
    """`close`, and the pinner's finalizer (when it is collected, and at interpreter exit)."""
    with shared.lock:
        shared.closed = True
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
