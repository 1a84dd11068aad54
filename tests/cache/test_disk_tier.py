"""The disk tier's file format and directory: headers round-trip and catch damage, the identity
separates models and layouts, files leave least valuable first within the byte bound (frequency with
aging, the least recently used of equals), and a rejected file leaves the index with its damage
remembered."""

from __future__ import annotations

import os
import time

import pytest

from forkpoint.cache.disk_format import (
    HEADER_BYTES,
    DamagedFile,
    FileDamage,
    FileHeader,
    checkpoint_identity,
    file_name,
    parse_file_name,
    payload_digest,
    read_file,
)
from forkpoint.cache.disk_tier import STALE_TEMPORARY_S, DiskTier

IDENTITY = bytes(range(32))
SLOT, BLOCK = 100, 40


def write(path, key: bytes, num_tokens: int, num_blocks: int, identity: bytes = IDENTITY, payload: bytes | None = None):
    payload = bytes(range(256)) * 4 if payload is None else payload
    payload = payload[: SLOT + num_blocks * BLOCK]
    header = FileHeader(identity, key, num_tokens, num_tokens, num_blocks, "marker", len(payload),
                        payload_digest([payload]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + payload)


def tier(root, capacity: int = 10_000) -> DiskTier:
    return DiskTier(root, IDENTITY, capacity, SLOT, BLOCK, block_size=16)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_header_round_trip_and_damage():
    header = FileHeader(IDENTITY, key(7), 70, 64, 18, "chat_turn", 1234, b"d" * 16)
    data = header.encode()
    assert len(data) == HEADER_BYTES and FileHeader.decode(data) == header
    for position in range(0, HEADER_BYTES, 7):
        damaged = bytearray(data)
        damaged[position] ^= 0x04
        with pytest.raises(DamagedFile) as caught:
            FileHeader.decode(bytes(damaged))
        assert caught.value.damage is FileDamage.CORRUPT
    with pytest.raises(DamagedFile) as caught:
        FileHeader.decode(data[:50])
    assert caught.value.damage is FileDamage.TRUNCATED
    assert parse_file_name(file_name(70, key(7))) == (70, key(7))
    assert parse_file_name("70-zz.fkpt") is None and parse_file_name("x.fkpt.tmp-1-2") is None


def test_read_file_verifies_length_and_checksum(tmp_path):
    path = tmp_path / "a" / file_name(9, key(1))
    write(path, key(1), 9, 3)
    header, payload = read_file(path)
    assert header.num_blocks == 3 and len(payload) == SLOT + 3 * BLOCK
    data = path.read_bytes()
    for damaged, damage in ((data[:-1], FileDamage.TRUNCATED), (data + b"x", FileDamage.CORRUPT),
                            (data[:-1] + bytes([data[-1] ^ 1]), FileDamage.CORRUPT)):
        path.write_bytes(damaged)
        with pytest.raises(DamagedFile) as caught:
            read_file(path)
        assert caught.value.damage is damage
    path.unlink()
    with pytest.raises(DamagedFile) as caught:
        read_file(path)
    assert caught.value.damage is FileDamage.MISSING


def test_identity_separates_what_changes_the_bytes(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"w")
    base = dict(model_dir=tmp_path, tokenizer_dir=tmp_path, load_format="auto", seed=0, quantization="None",
                checkpoint_token="<m>", dtype="torch.float32", kv_dtype="torch.float32", block_size=16,
                tensor_parallel_size=1, device="cpu", checkpoint_exact=False, pool_shapes="shapes")
    identity = checkpoint_identity(**base)
    assert checkpoint_identity(**base) == identity
    for name, value in (("dtype", "torch.bfloat16"), ("block_size", 32), ("tensor_parallel_size", 2),
                        ("checkpoint_exact", True), ("device", "cuda:H200"), ("checkpoint_token", "<n>")):
        assert checkpoint_identity(**{**base, name: value}) != identity, name
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert checkpoint_identity(**base) != identity
    changed = checkpoint_identity(**base)
    time.sleep(0.01)
    (tmp_path / "model.safetensors").write_bytes(b"v")  # other weights, same size: a new modification time
    assert checkpoint_identity(**base) != changed


def test_scan_orders_by_modification_time_and_bounds_the_bytes(tmp_path):
    own = tmp_path / IDENTITY.hex()[:32]
    size = HEADER_BYTES + SLOT + BLOCK
    for i in range(4):
        write(own / file_name(10 + i, key(i)), key(i), 10 + i, 1)
        os.utime(own / file_name(10 + i, key(i)), (1000 + i, 1000 + i))
    write(tmp_path / "other" / file_name(5, key(9)), key(9), 5, 1, identity=b"x" * 32)
    os.utime(tmp_path / "other" / file_name(5, key(9)), (500, 500))
    stale = own / (file_name(20, key(20)) + ".tmp-1-0")
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - STALE_TEMPORARY_S - 1,) * 2)
    fresh = own / (file_name(21, key(21)) + ".tmp-1-1")
    fresh.write_bytes(b"being written")

    disk = tier(tmp_path, capacity=4 * size)  # five files found: the oldest (another identity's) leaves
    assert not (tmp_path / "other" / file_name(5, key(9))).exists()
    assert not stale.exists() and fresh.exists()
    assert len(disk) == 4 and disk.lengths() == {10, 11, 12, 13} and disk.num_bytes == 4 * size
    header, _, _ = disk.load(key(0))  # now the most recently used
    assert header.num_tokens == 10
    name, dropped = disk.save(key(5), 15, 1)
    assert name.endswith(file_name(15, key(5))) and dropped == [f"{own.name}/{file_name(11, key(1))}"]
    assert disk.save(key(5), 15, 1) == (None, [])  # kept already
    assert disk.save(key(6), 16, 1000) == (None, [])  # larger than the whole tier
    disk.check_integrity()


def test_a_file_read_often_outlives_the_turns_written_after_it_and_leaves_once_the_tier_has_aged(tmp_path):
    """A shared system prompt's file (read by every new session) against a stream of sessions' turns,
    each read once by the session's next turn: plain recency dropped the shared one first (the restart
    in bench/agent_sessions.py found only late turns); by value it stays while the turns come and go,
    and once files read as often have left, it leaves too."""
    size = HEADER_BYTES + SLOT + BLOCK
    disk = tier(tmp_path, capacity=4 * size)
    shared = key(0)
    disk.save(shared, 100, 1)
    for _ in range(6):  # six sessions' first turns read it
        disk.touch(shared)
    turns = [key(i) for i in range(1, 13)]
    for i, turn in enumerate(turns):
        _, dropped = disk.save(turn, 200 + i, 1)
        if i:
            disk.touch(turns[i - 1])  # the session's next turn read the previous one
        assert shared in disk and not any(file_name(100, shared) in name for name in dropped)
        disk.check_integrity()
    assert len(disk) == 4 and turns[-3:] == [t for t in turns if t in disk][-3:]
    for i in range(13, 40):  # turns read twice each: the tier's age passes the shared file's priority
        disk.save(key(i), 300 + i, 1)
        disk.touch(key(i))
    assert shared not in disk
    disk.check_integrity()


def test_reject_forgets_the_file_and_remembers_the_damage(tmp_path):
    own = tmp_path / IDENTITY.hex()[:32]
    for i in range(3):
        write(own / file_name(10 + i, key(i)), key(i), 10 + i, 1)
    write(own / file_name(13, key(3)), key(3), 13, 1, identity=b"y" * 32)
    write(own / file_name(14, key(4)), key(5), 14, 1)  # another prefix's file under this name
    disk = tier(tmp_path)
    for k, damage in ((key(3), FileDamage.FOREIGN), (key(4), FileDamage.CORRUPT)):
        with pytest.raises(DamagedFile) as caught:
            disk.load(k)
        assert caught.value.damage is damage
        assert disk.reject(k, damage) is not None and k not in disk
    (own / file_name(10, key(0))).unlink()
    with pytest.raises(DamagedFile) as caught:
        disk.load(key(0))
    assert caught.value.damage is FileDamage.MISSING and disk.reject(key(0), FileDamage.MISSING) is not None
    assert disk.failure(key(3)) == (13, FileDamage.FOREIGN) and disk.failure_lengths() == {10, 13, 14}
    assert disk.counters.damaged[FileDamage.CORRUPT] == 1 and len(disk) == 2
    disk.save(key(3), 13, 1)
    assert disk.failure(key(3)) is None  # a new file of its own
    assert sorted(disk.clear()) == sorted(f"{own.name}/{file_name(n, k)}" for n, k in
                                          ((11, key(1)), (12, key(2)), (13, key(3))))
    assert len(disk) == 0
    disk.check_integrity()


def test_reads_ahead_are_taken_by_loads_and_bounded(tmp_path):
    own = tmp_path / IDENTITY.hex()[:32]
    for i in range(4):
        write(own / file_name(10 + i, key(i)), key(i), 10 + i, 1)
    size = HEADER_BYTES + SLOT + BLOCK
    disk = DiskTier(tmp_path, IDENTITY, 10_000, SLOT, BLOCK, block_size=16, read_ahead_bytes=2 * size)
    for i in range(3):  # the third drops the first's result: at most two held
        disk.read_ahead(key(i))
    disk.read_ahead(key(2))  # being read already: nothing new
    assert disk.counters.read_ahead == 3
    disk.check_integrity()
    assert disk.load(key(1))[0].num_tokens == 11 and disk.counters.read_ahead_used == 1
    assert disk.load(key(0))[0].num_tokens == 10 and disk.counters.read_ahead_used == 1  # dropped: read now
    path = own / file_name(13, key(3))
    path.write_bytes(path.read_bytes()[:-1])
    disk.read_ahead(key(3))
    with pytest.raises(DamagedFile) as caught:
        disk.load(key(3))  # the reader's verdict, raised here
    assert caught.value.damage is FileDamage.TRUNCATED
    disk.reject(key(3), FileDamage.TRUNCATED)
    disk.read_ahead(key(2))
    disk.clear()  # a file that leaves the index drops its read
    disk.check_integrity()


def test_reads_in_memory_keep_a_file_recent_and_tell_the_next_start_up(tmp_path, monkeypatch):
    """The oldest file is the one read most (a system prompt's checkpoint): touched by its reads in
    memory, a full tier deletes the unread files first, and its modification time follows (rate-limited)."""
    size = HEADER_BYTES + SLOT + BLOCK
    disk = tier(tmp_path, capacity=2 * size)
    names = [disk.save(key(i), 10 + i, 1)[0] for i in range(2)]
    for name, i in zip(names, range(2)):
        write(tmp_path / name, key(i), 10 + i, 1)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    utimes = []
    real_utime = os.utime
    monkeypatch.setattr("forkpoint.cache.disk_tier.os.utime", lambda path, *a: (utimes.append(path),
                                                                                real_utime(path, *a)))
    disk.touch(key(0))
    disk.touch(key(0))  # within TOUCH_INTERVAL_S: the order moves, the file's time is not written again
    disk.touch(key(7))  # no file: nothing
    assert utimes == [tmp_path / names[0]] and os.stat(tmp_path / names[0]).st_mtime > 1001
    assert disk.save(key(2), 12, 1)[1] == [names[1]]  # the unread file leaves, not the read one
    disk.check_integrity()
    restarted = tier(tmp_path, capacity=size)  # the next start-up keeps the file read last
    assert key(0) in restarted and key(1) not in restarted


def test_loads_report_the_seconds_of_their_read_on_the_tiers_clock(tmp_path):
    """Each read is timed where it runs (the reader thread for a read ahead) with the clock given: a
    clock that advances 0.25 s per call times every read at 0.25 s (cache/reuse_rates.py's disk read)."""
    own = tmp_path / IDENTITY.hex()[:32]
    for i in range(2):
        write(own / file_name(10 + i, key(i)), key(i), 10 + i, 1)
    ticks = iter(range(1000))
    disk = DiskTier(tmp_path, IDENTITY, 10_000, SLOT, BLOCK, block_size=16, clock=lambda: 0.25 * next(ticks))
    disk.read_ahead(key(1))
    assert disk.load(key(1))[2] == 0.25 and disk.counters.read_ahead_used == 1  # read ahead
    assert disk.read_done(key(1)) is False  # taken: nothing waits in memory
    disk.read_ahead(key(0))
    deadline = time.monotonic() + 10
    while not disk.read_done(key(0)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.read_done(key(0))  # its result waits: the rule counts its read as paid
    assert disk.load(key(0))[2] == 0.25
    assert disk.load(key(0))[2] == 0.25  # read now
    assert disk.length(key(0)) == 10 and disk.entry_bytes(key(0)) == HEADER_BYTES + SLOT + BLOCK
