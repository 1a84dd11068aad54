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
- READY: written; holds KV block references; idle ones are evicted by the value policy below.

Readers and waiters: `pins` counts the segments of the step in flight that read it (taken when
scheduled, released when the step is committed or fails); `waiters` counts the requests deferred on
it. Both are transitions of this class; callers never write a checkpoint's fields.

Eviction policy (explicit): only idle READY checkpoints (no pins, and no deferred request still on
its way to read it: waiters keep counting after it becomes ready) are evicted, in this order:

1. automatic checkpoints that are not a live session's latest, lowest value first. The value is
   GreedyDual-Size-Frequency's: `inflation + (1 + hits) x state_tokens` (the tokens each read saves,
   weighted by how often it was read), set when it is registered, written, read or restored; each
   eviction raises `inflation` to the victim's value, so what was last used long ago loses to what
   is used now even when it saves more (recency), without a clock in the formula;
2. the latest checkpoint of each live session, the session idle longest first (`session_heads`);
3. marked checkpoints (kind MARKER), least recently used first. An automatic checkpoint can never
   evict a marked one: `register(..., kind=auto)` evicts only automatic checkpoints to make room.

Tenants (`owner`: the client a request comes from, the server's `user` field; "" for requests
without one, None for checkpoints restored from the host or disk tier, which remember none): each
owner's fair share is the checkpoint pool's slots divided by the owners holding checkpoints (the
registering one included). An owner at or over its share that registers a checkpoint evicts one of
its own to make room (by the order above), and registers nothing (a miss) when none of its own is
idle; every eviction takes an over-share owner's checkpoint before anyone else's. So one client
flooding unique prefixes evicts its own checkpoints, not every other tenant's; with one owner
(no `user` fields, the offline engine) the policy is exactly the order above.

Sessions: the engine sees no session id (a chat's `prompt_cache_key` stays in the server), so a
session is recognised by its turns. The checkpoints a request registers at its turn's ends (kinds
CHAT_TURN, PROMPT_END, TURN_END; the `turn` they carry is the registering request's id) are where
that conversation's next turn can start. While none of them has been read, the session is waiting
for its next turn: it is live, and its *latest* checkpoint is the one the next turn will read (the
longest CHAT_TURN when the turn has one: chat templates re-render the previous reply, so a chat's
next prompt leaves the turn at its rendered history; else the longest of its prompt end and turn
end: a completion client resends the text). Reading any of them means the next turn came (or the
prompt was sent again): that turn's checkpoints become ordinary ones (order 1) and the reader's own
turn-end checkpoints are the session's latest from then on. A session that never comes back keeps
its latest checkpoint until the pool holds nothing else to evict, and then goes first (idle longest).

Under KV pressure the scheduler evicts in the same order until the blocks it needs are free
(scheduler.py `_evict_for_memory`): a checkpoint's KV references are given back with its row.

Device memory: the registry touches no tensor. The writes its transitions imply (a spill to the
host tier on eviction, a restore on a hit in the host tier, a row copy into a kept turn end) are
recorded, in order and numbered, as the step plan's device writes (step/plan.py); the scheduler
takes them (`take_writes`) into the next plan, which the runner applies before that step's forward,
and gives a failed plan's back (`give_back_writes`).

Disk tier (`disk`, cache/disk_tier.py): a checkpoint that becomes READY is also written to a file
(`DiskSave`); a lookup that misses the device and the host tier reads and verifies the file here and
restores it as READY (`DiskRestore`, the verified payload); a file that is damaged or foreign is a
miss, and the slot and blocks taken for it are released at once.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.disk_format import DamagedFile, FileDamage
from forkpoint.cache.disk_tier import DiskTier
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.state_pool import SlotAllocator
from forkpoint.step.plan import DeviceWrite, DiskDrop, DiskRestore, DiskSave, HostDrop, Restore, Spill, StateCopy

logger = logging.getLogger("forkpoint.checkpoints")


class CheckpointState(enum.Enum):
    PENDING = "pending"
    ORPHANED = "orphaned"
    READY = "ready"
    EVICTED = "evicted"  # removed from the registry (a stale reference reads this)


class CheckpointKind(enum.Enum):
    """Why a checkpoint exists: a marker (or checkpoint_positions) or the engine's own placement."""

    MARKER = "marker"
    SHARED_PREFIX = "shared_prefix"  # the common prefix of requests that arrived together
    JUNCTION = "junction"  # where a prompt leaves a prefix computed before
    PROMPT_END = "prompt_end"  # all but the last token of a prompt (the same prompt sent again)
    TURN_END = "turn_end"  # prompt plus all but the last output token of a finished request
    CHAT_TURN = "chat_turn"  # a chat's rendered history before its generation prompt (or a tool result's end)

    @property
    def automatic(self) -> bool:
        return self is not CheckpointKind.MARKER

    @property
    def ends_turn(self) -> bool:
        """Where a conversation's next turn can start (a session's latest checkpoint is one of these)."""
        return self in (CheckpointKind.CHAT_TURN, CheckpointKind.PROMPT_END, CheckpointKind.TURN_END)


class CacheMissReason(enum.Enum):
    """Why a request's reuse stopped short of the tokens it shares with prompts computed before
    (`RequestOutput.cache_miss_reason`; None there when it reused all it could)."""

    DISABLED = "disabled"  # checkpoints are off (enable_checkpoints=False)
    BELOW_MINIMUM = "below_minimum"  # the shared prefix is shorter than auto_checkpoint_min_tokens
    NO_CHECKPOINT = "no_checkpoint"  # no state was kept where the prompt leaves the earlier one
    TEMPLATE_DIVERGENCE = "template_divergence"  # it leaves an earlier turn inside that turn's generation prompt
    # or output: the template re-rendered it, or the client's text re-tokenised differently
    EVICTED_DEVICE = "evicted_device"  # a checkpoint stood there and was evicted (no host tier)
    EVICTED_HOST = "evicted_host"  # ... and is not in the host tier either
    EVICTED_DISK = "evicted_disk"  # ... nor in the disk tier (checkpoint_dir), or its file is gone
    DISK_TRUNCATED = "disk_truncated"  # its file in the disk tier is shorter than its header says
    DISK_CORRUPT = "disk_corrupt"  # its file's checksum, magic or fields do not match (deleted)
    DISK_FOREIGN = "disk_foreign"  # its file was written for another model, dtype, layout or tokenizer
    DISK_READ_ERROR = "disk_read_error"  # the operating system could not read its file
    WAIT_TIMEOUT = "wait_timeout"  # it stopped waiting for an unready checkpoint (checkpoint_wait_s)
    PROMPT_LOGPROBS = "prompt_logprobs"  # the checkpoint there carries no prompt scores for its top-k


_DAMAGE_REASONS = {
    FileDamage.MISSING: CacheMissReason.EVICTED_DISK, FileDamage.TRUNCATED: CacheMissReason.DISK_TRUNCATED,
    FileDamage.CORRUPT: CacheMissReason.DISK_CORRUPT, FileDamage.FOREIGN: CacheMissReason.DISK_FOREIGN,
    FileDamage.READ_ERROR: CacheMissReason.DISK_READ_ERROR}


@dataclass(eq=False)
class Checkpoint:
    """Read-only for everyone but `CheckpointRegistry` (see the module docstring)."""

    key: bytes
    num_tokens: int
    slot: int
    kind: CheckpointKind
    state: CheckpointState
    producer: str | None
    # the position its state and KV hold (<= num_tokens, the prefix it is keyed by); less only with
    # checkpoint_exact, where readers compute tokens [state_tokens, ...) themselves
    state_tokens: int = -1
    # prompt logprobs of the prefix, for readers that ask for them (opaque here; see
    # runner/prompt_logprobs.py PromptScores): the top-k its producer computes (None: it computes none)
    # and, once written, the scores themselves
    prompt_scores_k: int | None = None
    prompt_scores: object | None = None
    blocks: list[int] = field(default_factory=list)
    producer_blocks: list[int] = field(default_factory=list)
    pins: int = 0
    waiters: int = 0
    reserved: int = 0  # queued requests that will read it (scheduler: reserve / unreserve)
    hits: int = 0
    last_used: int = 0
    registered_at: float = 0.0
    # eviction (see the module docstring): its GreedyDual value, and the id of the request whose turn
    # it ends (CHAT_TURN, PROMPT_END, TURN_END) while that turn's session waits for its next turn
    value: float = 0.0
    turn: str | None = None
    owner: str | None = ""  # the tenant it counts against (see the module docstring)

    def __post_init__(self) -> None:
        if self.state_tokens < 0:
            self.state_tokens = self.num_tokens
        if not 0 < self.state_tokens <= self.num_tokens:
            raise ValueError(f"a checkpoint's state position {self.state_tokens} must lie in 1..{self.num_tokens}")

    @property
    def ready(self) -> bool:
        return self.state is CheckpointState.READY


@dataclass
class CheckpointCounters:
    """Per kind: created (became ready), hits (segments that read it), tokens_saved, evicted;
    evicted_session_latest: evictions of a live session's latest checkpoint (the last resort)."""

    created: Counter[CheckpointKind] = field(default_factory=Counter)
    hits: Counter[CheckpointKind] = field(default_factory=Counter)
    tokens_saved: Counter[CheckpointKind] = field(default_factory=Counter)
    evicted: Counter[CheckpointKind] = field(default_factory=Counter)
    evicted_session_latest: int = 0


class CheckpointRegistry:
    def __init__(self, slots: SlotAllocator, block_pool: BlockPool, host: HostTier | None = None,
                 disk: DiskTier | None = None) -> None:
        self._slots = slots
        self._blocks = block_pool
        self.host = host  # evicted checkpoints spill here and come back on a hit
        self.disk = disk  # READY checkpoints are written through to files, read back on a miss elsewhere
        self._by_key: dict[bytes, Checkpoint] = {}
        self._lengths: Counter[int] = Counter()
        self._clock = itertools.count(1)
        self.counters = CheckpointCounters()
        self._writes: list[tuple[int, DeviceWrite]] = []  # (number, write) not yet taken, in order
        self._next_number = 0
        self._inflation = 0.0  # GreedyDual's L: the value of the last checkpoint evicted (never decreases)
        self._turns: dict[str, set[bytes]] = {}  # live sessions: turn id -> keys of that turn's end checkpoints
        self._owners: Counter[str] = Counter()  # tenant -> checkpoints registered for it (None: not counted)

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
        found is brought back from the host or the disk tier); without, only those on the device."""
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
            if checkpoint is None and host is not None and key in host:
                checkpoint = self._restore(key)
            if checkpoint is None and disk is not None and key in disk:
                checkpoint = self._load(key)
            if checkpoint is None or (accept is not None and not accept(checkpoint)):
                continue
            longest = longest or checkpoint
            if checkpoint.ready:
                ready = checkpoint
                break
        return longest, ready

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
        self._touch(checkpoint)
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
            own = owner if self._owners[owner] >= self.fair_share(owner) else None
            if not self.evict_one(markers_too=not kind.automatic, owner=own):
                return None
        checkpoint = Checkpoint(key, num_tokens, self._slots.allocate(), kind, CheckpointState.PENDING, producer,
                                state_tokens=num_tokens if state_tokens is None else state_tokens,
                                prompt_scores_k=prompt_scores_k, registered_at=now, owner=owner)
        self._owners[owner] += 1
        if kind.ends_turn:
            checkpoint.turn = producer
            self._turns.setdefault(producer, set()).add(key)
        self._touch(checkpoint)
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
        self._touch(checkpoint)
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
        self.counters.hits[checkpoint.kind] += 1
        self.counters.tokens_saved[checkpoint.kind] += tokens_saved
        if checkpoint.turn is not None:
            self._end_session_wait(checkpoint.turn)  # its session's next turn came (module docstring)
        self._touch(checkpoint)

    def unpin(self, checkpoint: Checkpoint) -> None:
        if checkpoint.pins <= 0:
            raise RuntimeError("checkpoint pin count would go negative")
        checkpoint.pins -= 1

    def session_heads(self) -> set[bytes]:
        """The keys of each live session's latest READY checkpoint (see the module docstring)."""
        heads = set()
        for keys in self._turns.values():
            ready = [self._by_key[key] for key in keys if self._by_key[key].ready]
            if ready:
                heads.add(max(ready, key=_next_turn_reads).key)
        return heads

    def fair_share(self, owner: str) -> int:
        """The checkpoint slots `owner` may hold before its registrations evict only its own: the
        pool's slots over the owners holding checkpoints, `owner` included (at least one)."""
        owners = len(self._owners) + (owner not in self._owners)  # every counted owner holds one or more
        return max(1, (self._slots.num_free + self._slots.num_used) // owners)

    def evict_one(self, *, markers_too: bool = True, owner: str | None = None) -> bool:
        """Evict one idle READY checkpoint by the policy in the module docstring (only `owner`'s
        when given). False when none is."""
        idle = [c for c in self._by_key.values() if c.ready and c.pins == 0 and c.waiters == 0 and c.reserved == 0
                and (markers_too or c.kind.automatic) and (owner is None or c.owner == owner)]
        if not idle:
            return False
        heads = self.session_heads()
        share = self.fair_share(next(iter(self._owners), ""))  # the same for every owner holding checkpoints
        over = {o for o, count in self._owners.items() if count > share}

        def order(c: Checkpoint) -> tuple[bool, int, float, int]:
            fair = c.owner not in over  # over-share owners' checkpoints go first
            if not c.kind.automatic:
                return fair, 2, 0.0, c.last_used
            if c.key in heads:
                return fair, 1, 0.0, c.last_used
            return fair, 0, c.value, c.last_used

        victim = min(idle, key=order)
        self._inflation = max(self._inflation, victim.value)
        if victim.key in heads:
            self.counters.evicted_session_latest += 1
        if self.host is not None:
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
        name, dropped = self.disk.save(checkpoint.key, checkpoint.num_tokens, len(checkpoint.blocks))
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
            header, payload = self.disk.load(key)
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
        self._touch(checkpoint)
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
            if key in self.disk:
                self.disk.read_ahead(key)
                return

    def disk_miss(self, prefix_hash: Callable[[int], bytes], cached: int, max_length: int) -> CacheMissReason | None:
        """The reason a prompt (its prefix hashes) missed a file of the disk tier that would have
        given it more than `cached` tokens: the damage of the longest such file rejected recently."""
        if self.disk is None:
            return None
        for length in sorted(self.disk.failure_lengths(), reverse=True):
            if cached < length < max_length:
                failure = self.disk.failure(prefix_hash(length))
                if failure is not None:
                    return _DAMAGE_REASONS[failure[1]]
        return None

    def _touch(self, checkpoint: Checkpoint) -> None:
        checkpoint.last_used = next(self._clock)
        checkpoint.value = self._inflation + (1 + checkpoint.hits) * checkpoint.state_tokens

    def _end_session_wait(self, turn: str) -> None:
        """The session whose turn `turn` ended is no longer waiting on it: its checkpoints become
        ordinary ones."""
        for key in self._turns.pop(turn, ()):
            self._by_key[key].turn = None

    def _expect(self, checkpoint: Checkpoint, state: CheckpointState) -> None:
        if checkpoint.state is not state:
            raise RuntimeError(f"checkpoint is {checkpoint.state.value}, expected {state.value}")

    def _remove(self, checkpoint: Checkpoint) -> None:
        if checkpoint.turn is not None:
            keys = self._turns[checkpoint.turn]
            keys.discard(checkpoint.key)
            if not keys:
                del self._turns[checkpoint.turn]
            checkpoint.turn = None
        del self._by_key[checkpoint.key]
        if checkpoint.owner is not None:
            self._owners[checkpoint.owner] -= 1
            if not self._owners[checkpoint.owner]:
                del self._owners[checkpoint.owner]
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
        if Counter(c.owner for c in self._by_key.values() if c.owner is not None) != self._owners:
            raise AssertionError("the per-tenant checkpoint counts are stale")
        turns: dict[str, set[bytes]] = {}
        for checkpoint in self._by_key.values():
            if checkpoint.turn is not None:
                turns.setdefault(checkpoint.turn, set()).add(checkpoint.key)
        if turns != self._turns:
            raise AssertionError("the live sessions' turn index disagrees with the checkpoints' turns")
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


def _next_turn_reads(checkpoint: Checkpoint) -> tuple[bool, int]:
    """Which of a turn's end checkpoints its session's next turn reads (the largest is the session's
    latest): a chat turn's rendered history before a prompt end or turn end, then the longest."""
    return checkpoint.kind is CheckpointKind.CHAT_TURN, checkpoint.num_tokens
