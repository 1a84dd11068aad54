"""The host tier's copies: a spilled checkpoint's state row and KV blocks in host memory.

Two implementations of one job (the plan's `Spill`, `Restore` and `HostDrop` writes, step/plan.py):

- `PlainHostCopies`, the reference and the CPU path: each spill copies into new host tensors, in
  order on the current stream; a restore copies them back.
- `ArenaHostCopies`, the CUDA path (the CPU runs it too, synchronously, in tests): entries live in
  a `HostArena` of pinned pages (runner/host_arena.py) and move on a dedicated copy stream:

      compute stream  ..forward s-1..| E0 |  apply(s): wait(D1) before writing a spilled row | forward s
      copy stream                        wait(E0) -> D2H spill -> D1    wait(E0') -> H2D restore -> D2
                                                                                   compute waits(D2)

  A spill waits for the compute stream's work so far (the row's last writer), copies the row, then
  the blocks, into pages and records an event after each (D1 above is the last). Until they
  complete, the compute stream must not write the row or the blocks again: `wait_for(rows, blocks)`
  makes it wait (on the GPU; the host never blocks) before a later write or forward touches them,
  and events that completed are retired.
  A restore waits for the compute stream (its row and blocks may have been read until now), copies
  host -> device on the copy stream and the compute stream waits for its event before anything
  later: the step that reads the row runs after it. The pages of a restored or dropped entry are
  free at once: every device copy touching pages runs on the one copy stream, in order, so a later
  spill into them follows the restore that read them. Host code reads an entry only after its
  event (`copies`).

An entry's bytes are the disk tier's payload layout (runner/disk_io.py): conv [L, *conv_shape],
ssm [L, *ssm_shape], then k[j], v[j] [n_blocks, block_size, HKV, Dh] per attention layer j.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from forkpoint.runner.disk_io import payload_tensors, split_payload
from forkpoint.runner.host_arena import ArenaSpan, HostArena
from forkpoint.step.plan import Restore, Spill


@dataclass(frozen=True)
class HostCopy:
    """One host entry's tensors: conv [L, ...], ssm [L, ...], k / v per attention layer [n_blocks, ...]."""

    conv: torch.Tensor
    ssm: torch.Tensor
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PoolTensors:
    """The storage's device pools that the host tier copies from and to (runner/storage.py)."""

    conv_stack: torch.Tensor  # [L, rows, *conv_shape]
    ssm_stack: torch.Tensor  # [L, rows, *ssm_shape]
    k: tuple[torch.Tensor, ...]  # [num_blocks + 1, block_size, HKV, Dh] per attention layer
    v: tuple[torch.Tensor, ...]

    @property
    def device(self) -> torch.device:
        return self.conv_stack.device

    def kv(self) -> list[torch.Tensor]:
        """k0, v0, k1, v1, ...: the payload order."""
        return [t for pair in zip(self.k, self.v) for t in pair]


def device_index(blocks: Iterable[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on `device`, enqueued on the current stream without waiting for it
    (vLLM's `async_tensor_h2d`: a pinned host tensor, copied non-blocking; a blocking copy, as
    `torch.tensor(..., device=cuda)` makes, waits for the stream's earlier work)."""
    cuda = device.type == "cuda"
    return torch.tensor(list(blocks), dtype=torch.long, pin_memory=cuda).to(device, non_blocking=cuda)


class PlainHostCopies:
    """The reference: host tensors per entry, copied in order on the current stream (pinned and
    non-blocking on CUDA: ordered before any later kernel that reuses the row and blocks)."""

    def __init__(self, pools: PoolTensors) -> None:
        self.pools = pools
        self._pinned = pools.device.type == "cuda"
        self._entries: dict[int, HostCopy] = {}

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def spill(self, write: Spill) -> None:
        if write.entry in self._entries:
            raise RuntimeError(f"host entry {write.entry} written twice")
        pools = self.pools
        index = device_index(write.blocks, pools.device)
        self._entries[write.entry] = HostCopy(
            self._to_host(pools.conv_stack[:, write.slot]), self._to_host(pools.ssm_stack[:, write.slot]),
            tuple(self._to_host(k.index_select(0, index)) for k in pools.k),
            tuple(self._to_host(v.index_select(0, index)) for v in pools.v))

    def restore(self, write: Restore) -> None:
        saved, pools = self._entries.pop(write.entry), self.pools
        pools.conv_stack[:, write.slot].copy_(saved.conv, non_blocking=True)
        pools.ssm_stack[:, write.slot].copy_(saved.ssm, non_blocking=True)
        if write.blocks:
            index = device_index(write.blocks, pools.device)
            for cache, kept in zip(pools.k + pools.v, saved.k + saved.v):
                cache.index_copy_(0, index, kept.to(pools.device, non_blocking=True))

    def drop(self, entry: int) -> None:
        del self._entries[entry]

    @property
    def reading(self) -> bool:
        """Never: every copy ran on the current stream, so nothing is left to wait for."""
        return False

    def wait_for(self, rows: Iterable[int], blocks: Iterable[int]) -> None:
        """Nothing to wait for: every copy ran on the current stream."""

    def wait_for_all(self) -> None:
        """(as `wait_for`)"""

    def copies(self) -> dict[int, HostCopy]:
        return dict(self._entries)

    def check_integrity(self) -> None:
        """Nothing beyond the entries themselves to check."""

    def copy_out(self, slot: int, blocks: Sequence[int]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """New host tensors of row `slot` and `blocks` in payload order, and (CUDA) an event after
        their copies (the disk tier's saves: runner/disk_io.py's writer waits for it)."""
        pools = self.pools
        index = device_index(blocks, pools.device)
        tensors = payload_tensors(self._to_host(pools.conv_stack[:, slot]), self._to_host(pools.ssm_stack[:, slot]),
                                  [self._to_host(k.index_select(0, index)) for k in pools.k],
                                  [self._to_host(v.index_select(0, index)) for v in pools.v])
        ready = None
        if self._pinned:
            ready = torch.cuda.Event()
            ready.record()
        return tensors, ready

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
        host.copy_(tensor, non_blocking=self._pinned)
        return host


@dataclass(frozen=True)
class _Entry:
    span: ArenaSpan
    num_blocks: int
    done: torch.cuda.Event | None  # recorded on the copy stream after the spill's copies (None on the CPU)


class ArenaHostCopies:
    """Entries in pinned arena pages, copied on a dedicated stream (the module docstring).

    capacity_bytes: the host tier's byte budget (cache/host_tier.py counts entries as
    slot_bytes + n_blocks * block_bytes and keeps their sum within it). Pages are block_bytes each
    (slot_bytes without attention layers); an entry rounds up to whole pages, so the arena holds
    capacity // page_bytes pages plus one per entry the budget can hold (capacity // slot_bytes):
    whatever the tier keeps fits, and ArenaFull means the bookkeeping broke its bound. pin_ahead: on
    CUDA, pin the whole arena in the background from now on (HostArena's `ahead`) instead of chunk by
    chunk as the tier first fills."""

    def __init__(self, pools: PoolTensors, capacity_bytes: int, pin_ahead: bool = False) -> None:
        self.pools = pools
        layers = pools.conv_stack.shape[0]
        self._conv_bytes = _row_bytes(pools.conv_stack)
        self._ssm_bytes = _row_bytes(pools.ssm_stack)
        self._kv_block_bytes = [t[0].numel() * t.element_size() for t in pools.kv()]
        self.slot_bytes = layers * (self._conv_bytes + self._ssm_bytes)
        self.block_bytes = sum(self._kv_block_bytes)
        page = self.block_bytes or self.slot_bytes
        if page < 1:
            raise ValueError("a host tier needs state rows or KV blocks to hold")
        num_pages = capacity_bytes // page + (capacity_bytes // self.slot_bytes if self.slot_bytes else 0)
        cuda = pools.device.type == "cuda"
        self.arena = HostArena(num_pages, page, pinned=cuda, prefetch=cuda, ahead=cuda and pin_ahead)
        self.stream = torch.cuda.Stream(pools.device) if cuda else None
        self._entries: dict[int, _Entry] = {}
        # spills whose copies may still read a row / block: the compute stream waits before writing it
        self._row_reads: dict[int, torch.cuda.Event] = {}
        self._block_reads: dict[int, torch.cuda.Event] = {}

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def entry_bytes(self, num_blocks: int) -> int:
        return self.slot_bytes + num_blocks * self.block_bytes

    # ------------------------------------------------------------------ the plan's writes
    def spill(self, write: Spill) -> None:
        if write.entry in self._entries:
            raise RuntimeError(f"host entry {write.entry} written twice")
        span = self.arena.allocate(self.entry_bytes(len(write.blocks)))
        try:
            with self._copy_stream():
                pools, offset = self.pools, 0
                for stack, size in ((pools.conv_stack, self._conv_bytes), (pools.ssm_stack, self._ssm_bytes)):
                    for layer in range(stack.shape[0]):
                        self._to_pages(span, offset, stack[layer, write.slot])
                        offset += size
                # the row first, with its own event: a new checkpoint that reuses the row at once (a
                # full state pool hands the freed row out next) waits for it alone, not for the KV
                row_done = self._record()
                if write.blocks:
                    index = device_index(write.blocks, pools.device)
                    for cache, size in zip(pools.kv(), self._kv_block_bytes):
                        self._to_pages(span, offset, cache.index_select(0, index))
                        offset += size * len(write.blocks)
                done = self._record()
        except BaseException:
            self.arena.free(span)
            raise
        self._entries[write.entry] = _Entry(span, len(write.blocks), done)
        if done is not None:
            self._row_reads[write.slot] = row_done
            self._block_reads.update(dict.fromkeys(write.blocks, done))

    def restore(self, write: Restore) -> None:
        entry = self._entries[write.entry]
        if len(write.blocks) != entry.num_blocks:
            raise ValueError(f"host entry {write.entry} holds {entry.num_blocks} KV blocks, a restore into "
                             f"{len(write.blocks)} was planned")
        self.wait_for((write.slot,), write.blocks)  # (ordered on the copy stream anyway; retires them)
        with self._copy_stream():
            pools, offset = self.pools, 0
            for stack, size in ((pools.conv_stack, self._conv_bytes), (pools.ssm_stack, self._ssm_bytes)):
                for layer in range(stack.shape[0]):
                    self._from_pages(entry.span, offset, stack[layer, write.slot])
                    offset += size
            if write.blocks:
                index = device_index(write.blocks, pools.device)
                for cache, size in zip(pools.kv(), self._kv_block_bytes):
                    staged = torch.empty((len(write.blocks), *cache.shape[1:]), dtype=cache.dtype,
                                         device=pools.device)
                    self._from_pages(entry.span, offset, staged)
                    cache.index_copy_(0, index, staged)
                    offset += size * len(write.blocks)
            done = self._record()
        if done is not None:
            torch.cuda.current_stream(pools.device).wait_event(done)
        del self._entries[write.entry]
        self.arena.free(entry.span)

    def drop(self, entry: int) -> None:
        self.arena.free(self._entries.pop(entry).span)

    def copy_out(self, slot: int, blocks: Sequence[int]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """New host tensors of row `slot` and `blocks` in payload order, copied on the copy stream,
        and its event after them (the disk tier's saves: the writer's thread waits for it; the row
        and blocks are guarded like a spill's until then). Not arena pages: the writer keeps them
        until the file is written."""
        pools, pinned = self.pools, self.stream is not None
        layers = pools.conv_stack.shape[0]
        conv = torch.empty((layers, *pools.conv_stack.shape[2:]), dtype=pools.conv_stack.dtype, pin_memory=pinned)
        ssm = torch.empty((layers, *pools.ssm_stack.shape[2:]), dtype=pools.ssm_stack.dtype, pin_memory=pinned)
        kv = [torch.empty((len(blocks), *t.shape[1:]), dtype=t.dtype, pin_memory=pinned) for t in pools.kv()]
        with self._copy_stream():
            for host, stack in ((conv, pools.conv_stack), (ssm, pools.ssm_stack)):
                for layer in range(layers):
                    host[layer].copy_(stack[layer, slot], non_blocking=True)
            if blocks:
                index = device_index(blocks, pools.device)
                for host, cache in zip(kv, pools.kv()):
                    host.copy_(cache.index_select(0, index), non_blocking=True)
            done = self._record()
        if done is not None:
            self._row_reads[slot] = done
            self._block_reads.update(dict.fromkeys(blocks, done))
        return [conv, ssm, *kv], done

    # ------------------------------------------------------------------ ordering
    @property
    def reading(self) -> bool:
        """Whether spills may still read rows or blocks (events not yet seen complete)."""
        return bool(self._row_reads or self._block_reads)

    def wait_for(self, rows: Iterable[int], blocks: Iterable[int]) -> None:
        """The compute stream waits (on the GPU) for the spills still reading any of these rows or
        blocks, before whatever it runs next writes them."""
        if not self._row_reads and not self._block_reads:
            return
        self._retire()
        waits = {id(e): e for e in (self._row_reads.pop(r, None) for r in rows) if e is not None}
        waits.update((id(e), e) for e in (self._block_reads.pop(b, None) for b in blocks) if e is not None)
        compute = torch.cuda.current_stream(self.pools.device)
        for event in waits.values():
            compute.wait_event(event)

    def wait_for_all(self) -> None:
        """`wait_for` every row and block a spill may still read."""
        self.wait_for(list(self._row_reads), list(self._block_reads))

    def pending_reads(self) -> tuple[set[int], set[int]]:
        """(rows, blocks) that spills may still read (not yet known complete)."""
        self._retire()
        return set(self._row_reads), set(self._block_reads)

    def _retire(self) -> None:
        events = {id(e): e for e in [*self._row_reads.values(), *self._block_reads.values()]}
        done = {key for key, event in events.items() if event.query()}
        if done:
            self._row_reads = {r: e for r, e in self._row_reads.items() if id(e) not in done}
            self._block_reads = {b: e for b, e in self._block_reads.items() if id(e) not in done}

    @contextmanager
    def _copy_stream(self):
        """Run on the copy stream, after the compute stream's work so far (nothing on the CPU)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.pools.device))
        with torch.cuda.stream(self.stream):
            yield

    def _record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _to_pages(self, span: ArenaSpan, offset: int, source: torch.Tensor) -> None:
        flat = source.reshape(-1).view(torch.uint8)
        for at, piece in self.arena.pieces(span, offset, flat.numel()):
            piece.copy_(flat[at: at + piece.numel()], non_blocking=True)

    def _from_pages(self, span: ArenaSpan, offset: int, target: torch.Tensor) -> None:
        """Into `target` (a contiguous device tensor, written in place through a byte view)."""
        flat = target.view(-1).view(torch.uint8)
        for at, piece in self.arena.pieces(span, offset, flat.numel()):
            flat[at: at + piece.numel()].copy_(piece, non_blocking=True)

    # ------------------------------------------------------------------ checks
    def copies(self) -> dict[int, HostCopy]:
        """Every entry's tensors (new CPU tensors, read after its copies completed)."""
        pools, out = self.pools, {}
        for entry_id, entry in self._entries.items():
            if entry.done is not None:
                entry.done.synchronize()
            n = entry.num_blocks
            targets = [(tuple(pools.conv_stack[:, 0].shape), pools.conv_stack.dtype),
                       (tuple(pools.ssm_stack[:, 0].shape), pools.ssm_stack.dtype)]
            targets += [((n, *t.shape[1:]), t.dtype) for t in pools.kv()]
            conv, ssm, *kv = split_payload(bytearray(self.arena.read(entry.span).numpy().tobytes()), targets)
            out[entry_id] = HostCopy(conv, ssm, tuple(kv[0::2]), tuple(kv[1::2]))
        return out

    def check_integrity(self) -> None:
        """Every page belongs to one entry or is free; each entry holds the pages its bytes need."""
        self.arena.check_integrity(entry.span for entry in self._entries.values())
        for entry_id, entry in self._entries.items():
            if entry.span.num_bytes != self.entry_bytes(entry.num_blocks):
                raise AssertionError(f"host entry {entry_id} holds {entry.span.num_bytes} bytes, its "
                                     f"{entry.num_blocks} blocks need {self.entry_bytes(entry.num_blocks)}")


def _row_bytes(stack: torch.Tensor) -> int:
    """Bytes of one row of one layer of a [L, rows, ...] state stack."""
    return stack[0, 0].numel() * stack.element_size()

