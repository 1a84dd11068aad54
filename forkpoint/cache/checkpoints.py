"""Checkpoint registry: exact-prefix snapshots of recurrent state plus the KV blocks of the prefix.

Life cycle of one checkpoint::

    register (unready, producer set, slot taken)
        -> mark_ready (the producer's forward wrote the state; KV block refs taken)
        -> idle (no pins) -> evicted LRU when a slot or KV blocks are needed
    unready + producer gone (abort, preemption) -> orphaned: the next request that needs it is
        promoted to producer.

Invariants (check_integrity): every registered checkpoint owns exactly one checkpoint slot; only
ready checkpoints hold KV block references; pins are never negative; `lengths` counts the
registered checkpoints of each prefix length.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.state_pool import SlotAllocator

logger = logging.getLogger("forkpoint.checkpoints")


@dataclass(eq=False)
class Checkpoint:
    key: bytes
    num_tokens: int
    slot: int
    producer: str | None
    ready: bool = False
    blocks: list[int] = field(default_factory=list)
    # while unready: the producer's block table, so same-step consumers can share its prefix blocks
    producer_blocks: list[int] = field(default_factory=list)
    pins: int = 0  # consumers scheduled in the current step
    waiters: int = 0  # deferred requests waiting for it to become ready
    last_used: int = 0
    registered_at: float = 0.0


class CheckpointRegistry:
    def __init__(self, slots: SlotAllocator, block_pool: BlockPool) -> None:
        self._slots = slots
        self._blocks = block_pool
        self._by_key: dict[bytes, Checkpoint] = {}
        self.lengths: Counter[int] = Counter()
        self._clock = itertools.count(1)
        self.num_created = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self):
        return iter(list(self._by_key.values()))

    def get(self, key: bytes) -> Checkpoint | None:
        return self._by_key.get(key)

    @property
    def num_pending(self) -> int:
        return sum(1 for c in self._by_key.values() if not c.ready)

    def touch(self, checkpoint: Checkpoint) -> None:
        checkpoint.last_used = next(self._clock)

    def register(self, key: bytes, num_tokens: int, producer: str, now: float) -> Checkpoint | None:
        """New unready checkpoint produced by `producer`; None when no slot can be freed."""
        if key in self._by_key:
            raise RuntimeError("checkpoint registered twice")
        if self._slots.num_free == 0 and not self.evict_one():
            return None
        checkpoint = Checkpoint(key, num_tokens, self._slots.allocate(), producer, registered_at=now)
        self.touch(checkpoint)
        self._by_key[key] = checkpoint
        self.lengths[num_tokens] += 1
        return checkpoint

    def mark_ready(self, checkpoint: Checkpoint, blocks: list[int]) -> None:
        """The producer's forward wrote the state; take references on the prefix's KV blocks."""
        self._blocks.incref(blocks)
        checkpoint.blocks = list(blocks)
        checkpoint.ready = True
        checkpoint.producer = None
        checkpoint.producer_blocks = []
        self.num_created += 1
        self.touch(checkpoint)

    def orphan(self, checkpoint: Checkpoint) -> None:
        """The producer left before writing. With waiters, the next one to be scheduled is promoted to
        producer; without, the checkpoint is dropped."""
        checkpoint.producer = None
        checkpoint.producer_blocks = []
        if checkpoint.waiters == 0:
            self.remove(checkpoint)

    def evict_one(self) -> bool:
        """Evict the least recently used idle ready checkpoint. False when none is idle."""
        idle = [c for c in self._by_key.values() if c.ready and c.pins == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_used)
        self.remove(victim)
        self.num_evicted += 1
        logger.debug("evicted: %d-token checkpoint (least recently used)", victim.num_tokens)
        return True

    def remove(self, checkpoint: Checkpoint) -> None:
        del self._by_key[checkpoint.key]
        self.lengths[checkpoint.num_tokens] -= 1
        if not self.lengths[checkpoint.num_tokens]:
            del self.lengths[checkpoint.num_tokens]
        if checkpoint.blocks:
            self._blocks.release(checkpoint.blocks)
        self._slots.free(checkpoint.slot)

    def block_refs(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for checkpoint in self._by_key.values():
            refs.update(checkpoint.blocks)
        return refs

    def check_integrity(self) -> None:
        slots = [c.slot for c in self._by_key.values()]
        if len(set(slots)) != len(slots) or len(slots) != self._slots.num_used:
            raise AssertionError("checkpoint slots and registry disagree")
        lengths = Counter(c.num_tokens for c in self._by_key.values())
        if lengths != self.lengths:
            raise AssertionError("checkpoint length index is stale")
        for checkpoint in self._by_key.values():
            if checkpoint.pins < 0 or checkpoint.waiters < 0:
                raise AssertionError("negative checkpoint pin count")
            if checkpoint.blocks and not checkpoint.ready:
                raise AssertionError("unready checkpoint holds KV blocks")
            if not checkpoint.ready and checkpoint.producer is None and checkpoint.waiters == 0:
                raise AssertionError("orphaned checkpoint with no waiter was not dropped")
