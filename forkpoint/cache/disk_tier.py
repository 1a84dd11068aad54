"""The disk tier's directory: which checkpoints are kept as files under `checkpoint_dir`, bounded in bytes.

Files (cache/disk_format.py) live in one subdirectory per identity (model, dtype, layout, tokenizer),
so servers of different models can share a directory and a restarted server finds its own files.
This class keeps the index and decides; the bytes move elsewhere:

- **save** (`save`): a checkpoint that became READY is written through to disk (a restart then finds
  it). The registry records a `DiskSave` plan write; the runner's storage copies the state row and
  blocks to the host and a background thread writes the file under a temporary name, then renames it
  (runner/disk_io.py), so a reader never sees half a file. When `capacity_bytes` would be exceeded,
  files leave least valuable first (below), other identities' files included; a `DiskDrop` plan write
  deletes them, in order after any pending write.
- **value** (frequency with aging, "LFU-DA"; the device tier's GreedyDual is cache/eviction.py): a
  file's priority is the tier's age `L` when it was last used plus its uses (its save, its checkpoint's
  reads in memory before it (`save`'s `reads`) and after it (`touch`), loads); the lowest priority
  leaves first, the least recently used of equals first, and `L` becomes the priority of the file that
  left. A shared system prompt's checkpoint, read by every session's first turn, so
  outlives the stream of per-session turns written after it that plain recency would keep instead
  (bench/agent_sessions.py `--restart`: 32 sessions x 6 turns filled the bound, and the restarted
  server found only later turns); `L` rises as files leave, so a file used often long ago leaves in
  the end. Files found at start-up have no uses yet: they keep their modification-time order.
- **load** (`load`): on a lookup that misses the device and host tiers, the file is read whole here
  and verified (identity, key, length, header and payload checksums) before anything uses it; the
  payload then travels in a `DiskRestore` plan write. A file that is missing, truncated, corrupt,
  foreign or unreadable is a miss (`reject`): it leaves the index, all but unreadable ones are
  deleted, and the damage is remembered per key for the request's `cache_miss_reason`.

- **timing**: each read (`load`, `read_ahead`) is timed with `clock` where it runs; `load` returns the
  seconds with the payload, for the measured disk-read rate (cache/reuse_rates.py).
- **read ahead** (`read_ahead`): when a request is queued whose longest checkpoint is only on disk,
  its file is read and verified on a reader thread while the engine runs other steps; the load at
  its admission then takes that result (waiting for it if the read is still running). Results held
  are bounded by `read_ahead_bytes` (oldest dropped); a file that leaves the index drops its result.

A save is recorded before its file exists: a load in between finds nothing (MISSING), a miss, and
the deletion it records follows the pending write, so no file outlives its index entry.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from forkpoint.cache.disk_format import (
    HEADER_BYTES,
    SUFFIX,
    DamagedFile,
    FileDamage,
    FileHeader,
    file_name,
    identity_dir_name,
    parse_file_name,
    read_file,
)

logger = logging.getLogger("forkpoint.checkpoints")

STALE_TEMPORARY_S = 3600.0  # a temporary file this old is a crashed writer's: deleted at start-up
DEFAULT_READ_AHEAD_BYTES = 2 << 30  # files read ahead and not yet taken, at most
TOUCH_INTERVAL_S = 60.0  # a file's modification time follows its checkpoint's reads at most this often
_REMEMBERED_FAILURES = 1024


@dataclass(frozen=True)
class DiskEntry:
    """A file the tier counts: `name` relative to the root; `key` and `num_tokens` for this identity's
    files (None and 0 for another identity's, which only take room)."""

    name: str
    num_bytes: int
    key: bytes | None = None
    num_tokens: int = 0


@dataclass
class DiskCounters:
    saved: int = 0  # saves recorded (files written through)
    loaded: int = 0  # files read, verified and restored
    dropped: int = 0  # files deleted to stay within capacity (or by reset)
    not_saved: int = 0  # checkpoints larger than the whole tier
    read_ahead: int = 0  # reads started before the request's admission
    read_ahead_used: int = 0  # loads that took such a read's result
    damaged: Counter[FileDamage] = field(default_factory=Counter)  # files rejected on load, by damage


class DiskTier:
    def __init__(self, root: Path, identity: bytes, capacity_bytes: int, slot_bytes: int, block_bytes: int,
                 block_size: int, read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.root = Path(root)
        self.clock = clock  # times each file read (`load` reports it; cache/reuse_rates.py)
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.directory = self.root / identity_dir_name(identity)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[str, DiskEntry] = OrderedDict()  # every counted file, least recently used first
        self._priority: dict[str, int] = {}  # name -> L at its last use + its uses (the module docstring)
        self._uses: dict[str, int] = {}
        self._age = 0  # L: the priority of the last file that left to make room
        self._by_key: dict[bytes, DiskEntry] = {}
        self._lengths: Counter[int] = Counter()
        self._failures: OrderedDict[bytes, tuple[int, FileDamage]] = OrderedDict()
        self.read_ahead_bytes = read_ahead_bytes
        self._ahead: OrderedDict[bytes, tuple[Future, int]] = OrderedDict()  # key -> (read, its file's bytes)
        self._ahead_bytes = 0
        self._touched: dict[bytes, float] = {}  # key -> time.monotonic() of its file's last utime by `touch`
        self._reader: ThreadPoolExecutor | None = None  # started on the first read ahead
        self.num_bytes = 0
        self.counters = DiskCounters()
        self._scan()

    # ------------------------------------------------------------------ start-up
    def _scan(self) -> None:
        """Index the files under the root, oldest modification first; delete stale temporary files."""
        found = []
        now = time.time()
        for path in self.root.glob(f"*/*{SUFFIX}*"):
            try:
                stat = path.stat()
            except OSError:
                continue
            if not path.name.endswith(SUFFIX):  # a writer's temporary file
                if now - stat.st_mtime > STALE_TEMPORARY_S:
                    path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, path, stat.st_size))
        for _, path, size in sorted(found, key=lambda item: (item[0], str(item[1]))):
            parsed = parse_file_name(path.name) if path.parent == self.directory else None
            name = str(path.relative_to(self.root))
            entry = DiskEntry(name, size) if parsed is None else DiskEntry(name, size, parsed[1], parsed[0])
            self._add(entry)
        while self.num_bytes > self.capacity_bytes:  # the bound may have shrunk since the files were written
            self.path(self._pop_least_valuable()).unlink(missing_ok=True)  # nothing is pending at start-up
        if self._by_key:
            logger.info("disk tier: %d checkpoint files of this model in %s", len(self._by_key), self.directory)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def lengths(self) -> set[int]:
        return set(self._lengths)

    def failure(self, key: bytes) -> tuple[int, FileDamage] | None:
        """(num_tokens, damage) of a recent rejected load of `key`, else None."""
        return self._failures.get(key)

    def failure_lengths(self) -> set[int]:
        return {num_tokens for num_tokens, _ in self._failures.values()}

    def num_blocks(self, key: bytes) -> int:
        """The KV blocks checkpoint `key`'s file holds, by its size (verified when it is loaded)."""
        payload = self._by_key[key].num_bytes - HEADER_BYTES - self.slot_bytes
        return max(payload, 0) // self.block_bytes if self.block_bytes else 0

    def path(self, name: str) -> Path:
        return self.root / name

    def file_bytes(self, num_blocks: int) -> int:
        return HEADER_BYTES + self.slot_bytes + num_blocks * self.block_bytes

    def length(self, key: bytes) -> int:
        """The prefix length (tokens) checkpoint `key`'s file is keyed by."""
        return self._by_key[key].num_tokens

    def entry_bytes(self, key: bytes) -> int:
        """The size of checkpoint `key`'s file, as counted."""
        return self._by_key[key].num_bytes

    def read_done(self, key: bytes) -> bool:
        """Whether a read ahead of `key`'s file has finished (its result waits in memory)."""
        return key in self._ahead and self._ahead[key][0].done()

    # ------------------------------------------------------------------ transitions
    def save(self, key: bytes, num_tokens: int, num_blocks: int, reads: int = 0) -> tuple[str | None, list[str]]:
        """Count a new file for checkpoint `key`, deleting the least valuable files to make room; `reads`:
        its checkpoint's reads before the file (a step that produces a prefix can read it too), counted
        as uses with the save. Returns (its name, or None when it is larger than the tier or already kept;
        the names of the files that leave): the caller records the `DiskDrop`s, then the `DiskSave`."""
        if key in self._by_key:
            return None, []
        num_bytes = self.file_bytes(num_blocks)
        if num_bytes > self.capacity_bytes:
            self.counters.not_saved += 1
            return None, []
        dropped = []
        while self.num_bytes + num_bytes > self.capacity_bytes:
            dropped.append(self._pop_least_valuable())
        name = str(Path(identity_dir_name(self.identity)) / file_name(num_tokens, key))
        self._add(DiskEntry(name, num_bytes, key, num_tokens))
        self._uses[name] = reads
        self._use(name)
        self._failures.pop(key, None)
        self.counters.saved += 1
        return name, dropped

    def touch(self, key: bytes) -> None:
        """Checkpoint `key` was read in memory: its file (when it has one) is used once more, so a full
        tier deletes it after files read less (a shared system prompt's checkpoint, written first and
        read by every new session, would otherwise be the first to go), and, at most every
        TOUCH_INTERVAL_S, its modification time tells the next start-up, which orders files by it."""
        entry = self._by_key.get(key)
        if entry is None:
            return
        self._use(entry.name)
        now = time.monotonic()
        last = self._touched.get(key)
        if last is not None and now - last < TOUCH_INTERVAL_S:
            return
        self._touched[key] = now
        try:
            os.utime(self.path(entry.name))
        except OSError:  # not written yet (the writer's file gets its time then), or gone: nothing to tell
            pass

    def read_ahead(self, key: bytes) -> None:
        """Start reading checkpoint `key`'s file on the reader thread (unless it is being read or the
        results held would exceed `read_ahead_bytes`, oldest dropped first)."""
        entry = self._by_key.get(key)
        if entry is None or key in self._ahead or entry.num_bytes > self.read_ahead_bytes:
            return
        while self._ahead_bytes + entry.num_bytes > self.read_ahead_bytes:
            self._drop_ahead(next(iter(self._ahead)))
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkpoint-disk-reader")
        self._ahead[key] = (self._reader.submit(self._timed_read, self.path(entry.name)), entry.num_bytes)
        self._ahead_bytes += entry.num_bytes
        self.counters.read_ahead += 1

    def _take_ahead(self, key: bytes) -> Future:
        read, num_bytes = self._ahead.pop(key)
        self._ahead_bytes -= num_bytes
        return read

    def _drop_ahead(self, key: bytes) -> None:
        self._take_ahead(key).cancel()  # a read that already runs finishes and its result is dropped

    def _timed_read(self, path: Path) -> tuple[FileHeader, bytearray, float]:
        """`read_file(path)` and the seconds it took (on the thread that reads)."""
        start = self.clock()
        header, payload = read_file(path)
        return header, payload, self.clock() - start

    def load(self, key: bytes) -> tuple[FileHeader, bytearray, float]:
        """The verified header and payload of checkpoint `key`'s file (the file stays; it becomes the
        most recently used), and the seconds its read and checks took: the result of its read ahead if
        one was started (waited for), else read now. Raises DamagedFile; the caller then calls `reject`."""
        entry = self._by_key[key]
        if key in self._ahead:
            header, payload, seconds = self._take_ahead(key).result()  # re-raises the reader's DamagedFile
            self.counters.read_ahead_used += 1
        else:
            header, payload, seconds = self._timed_read(self.path(entry.name))
        if header.identity != self.identity:
            raise DamagedFile(FileDamage.FOREIGN, f"{entry.name} was written for another model, dtype, layout or "
                                                  "tokenizer")
        if header.key != key or header.num_tokens != entry.num_tokens:
            raise DamagedFile(FileDamage.CORRUPT, f"{entry.name} holds another prefix")
        if not 0 < header.state_tokens <= header.num_tokens or header.num_blocks * self.block_size < \
                header.state_tokens or header.payload_bytes != self.slot_bytes + header.num_blocks * self.block_bytes:
            raise DamagedFile(FileDamage.CORRUPT, f"{entry.name}: its fields do not fit this model's pools")
        self._use(entry.name)
        try:
            os.utime(self.path(entry.name))  # recency for the next start-up's order
        except OSError:
            pass
        self.counters.loaded += 1
        return header, payload, seconds

    def reject(self, key: bytes, damage: FileDamage) -> str | None:
        """Checkpoint `key`'s file was not usable: it leaves the index and `damage` is remembered.
        Returns its name when the caller should delete it, else None (unreadable: left alone). A
        missing file is deleted too: its save may still be queued, and the deletion, queued behind it,
        keeps the directory equal to the index."""
        entry = self._by_key[key]
        self._discard(entry)
        self.counters.damaged[damage] += 1
        self._failures[key] = (entry.num_tokens, damage)
        while len(self._failures) > _REMEMBERED_FAILURES:
            self._failures.popitem(last=False)
        logger.warning("disk tier: checkpoint file %s not used (%s)", entry.name, damage.value)
        return None if damage is FileDamage.READ_ERROR else entry.name

    def clear(self) -> list[str]:
        """Every file of this identity leaves; returns their names (the caller records `DiskDrop`s)."""
        names = [entry.name for entry in list(self._by_key.values())]
        for name in names:
            self._discard(self._files[name])
        self.counters.dropped += len(names)
        return names

    def _add(self, entry: DiskEntry) -> None:
        self._files[entry.name] = entry
        self._priority[entry.name] = self._age
        self._uses[entry.name] = 0
        self.num_bytes += entry.num_bytes
        if entry.key is not None:
            self._by_key[entry.key] = entry
            self._lengths[entry.num_tokens] += 1

    def _use(self, name: str) -> None:
        """One more use of file `name`: its priority becomes L + its uses; it is the most recently used."""
        self._uses[name] += 1
        self._priority[name] = self._age + self._uses[name]
        self._files.move_to_end(name)

    def _discard(self, entry: DiskEntry) -> None:
        del self._files[entry.name]
        del self._priority[entry.name], self._uses[entry.name]
        self.num_bytes -= entry.num_bytes
        if entry.key in self._ahead:
            self._drop_ahead(entry.key)
        if entry.key is not None:
            del self._by_key[entry.key]
            self._touched.pop(entry.key, None)
            self._lengths[entry.num_tokens] -= 1
            if not self._lengths[entry.num_tokens]:
                del self._lengths[entry.num_tokens]

    def _pop_least_valuable(self) -> str:
        """The file of lowest priority leaves (the least recently used of equals); L becomes its priority."""
        name = min(self._files, key=self._priority.__getitem__)  # min keeps the first of equals: LRU order
        self._age = max(self._age, self._priority[name])
        entry = self._files[name]
        self._discard(entry)
        self.counters.dropped += 1
        return entry.name

    def check_integrity(self) -> None:
        if self.num_bytes != sum(e.num_bytes for e in self._files.values()) or self.num_bytes > self.capacity_bytes:
            raise AssertionError("disk tier byte count is wrong or over capacity")
        if set(self._priority) != set(self._files) or set(self._uses) != set(self._files):
            raise AssertionError("disk tier priorities are stale")
        if {e.key for e in self._files.values() if e.key is not None} != set(self._by_key):
            raise AssertionError("disk tier key index is stale")
        if Counter(e.num_tokens for e in self._by_key.values()) != self._lengths:
            raise AssertionError("disk tier length index is stale")
        if not set(self._ahead) <= set(self._by_key) or self._ahead_bytes != sum(b for _, b in self._ahead.values()) \
                or self._ahead_bytes > self.read_ahead_bytes:
            raise AssertionError("disk tier reads ahead of files it no longer counts, or over their bound")
