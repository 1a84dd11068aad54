"""The host tier's two copy paths (runner/host_copies.py) on the CPU: random spill / restore / drop /
row-copy sequences, decided by the host tier's own bookkeeping (cache/host_tier.py), give the same
bytes through the arena as through the plain reference; a failing copy or a broken byte bound leaves
no page held; the rows and blocks a forward writes (what the compute stream waits for on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.sizing import PoolShapes, PoolSizes
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.runner.host_arena import ArenaFull
from forkpoint.runner.host_copies import ArenaHostCopies, PlainHostCopies
from forkpoint.runner.storage import DeviceStorage
from forkpoint.step.plan import HostDrop, KVCopy, Restore, Segment, SegmentKind, Spill, StateCopy, StepPlan

CPU = torch.device("cpu")
SIZES = PoolSizes(num_kv_blocks=24, num_request_slots=2, num_checkpoint_slots=5)
BLOCK_SIZE = 4
# conv bf16 [5, 3]: 30 bytes a layer, so the fp32 SSM rows start at byte offsets that are not
# multiples of 4 in an entry (the copies are byte copies)
SPEC = RecurrentStateSpec((5, 3), torch.bfloat16, (2, 3, 2), torch.float32)
SHAPES = PoolShapes(2, 2, 3, torch.bfloat16, 3, SPEC)


def _filled(host_arena_bytes: int, seed: int = 0) -> DeviceStorage:
    storage = DeviceStorage(SIZES, BLOCK_SIZE, SHAPES, CPU, host_arena_bytes=host_arena_bytes)
    generator = torch.Generator().manual_seed(seed)
    for tensor in [storage.conv_stack, storage.ssm_stack, *storage.k, *storage.v]:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    storage.conv_stack[:, 0].zero_()
    storage.ssm_stack[:, 0].zero_()
    return storage


def host_tier(capacity: int, shapes: PoolShapes = SHAPES, block_size: int = BLOCK_SIZE) -> HostTier:
    return HostTier(capacity, shapes.slot_bytes, shapes.block_bytes(block_size))


def random_writes(rng: random.Random, tier: HostTier, count: int, sizes: PoolSizes = SIZES) -> list:
    """Writes as the checkpoint registry records them: evictions spill (after the drops that make
    room), hits restore into free rows and blocks, row copies fill free rows (`sizes`' checkpoint
    rows and blocks; request rows 1 and 2 hold states too)."""
    first_row = 1 + sizes.num_request_slots
    free_rows = list(range(first_row, first_row + sizes.num_checkpoint_slots))
    free_blocks = list(range(sizes.num_kv_blocks))
    held: dict[bytes, tuple[int, list[int]]] = {}  # on the device: key -> (row, blocks)
    writes, keys, spilled = [], 0, []
    for _ in range(count):
        choice = rng.random()
        if choice < 0.3 and free_rows:
            writes.append(StateCopy(rng.choice([1, 2, *[r for r, _ in held.values()]]), rng.choice(free_rows)))
        elif choice < 0.55 and free_rows:  # a new checkpoint on the device
            n = rng.randint(0, min(4, len(free_blocks)))
            row, blocks = free_rows.pop(rng.randrange(len(free_rows))), [free_blocks.pop() for _ in range(n)]
            rng.shuffle(blocks)
            held[bytes([keys])] = (row, blocks)
            keys += 1
        elif choice < 0.8 and held:  # evict one: spill it
            key = rng.choice(sorted(held))
            row, blocks = held.pop(key)
            entry, dropped = tier.spill(key, 8, 8, None, len(blocks))
            writes += [HostDrop(e) for e in dropped]
            if entry is not None:
                writes.append(Spill(entry.entry_id, row, tuple(blocks)))
                spilled.append(key)
            free_rows.append(row)
            free_blocks += blocks
        elif len(tier) and free_rows:  # a hit in the host tier: restore it
            key = rng.choice([k for k in spilled if k in tier])
            n = tier.entry(key).num_blocks
            if n > len(free_blocks):
                continue
            entry = tier.take(key)
            row, blocks = free_rows.pop(0), [free_blocks.pop(rng.randrange(len(free_blocks))) for _ in range(n)]
            writes.append(Restore(entry.entry_id, row, tuple(blocks)))
            held[key] = (row, blocks)
        else:
            writes += [HostDrop(e) for e in tier.clear()]
    return writes


@pytest.mark.parametrize("seed", range(6))
def test_arena_copies_equal_the_plain_copies_on_random_sequences(seed):
    rng = random.Random(seed)
    capacity = rng.choice([SHAPES.slot_bytes + 3 * SHAPES.block_bytes(BLOCK_SIZE), 3000, 10_000])
    tier = host_tier(capacity)
    writes = random_writes(rng, tier, 80)
    assert any(isinstance(w, Restore) for w in writes) and any(isinstance(w, HostDrop) for w in writes)
    plain, arena = _filled(0, seed), _filled(capacity, seed)
    assert isinstance(plain.host, PlainHostCopies) and isinstance(arena.host, ArenaHostCopies)
    for start in range(0, len(writes), 7):  # plans of a few writes each
        for storage in (plain, arena):
            storage.apply(writes[start: start + 7], first=start)
            storage.check_integrity()
        assert sorted(arena.host) == sorted(plain.host)
        expected, got = plain.tensors(), arena.tensors()
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (start, name)
    assert sorted(arena.host) == sorted(tier.entry_ids())
    pages = arena.host.arena.pages
    assert pages.num_free < pages.num_pages or not len(tier)
    arena.apply([HostDrop(e) for e in tier.clear()], first=len(writes))
    assert len(arena.host) == 0 and pages.num_free == pages.num_pages
    arena.check_integrity()


def test_a_failing_copy_holds_no_pages_and_the_write_applies_again(monkeypatch):
    capacity = 4000
    storage, reference = _filled(capacity), _filled(0)
    writes = [Spill(0, 3, (5, 2, 7)), Spill(1, 4, ()), Restore(0, 6, (9, 10, 11))]
    storage.apply(writes[:1])
    calls = {"n": 0}
    to_pages = ArenaHostCopies._to_pages

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("copy failed")
        return to_pages(self, *args)

    monkeypatch.setattr(ArenaHostCopies, "_to_pages", failing)
    free = storage.host.arena.pages.num_free
    with pytest.raises(RuntimeError, match="copy failed"):
        storage.apply(writes, first=0)  # write 0 is skipped (applied), write 1 fails
    assert storage.writes_applied == 1 and sorted(storage.host) == [0]
    assert storage.host.arena.pages.num_free == free
    storage.check_integrity()
    storage.apply(writes, first=0)  # the failed step's writes, given again
    reference.apply(writes)
    assert storage.writes_applied == 3 and sorted(storage.host) == [1]
    for name, tensor in reference.tensors().items():
        assert torch.equal(storage.tensors()[name], tensor), name
    with pytest.raises(ValueError, match="holds 0 KV blocks, a restore into 2 was planned"):
        storage.apply([Restore(1, 3, (0, 1))], first=3)
    assert sorted(storage.host) == [1]
    storage.check_integrity()


def test_an_arena_smaller_than_the_bookkeeping_says_raises_and_holds_nothing():
    storage = _filled(SHAPES.slot_bytes)  # one state row, no blocks (and one page of slack)
    with pytest.raises(ArenaFull):
        storage.apply([Spill(0, 3, tuple(range(8)))])
    assert len(storage.host) == 0 and storage.writes_applied == 0
    storage.apply([Spill(0, 3, ())])
    storage.check_integrity()


def test_the_rows_and_blocks_a_forward_writes():
    storage = _filled(0)
    table = tuple(range(10, 20))
    plan = StepPlan(segments=(
        Segment("a", 9, 10, [1], table, 1, (1,), SegmentKind.DECODE, 0, True),
        Segment("b", 4, 13, [1] * 9, table[::-1], 0, (2, 5), SegmentKind.PREFILL, 0, True),
    ), kv_copies=(KVCopy(3, 7, 2),))
    # a: position 9 in block table[2] and on; b: positions 4..12 from its table's entry 1 on
    assert storage.forward_writes(plan) == ({1, 2, 5}, set(range(12, 20)) | set(range(10, 19)) | {7})
    short = StepPlan(segments=(Segment("c", 8, 9, [1], (30, 31, 32), 4, (4,), SegmentKind.DECODE, 0, True),))
    assert storage.forward_writes(short) == ({4}, {32})


class _Event:
    """A CUDA event stand-in: complete when the test says so."""

    def __init__(self, name: str) -> None:
        self.name, self.complete = name, False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


class _Stream:
    def __init__(self) -> None:
        self.waited: list[str] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event.name)


def test_the_compute_stream_waits_only_for_spills_reading_what_it_writes_next(monkeypatch):
    """The CUDA path's ordering with stand-in events: a later write or forward waits for exactly the
    spills still reading its rows and blocks; completed spills are retired; no forward: all of them."""
    # a spill records an event after its state row's copies, and one after its blocks'
    names, events = iter(["row A", "spill A", "row B", "spill B", "restore B", "row C", "spill C"]), {}

    def record(self) -> _Event:
        event = _Event(next(names))
        events[event.name] = event
        return event

    monkeypatch.setattr(ArenaHostCopies, "_record", record)
    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    storage = _filled(4000)
    storage.apply([Spill(0, 3, (1, 2)), Spill(1, 4, (5,))], forward=StepPlan())
    assert storage.host.reading and compute.waited == []

    def writing(row: int, blocks: tuple[int, ...]) -> StepPlan:
        end = len(blocks) * BLOCK_SIZE
        return StepPlan(segments=(Segment("r", 0, end, [1] * end, blocks, 0, (row,), SegmentKind.PREFILL, 0, True),))

    storage.apply([], first=2, forward=writing(6, (7, 8)))  # neither row nor blocks of a spill
    assert compute.waited == []
    storage.apply([StateCopy(1, 3)], first=2, forward=writing(6, (5,)))  # row 3 (A's row), then block 5 (B)
    assert compute.waited == ["row A", "spill B"]
    assert storage.host.pending_reads() == ({4}, {1, 2})
    events["row B"].complete = events["spill B"].complete = True  # done: retired, no wait for its row
    storage.apply([Restore(1, 4, (9,))], first=3, forward=writing(4, (1,)))
    assert compute.waited == ["row A", "spill B", "restore B", "spill A"]  # the restore's event, then block 1
    storage.apply([Spill(2, 5, (10,))], first=4, forward=StepPlan())
    storage.apply([], first=5)  # no plan: every spill still reading (C's row and block; A's block 2)
    assert sorted(compute.waited[4:]) == ["row C", "spill A", "spill C"]
    assert not storage.host.reading
    storage.check_integrity()


def test_disk_save_copies_are_the_same_through_both_paths_and_guard_the_row(monkeypatch):
    plain, arena = _filled(0, 3), _filled(4000, 3)
    (expected, none), (got, _) = plain.host.copy_out(4, (3, 9, 0)), arena.host.copy_out(4, (3, 9, 0))
    assert none is None and len(got) == len(expected) == 2 + 2 * SHAPES.num_attention_layers
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b)
    monkeypatch.setattr(ArenaHostCopies, "_record", lambda self: _Event("save"))
    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    storage = _filled(4000)
    storage.host.copy_out(5, (7,))
    assert storage.host.pending_reads() == ({5}, {7})
    storage.apply([StateCopy(1, 5)], forward=StepPlan())
    assert compute.waited == ["save"]
