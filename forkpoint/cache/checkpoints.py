"""Checkpoint registry: the one owner of every checkpoint's life cycle.

A checkpoint is the recurrent state of every recurrent layer at an exact token position (one slot
of the checkpoint pool) plus references to the KV blocks covering the prefix. Its states::

    register ──> PENDING ──mark_ready──> READY ──evict──> (removed)
                  │   ^                    │
    producer_left │   │ promote            └─ never evicted while pinned
                  v   │
                ORPHANED ──last waiter leaves──> (removed)

- PENDING: a producer (a request id) will write it in a forward. While unready it holds no KV
  block references; `producer_blocks` is the producer's block table, so consumers scheduled in the
  same step share its prefix blocks.
- ORPHANED: the producer left (finished, aborted, preempted, failed) before writing it, and
  requests wait for it; the next of them to be scheduled is promoted to producer.
- READY: written; holds KV block references; idle ones are evicted (below).

Readers and waiters: `pins` counts the segments of the step in flight that read it (taken when
scheduled, released when the step is committed or fails); `waiters` counts the requests deferred on
it. Both are transitions of this class; callers never write a checkpoint's fields.

Eviction (cache/eviction.py, `EvictionPolicy`): only idle READY checkpoints (no pins, no waiters, no
reservations) are evicted: automatic ones by value (GreedyDual) first, then the live sessions' latest
ones, then marked ones; a tenant over its fair share of the pool evicts its own first.

Device memory: the registry touches no tensor. The writes its transitions imply (a spill to the
host tier on eviction, a restore on a hit in the host tier, a row copy into a kept turn end) are
recorded, in order and numbered, as the step plan's device writes (step/plan.py); the scheduler
takes them (`take_writes`) into the next plan, which the runner applies before that step's forward,
and gives a failed plan's back (`give_back_writes`).

Disk tier (`disk`, cache/disk_tier.py): a checkpoint that becomes READY is also written to a file
(`DiskSave`); a lookup that misses the device and the host tier reads and verifies the file here and
restores it as READY (`DiskRestore`, the verified payload); a file that is damaged or foreign is a
miss, and the slot and blocks taken for it are released at once.

Restore or recompute (cache/reuse_rule.py): a hit in the host or disk tier is taken (and a file read
ahead) only when moving it back costs no more, at the measured rates (`rates`, cache/reuse_rates.py),
than computing the tokens it saves over the longest READY device checkpoint below it; else the lookup
goes on below it, and the key is remembered as declined (`tier_miss`: RECOMPUTE_FASTER).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoint_types import (
    CacheMissReason,
    Checkpoint,
    CheckpointCounters,
    CheckpointKind,
    CheckpointState,
)
from forkpoint.cache.disk_format import DamagedFile, FileDamage
from forkpoint.cache.disk_tier import DiskTier
from forkpoint.cache.eviction import EvictionPolicy
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.reuse_rates import ReuseRates
from forkpoint.cache.reuse_rule import Tier, estimate
from forkpoint.cache.state_pool import SlotAllocator
from forkpoint.step.plan import DeviceWrite, DiskDrop, DiskRestore, DiskSave, HostDrop, Restore, Spill, StateCopy

logger = logging.getLogger("forkpoint.checkpoints")

_DAMAGE_REASONS = {
    FileDamage.MISSING: CacheMissReason.EVICTED_DISK, FileDamage.TRUNCATED: CacheMissReason.DISK_TRUNCATED,
    FileDamage.CORRUPT: CacheMissReason.DISK_CORRUPT, FileDamage.FOREIGN: CacheMissReason.DISK_FOREIGN,
    FileDamage.READ_ERROR: CacheMissReason.DISK_READ_ERROR}
_REMEMBERED_DECLINES = 1024


class CheckpointRegistry:
    def __init__(self, slots: SlotAllocator, block_pool: BlockPool, host: HostTier | None = None,
                 disk: DiskTier | None = None, rates: ReuseRates | None = None, *, restore_rule: bool = True) -> None:
        self._slots = slots
        self._blocks = block_pool
        self.host = host  # evicted checkpoints spill here and come back on a hit
        self.disk = disk  # READY checkpoints are written through to files, read back on a miss elsewhere
        self.rates = rates if rates is not None else ReuseRates()  # what the restore-or-recompute rule weighs
        self.restore_rule = restore_rule  # False: every tier hit is restored (the rates are measured all the same)
        self._declined: OrderedDict[bytes, int] = OrderedDict()  # tier hits recomputed instead: key -> length
        self.declined: Counter[Tier] = Counter()  # tier hits declined by the rule, per tier
        self._by_key: dict[bytes, Checkpoint] = {}
        self._lengths: Counter[int] = Counter()
        self.eviction = EvictionPolicy(slots, self._by_key)  # the order idle checkpoints leave in
        self.counters = CheckpointCounters()
        self._writes: list[tuple[int, DeviceWrite]] = []  # (number, write) not yet taken, in order
        self._next_number = 0

    def take_writes(self) -> tuple[int, tuple[DeviceWrite, ...]]:
        """(the number of the first, the writes) recorded and not yet taken, in order, numbered
        consecutively (for the next step plan; step/plan.py)."""
        taken, self._writes = self._writes, []
        return (taken[0][0] if taken else self._next_number), tuple(write for _, write in taken)

    def give_back_writes(self, first: int, writes: tuple[DeviceWrite, ...]) -> None:
        """A plan holding `writes` (numbered from `first`) failed: they go to the next plan again, in
        their place (a storage skips those it applied already)."""
        merged = self._writes + [(first + i, write) for i, write in enumerate(writes)]
        self._writes = sorted(merged, key=lambda numbered: numbered[0])

    def _record(self, write: DeviceWrite) -> None:
        self._writes.append((self._next_number, write))
        self._next_number += 1

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(list(self._by_key.values()))

    def get(self, key: bytes) -> Checkpoint | None:
        return self._by_key.get(key)

    @property
    def num_created(self) -> int:
        return sum(self.counters.created.values())

    @property
    def num_evicted(self) -> int:
        return sum(self.counters.evicted.values())

    @property
    def num_pending(self) -> int:
        return sum(1 for c in self._by_key.values() if not c.ready)

    def lengths_descending(self) -> list[int]:
        """The distinct prefix lengths of registered checkpoints, longest first."""
        return sorted(self._lengths, reverse=True)

    def lookup(self, prefix_hash: Callable[[int], bytes], max_length: int,
               accept: Callable[[Checkpoint], bool] | None = None, *,
               restore: bool = True) -> tuple[Checkpoint | None, Checkpoint | None]:
        """(longest registered checkpoint of length < max_length whose key is prefix_hash(length),
        longest READY one), among those `accept` takes (default: all). `prefix_hash(n)` is the chained
        hash of a prompt's first n tokens. With `restore`, spilled checkpoints count too (the one
        found is brought back from the host or the disk tier, when that pays: `restore_pays`); without,
        only those on the device."""
        longest = ready = None
        host = self.host if restore else None
        disk = self.disk if restore else None
        lengths = set(self._lengths) | (host.lengths() if host is not None else set())
        lengths |= disk.lengths() if disk is not None else set()
        for length in sorted(lengths, reverse=True):
            if length >= max_length:
                continue
            key = prefix_hash(length)
            checkpoint = self._by_key.get(key)
            if checkpoint is None and host is not None and key in host and \
                    self.restore_pays(Tier.HOST, key, prefix_hash, accept):
                checkpoint = self._restore(key)
            if checkpoint is None and disk is not None and key in disk and \
                    self.restore_pays(Tier.DISK, key, prefix_hash, accept):
                checkpoint = self._load(key)
            if checkpoint is None or (accept is not None and not accept(checkpoint)):
                continue
            longest = longest or checkpoint
            if checkpoint.ready:
                ready = checkpoint
                break
        return longest, ready

    def restore_pays(self, tier: Tier, key: bytes, prefix_hash: Callable[[int], bytes],
                     accept: Callable[[Checkpoint], bool] | None = None) -> bool:
        """Whether bringing checkpoint `key` back from `tier` costs no more than twice computing the tokens
        it saves over the longest READY device checkpoint below it that `accept` takes (cache/reuse_rule.py).
        A decline is remembered for `tier_miss` (and counted in `declined`) and ages the tier's measured
        cost (cache/reuse_rates.py, re-probing); a restore forgets it."""
        if tier is Tier.HOST:
            entry = self.host.entry(key)
            length, state_tokens, num_bytes, read_done = entry.num_tokens, entry.state_tokens, entry.num_bytes, False
        else:  # (a file's state position is in its header, unread: its length stands for it)
            length, num_bytes, read_done = self.disk.length(key), self.disk.entry_bytes(key), self.disk.read_done(key)
            state_tokens = length
        below = self._resident_below(prefix_hash, length, accept)
        saved = max(state_tokens - (below.state_tokens if below is not None else 0), 0)
        verdict = estimate(self.rates, tier, num_bytes, saved, read_done=read_done)
        self._declined.pop(key, None)
        if verdict.restore or not self.restore_rule:
            return True
        self._declined[key] = length  # (the most recent last: the oldest are forgotten first)
        while len(self._declined) > _REMEMBERED_DECLINES:
            self._declined.popitem(last=False)
        self.declined[tier] += 1
        rates = self.rates
        for cost in (rates.host_restore,) if tier is Tier.HOST else (rates.disk_read, rates.disk_restore):
            cost.age()  # enough declines in a row and the tier is measured afresh (cache/reuse_rates.py)
        logger.debug("recompute is faster: %d-token checkpoint in the %s tier (%.3g s to move %d bytes, %.3g s to "
                     "compute %d tokens)", length, tier.value, verdict.restore_s, num_bytes, verdict.recompute_s, saved)
        return False

    def _resident_below(self, prefix_hash: Callable[[int], bytes], length: int,
                        accept: Callable[[Checkpoint], bool] | None) -> Checkpoint | None:
        """The longest READY device checkpoint on the prompt's path shorter than `length` that `accept` takes."""
        for shorter in sorted((n for n in self._lengths if n < length), reverse=True):
            checkpoint = self._by_key.get(prefix_hash(shorter))
            if checkpoint is not None and checkpoint.ready and (accept is None or accept(checkpoint)):
                return checkpoint
        return None

    def _restore(self, key: bytes) -> Checkpoint | None:
        """Bring a spilled checkpoint back from the host tier as READY; None when the device pools
        have no room for it even after evicting idle checkpoints (it stays on the host)."""
        if self._slots.num_free == 0 and not self.evict_one():
            return None
        if key not in self.host:  # that eviction's spill pushed it out of the host tier
            return None

        def allocate(count: int) -> list[int] | None:
            while self._blocks.num_free < count:
                if not self.evict_one():
                    return None
            return self._blocks.allocate(count)

        blocks = allocate(self.host.entry(key).num_blocks)
        if blocks is None:
            return None
        if key not in self.host:  # the evictions' spills pushed it out of the host tier too
            self._blocks.release(blocks)
            return None
        slot = self._slots.allocate()
        entry = self.host.take(key)
        self._record(Restore(entry.entry_id, slot, tuple(blocks)))
        checkpoint = Checkpoint(key, entry.num_tokens, slot, entry.kind, CheckpointState.READY, None,
                                state_tokens=entry.state_tokens, blocks=blocks, owner=None)
        self.eviction.track(checkpoint)
        self._by_key[key] = checkpoint
        self._lengths[entry.num_tokens] += 1
        logger.debug("restored from the host tier: %d-token %s checkpoint", entry.num_tokens, entry.kind.value)
        return checkpoint

    def orphans_between(self, prefix_hash: Callable[[int], bytes], start: int, end: int) -> list[Checkpoint]:
        """ORPHANED checkpoints on a prompt's path with start < length <= end."""
        found = []
        for length in self._lengths:
            if start < length <= end:
                checkpoint = self._by_key.get(prefix_hash(length))
                if checkpoint is not None and checkpoint.state is CheckpointState.ORPHANED:
                    found.append(checkpoint)
        return found

    def block_refs(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for checkpoint in self._by_key.values():
            refs.update(checkpoint.blocks)
        return refs

    # ------------------------------------------------------------------ transitions
    def register(self, key: bytes, num_tokens: int, producer: str, now: float,
                 kind: CheckpointKind = CheckpointKind.MARKER, state_tokens: int | None = None,
                 prompt_scores_k: int | None = None, owner: str = "") -> Checkpoint | None:
        """A new PENDING checkpoint produced by `producer` for tenant `owner`, keyed by the prefix of
        `num_tokens` tokens and holding the state after `state_tokens` (default: num_tokens); None
        when no slot can be freed for it (a miss; an owner at its fair share frees only its own)."""
        if key in self._by_key:
            raise RuntimeError("checkpoint registered twice")
        if self._slots.num_free == 0:
            own = owner if self.eviction.at_share(owner) else None
            if not self.evict_one(markers_too=not kind.automatic, owner=own):
                return None
        checkpoint = Checkpoint(key, num_tokens, self._slots.allocate(), kind, CheckpointState.PENDING, producer,
                                state_tokens=num_tokens if state_tokens is None else state_tokens,
                                prompt_scores_k=prompt_scores_k, registered_at=now,
                                turn=producer if kind.ends_turn else None, owner=owner)
        self.eviction.track(checkpoint)
        self._by_key[key] = checkpoint
        self._lengths[num_tokens] += 1
        logger.debug("registered: %d-token %s checkpoint, producer %s", num_tokens, kind.value, producer)
        return checkpoint

    def writing(self, checkpoint: Checkpoint, producer_blocks: list[int]) -> None:
        """The producer's step writes it: same-step consumers share these blocks (the live list)."""
        self._expect(checkpoint, CheckpointState.PENDING)
        checkpoint.producer_blocks = producer_blocks

    def attach_prompt_scores(self, checkpoint: Checkpoint, scores: object) -> None:
        """The producer's step computed the prefix's prompt logprobs (PENDING, being written)."""
        self._expect(checkpoint, CheckpointState.PENDING)
        checkpoint.prompt_scores = scores

    def mark_ready(self, checkpoint: Checkpoint, blocks: list[int]) -> None:
        """The producer's forward wrote the state; take references on the prefix's KV blocks."""
        self._expect(checkpoint, CheckpointState.PENDING)
        self._blocks.incref(blocks)
        checkpoint.blocks = list(blocks)
        checkpoint.state = CheckpointState.READY
        checkpoint.producer = None
        checkpoint.producer_blocks = []
        if checkpoint.prompt_scores is None:
            checkpoint.prompt_scores_k = None
        self.counters.created[checkpoint.kind] += 1
        self.eviction.touch(checkpoint)
        if self.disk is not None:
            self._save(checkpoint)
        logger.debug("ready: %d tokens (%s)", checkpoint.num_tokens, checkpoint.kind.value)

    def keep_state(self, checkpoint: Checkpoint, slot: int, blocks: list[int]) -> None:
        """A PENDING checkpoint whose state is already in request row `slot` (a finished request's
        turn end): record the row copy into its own row, then mark it ready with `blocks`."""
        self._expect(checkpoint, CheckpointState.PENDING)
        self._record(StateCopy(slot, checkpoint.slot))
        self.mark_ready(checkpoint, blocks)

    def producer_left(self, checkpoint: Checkpoint) -> None:
        """The producer left before writing: ORPHANED while requests wait for it, else removed."""
        self._expect(checkpoint, CheckpointState.PENDING)
        checkpoint.producer = None
        checkpoint.producer_blocks = []
        if checkpoint.waiters:
            checkpoint.state = CheckpointState.ORPHANED
            logger.debug("orphaned: %d-token checkpoint, %d waiting", checkpoint.num_tokens, checkpoint.waiters)
        else:
            self._remove(checkpoint)

    def promote(self, checkpoint: Checkpoint, producer: str, prompt_scores_k: int | None = None) -> None:
        """ORPHANED -> PENDING with a new producer (a request that needs it)."""
        self._expect(checkpoint, CheckpointState.ORPHANED)
        checkpoint.state = CheckpointState.PENDING
        checkpoint.producer = producer
        checkpoint.prompt_scores_k = prompt_scores_k
        logger.debug("promoted: %s now produces the %d-token checkpoint", producer, checkpoint.num_tokens)

    def add_waiter(self, checkpoint: Checkpoint) -> None:
        """A request is deferred on an unready checkpoint (it stays a waiter, protecting the checkpoint
        from eviction, until it is scheduled or leaves)."""
        if checkpoint.ready:
            raise RuntimeError("a request is deferred only on an unready checkpoint")
        checkpoint.waiters += 1

    def reserve(self, checkpoint: Checkpoint) -> None:
        """A queued request (waiting for its admission, not for the checkpoint) will read it: no
        registration evicts it while reserved, so a burst larger than one step keeps its prefix."""
        if not checkpoint.ready:
            raise RuntimeError("only a READY checkpoint is reserved (unready ones are never evicted)")
        checkpoint.reserved += 1

    def unreserve(self, checkpoint: Checkpoint) -> None:
        if checkpoint.reserved <= 0:
            raise RuntimeError("checkpoint reservation count would go negative")
        checkpoint.reserved -= 1

    def drop_waiter(self, checkpoint: Checkpoint) -> None:
        """A deferred request stops waiting; an orphan nobody waits for any more is removed."""
        if checkpoint.waiters <= 0:
            raise RuntimeError("waiter count would go negative")
        checkpoint.waiters -= 1
        if checkpoint.state is CheckpointState.ORPHANED and checkpoint.waiters == 0:
            self._remove(checkpoint)

    def pin(self, checkpoint: Checkpoint, tokens_saved: int) -> None:
        """A segment of the step being planned reads it (READY, or PENDING and written earlier in
        the same forward); pinned checkpoints are never evicted."""
        if checkpoint.state not in (CheckpointState.READY, CheckpointState.PENDING):
            raise RuntimeError(f"cannot read a {checkpoint.state.value} checkpoint")
        checkpoint.pins += 1
        checkpoint.hits += 1
        if self.disk is not None:
            self.disk.touch(checkpoint.key)
        self.counters.hits[checkpoint.kind] += 1
        self.counters.tokens_saved[checkpoint.kind] += tokens_saved
        self.eviction.read(checkpoint)

    def unpin(self, checkpoint: Checkpoint) -> None:
        if checkpoint.pins <= 0:
            raise RuntimeError("checkpoint pin count would go negative")
        checkpoint.pins -= 1

    def evict_one(self, *, markers_too: bool = True, owner: str | None = None) -> bool:
        """Evict one idle READY checkpoint in the eviction policy's order (cache/eviction.py; only
        `owner`'s when given). False when none is.

        With a host tier the victim spills there, unless its session moved past it: a turn's end that
        the next turn read (`passed`) and nothing read more than that once. Its only reader has
        registered the turn ends after it, so only an edit of that turn could read it again; a spill
        would cost the step loop its copies (~3 ms of host time at 35B shapes, docs/auto_checkpoints.md)
        and the tier the room of a checkpoint that can still be read (at 256 chat sessions the tier took
        1,177 spills, older turns' ends, and restored none: docs/server.md, session 16)."""
        idle = [c for c in self._by_key.values() if c.ready and c.pins == 0 and c.waiters == 0 and c.reserved == 0
                and (markers_too or c.kind.automatic) and (owner is None or c.owner == owner)]
        if not idle:
            return False
        victim, session_latest = self.eviction.victim(idle)
        if session_latest:
            self.counters.evicted_session_latest += 1
        if self.host is not None and victim.passed and victim.hits <= 1:
            self.counters.unspilled_passed += 1
        elif self.host is not None:
            entry, dropped = self.host.spill(victim.key, victim.num_tokens, victim.state_tokens, victim.kind,
                                             len(victim.blocks))
            for entry_id in dropped:
                self._record(HostDrop(entry_id))
            if entry is not None:
                self._record(Spill(entry.entry_id, victim.slot, tuple(victim.blocks)))
        self._remove(victim)
        self.counters.evicted[victim.kind] += 1
        logger.debug("evicted: %d-token %s checkpoint", victim.num_tokens, victim.kind.value)
        return True

    def evict_all_idle(self) -> int:
        """Evict every idle READY checkpoint; returns how many (an idle engine can free everything)."""
        count = 0
        while self.evict_one():
            count += 1
        return count

    def reset(self) -> bool:
        """Forget every checkpoint, on the device and in the host tier, without spilling (vLLM's
        `reset_prefix_cache`). Only when all of them are idle and READY: False, and nothing changed,
        while any is being written, pinned, waited on or reserved."""
        if any(not c.ready or c.pins or c.waiters or c.reserved for c in self._by_key.values()):
            return False
        for checkpoint in list(self._by_key.values()):
            self._remove(checkpoint)
        if self.host is not None:
            for entry_id in self.host.clear():
                self._record(HostDrop(entry_id))
        if self.disk is not None:
            for name in self.disk.clear():
                self._record(DiskDrop(name))
        return True

    # ------------------------------------------------------------------ disk tier
    def _save(self, checkpoint: Checkpoint) -> None:
        """Write a checkpoint that just became READY through to the disk tier (unless it has the file)."""
        name, dropped = self.disk.save(checkpoint.key, checkpoint.num_tokens, len(checkpoint.blocks),
                                       reads=checkpoint.hits)
        for old in dropped:
            self._record(DiskDrop(old))
        if name is not None:
            self._record(DiskSave(name, checkpoint.key, checkpoint.num_tokens, checkpoint.state_tokens,
                                  checkpoint.kind.value, checkpoint.slot, tuple(checkpoint.blocks)))

    def _load(self, key: bytes) -> Checkpoint | None:
        """Bring a checkpoint back from its file as READY; None when the device pools have no room for
        it (the file stays) or the file is not usable (a miss: rejected, the slot and blocks released)."""
        num_blocks = self.disk.num_blocks(key)
        if num_blocks > self._blocks.num_blocks:  # written by an engine with a larger KV pool: never fits
            return None
        if self._slots.num_free == 0 and not self.evict_one():
            return None
        while self._blocks.num_free < num_blocks:
            if not self.evict_one():
                return None
        slot, blocks = self._slots.allocate(), self._blocks.allocate(num_blocks)
        try:
            header, payload, seconds = self.disk.load(key)
            self.rates.disk_read.observe(seconds, self.disk.file_bytes(num_blocks))
            kind = CheckpointKind(header.kind)
            if header.num_blocks != num_blocks:
                raise DamagedFile(FileDamage.CORRUPT, f"{header.num_blocks} KV blocks, its size says {num_blocks}")
        except (DamagedFile, ValueError) as error:
            self._slots.free(slot)
            self._blocks.release(blocks)
            name = self.disk.reject(key, error.damage if isinstance(error, DamagedFile) else FileDamage.CORRUPT)
            if name is not None:
                self._record(DiskDrop(name))
            return None
        self._record(DiskRestore(slot, tuple(blocks), payload))
        checkpoint = Checkpoint(key, header.num_tokens, slot, kind, CheckpointState.READY, None,
                                state_tokens=header.state_tokens, blocks=blocks, owner=None)
        self.eviction.track(checkpoint)
        self._by_key[key] = checkpoint
        self._lengths[header.num_tokens] += 1
        logger.debug("restored from the disk tier: %d-token %s checkpoint", header.num_tokens, kind.value)
        return checkpoint

    def read_ahead(self, prefix_hash: Callable[[int], bytes], max_length: int) -> None:
        """A prompt was queued: when its longest checkpoint (length < max_length) is only on disk, start
        reading that file now, so that its admission's lookup finds it in memory (cache/disk_tier.py)."""
        if self.disk is None or not len(self.disk):
            return
        lengths = set(self._lengths) | self.disk.lengths() | (self.host.lengths() if self.host is not None else set())
        for length in sorted(lengths, reverse=True):
            if length >= max_length:
                continue
            key = prefix_hash(length)
            if key in self._by_key or (self.host is not None and key in self.host):
                return
            if key in self.disk and self.restore_pays(Tier.DISK, key, prefix_hash):
                self.disk.read_ahead(key)
                return

    def tier_miss(self, prefix_hash: Callable[[int], bytes], cached: int, max_length: int) -> CacheMissReason | None:
        """The reason a prompt (its prefix hashes) missed a checkpoint of the host or disk tier that would
        have given it more than `cached` tokens, the longest such first: recomputing was measured faster
        (RECOMPUTE_FASTER: declined and still in its tier), or the damage of a file rejected recently."""
        found: list[tuple[int, CacheMissReason]] = []
        for length in {n for n in self._declined.values() if cached < n < max_length}:
            key = prefix_hash(length)
            if self._declined.get(key) == length and self._in_tier(key):
                found.append((length, CacheMissReason.RECOMPUTE_FASTER))
        if self.disk is not None:
            for length in self.disk.failure_lengths():
                failure = self.disk.failure(prefix_hash(length)) if cached < length < max_length else None
                if failure is not None:
                    found.append((length, _DAMAGE_REASONS[failure[1]]))
        return max(found, key=lambda item: item[0])[1] if found else None

    def _in_tier(self, key: bytes) -> bool:
        return (self.host is not None and key in self.host) or (self.disk is not None and key in self.disk)

    def _expect(self, checkpoint: Checkpoint, state: CheckpointState) -> None:
        if checkpoint.state is not state:
            raise RuntimeError(f"checkpoint is {checkpoint.state.value}, expected {state.value}")

    def _remove(self, checkpoint: Checkpoint) -> None:
        self.eviction.forget(checkpoint)
        del self._by_key[checkpoint.key]
        self._lengths[checkpoint.num_tokens] -= 1
        if not self._lengths[checkpoint.num_tokens]:
            del self._lengths[checkpoint.num_tokens]
        if checkpoint.blocks:
            self._blocks.release(checkpoint.blocks)
            checkpoint.blocks = []
        self._slots.free(checkpoint.slot)
        checkpoint.state = CheckpointState.EVICTED

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, *, readers: Mapping[bytes, int], waiters: Mapping[bytes, int],
                        producers: Mapping[bytes, str], reserved: Mapping[bytes, int]) -> None:
        """Cross-check against the engine's view: `readers` (key -> segments of the step in flight
        reading it), `waiters` (key -> requests deferred on it), `producers` (key -> id of the live
        request that will write it), `reserved` (key -> queued requests that will read it). Raises
        AssertionError on any difference."""
        slots = [c.slot for c in self._by_key.values()]
        if len(set(slots)) != len(slots) or len(slots) != self._slots.num_used:
            raise AssertionError("checkpoint slots and registry disagree")
        if Counter(c.num_tokens for c in self._by_key.values()) != self._lengths:
            raise AssertionError("checkpoint length index is stale")
        self.eviction.check_integrity()
        for key, checkpoint in self._by_key.items():
            name = f"{checkpoint.num_tokens}-token {checkpoint.state.value} checkpoint"
            if checkpoint.pins != readers.get(key, 0):
                raise AssertionError(f"{name} has {checkpoint.pins} pins but {readers.get(key, 0)} live readers")
            if checkpoint.waiters != waiters.get(key, 0):
                raise AssertionError(f"{name} counts {checkpoint.waiters} waiters, {waiters.get(key, 0)} wait")
            if checkpoint.reserved != reserved.get(key, 0):
                raise AssertionError(f"{name} counts {checkpoint.reserved} reservations, "
                                     f"{reserved.get(key, 0)} hold one")
            if checkpoint.producer != producers.get(key):
                raise AssertionError(f"{name}: producer {checkpoint.producer!r}, live {producers.get(key)!r}")
            if checkpoint.state is CheckpointState.READY:
                if checkpoint.producer is not None or not checkpoint.blocks and checkpoint.num_tokens:
                    raise AssertionError(f"{name} has a producer or no KV blocks")
            elif checkpoint.blocks:
                raise AssertionError(f"{name} holds KV blocks")
            if checkpoint.state is CheckpointState.ORPHANED and checkpoint.waiters == 0:
                raise AssertionError(f"{name} with no waiter was not dropped")
            if checkpoint.state is CheckpointState.EVICTED:
                raise AssertionError(f"{name} is still registered")
        for key in set(readers) | set(waiters) | set(producers) | set(reserved):
            if key not in self._by_key:
                raise AssertionError("a request refers to a checkpoint the registry does not hold")
