"""Eviction policy of the checkpoint registry: which idle checkpoint leaves first.

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
prompt was sent again): that turn's checkpoints become ordinary ones (order 1), *passed*, and the reader's own
turn-end checkpoints are the session's latest from then on. A session that never comes back keeps
its latest checkpoint until the pool holds nothing else to evict, and then goes first (idle longest).

Under KV pressure the scheduler evicts in the same order until the blocks it needs are free
(scheduler.py `_evict_for_memory`): a checkpoint's KV references are given back with its row.

The registry (cache/checkpoints.py) owns the life cycle and does the evicting (the spill to the host
tier, the slot and KV blocks given back); `EvictionPolicy` keeps the numbers the order is made of
(the values and their inflation, the use clock, the live sessions' turn ends, each tenant's count),
is told of every registration, restore, read and removal, and picks the victim.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping

from forkpoint.cache.checkpoint_types import Checkpoint, CheckpointKind
from forkpoint.cache.state_pool import SlotAllocator


class EvictionPolicy:
    """The eviction order of one registry's checkpoints. It writes their eviction fields (`value`,
    `last_used`, `turn`) and nothing else; `checkpoints` is the registry's map by key (read here)."""

    def __init__(self, slots: SlotAllocator, checkpoints: Mapping[bytes, Checkpoint]) -> None:
        self._slots = slots
        self._checkpoints = checkpoints
        self._clock = itertools.count(1)
        self._inflation = 0.0  # GreedyDual's L: the value of the last checkpoint evicted (never decreases)
        self._turns: dict[str, set[bytes]] = {}  # live sessions: turn id -> keys of that turn's end checkpoints
        self._owners: Counter[str] = Counter()  # tenant -> checkpoints registered for it (None: not counted)

    def track(self, checkpoint: Checkpoint) -> None:
        """A checkpoint joins the registry (registered, or restored from a tier): it counts against its
        owner (unless None) and, when it ends a turn (`turn` set), its session is live."""
        if checkpoint.owner is not None:
            self._owners[checkpoint.owner] += 1
        if checkpoint.turn is not None:
            self._turns.setdefault(checkpoint.turn, set()).add(checkpoint.key)
        self.touch(checkpoint)

    def touch(self, checkpoint: Checkpoint) -> None:
        """It was registered, written, read or restored: most recently used, and valued at what its
        reads save now."""
        checkpoint.last_used = next(self._clock)
        checkpoint.value = self._inflation + (1 + checkpoint.hits) * checkpoint.state_tokens

    def read(self, checkpoint: Checkpoint) -> None:
        """A segment reads it: when it ends a turn, that session's next turn came, and the turn's
        checkpoints become ordinary ones."""
        if checkpoint.turn is not None:
            for key in self._turns.pop(checkpoint.turn, ()):
                self._checkpoints[key].turn = None
                self._checkpoints[key].passed = True
        self.touch(checkpoint)

    def forget(self, checkpoint: Checkpoint) -> None:
        """A checkpoint leaves the registry: it no longer counts for its session or its owner."""
        if checkpoint.turn is not None:
            keys = self._turns[checkpoint.turn]
            keys.discard(checkpoint.key)
            if not keys:
                del self._turns[checkpoint.turn]
            checkpoint.turn = None
        if checkpoint.owner is not None:
            self._owners[checkpoint.owner] -= 1
            if not self._owners[checkpoint.owner]:
                del self._owners[checkpoint.owner]

    def session_heads(self) -> set[bytes]:
        """The keys of each live session's latest READY checkpoint (see the module docstring)."""
        heads = set()
        for keys in self._turns.values():
            ready = [self._checkpoints[key] for key in keys if self._checkpoints[key].ready]
            if ready:
                heads.add(max(ready, key=_next_turn_reads).key)
        return heads

    def fair_share(self, owner: str) -> int:
        """The checkpoint slots `owner` may hold before its registrations evict only its own: the
        pool's slots over the owners holding checkpoints, `owner` included (at least one)."""
        owners = len(self._owners) + (owner not in self._owners)  # every counted owner holds one or more
        return max(1, (self._slots.num_free + self._slots.num_used) // owners)

    def at_share(self, owner: str) -> bool:
        """Whether `owner` holds its fair share or more (its next registration evicts only its own)."""
        return self._owners[owner] >= self.fair_share(owner)

    def victim(self, idle: Iterable[Checkpoint]) -> tuple[Checkpoint, bool]:
        """The one of `idle` (idle READY checkpoints, at least one) to evict by the order in the module
        docstring, and whether it is a live session's latest. Raises the inflation to its value: call
        only for a checkpoint that is evicted."""
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

        chosen = min(idle, key=order)
        self._inflation = max(self._inflation, chosen.value)
        return chosen, chosen.key in heads

    def check_integrity(self) -> None:
        """The tenant counts and the live sessions' index agree with the registry's checkpoints;
        AssertionError otherwise."""
        checkpoints = self._checkpoints.values()
        if Counter(c.owner for c in checkpoints if c.owner is not None) != self._owners:
            raise AssertionError("the per-tenant checkpoint counts are stale")
        turns: dict[str, set[bytes]] = {}
        for checkpoint in checkpoints:
            if checkpoint.turn is not None:
                turns.setdefault(checkpoint.turn, set()).add(checkpoint.key)
        if turns != self._turns:
            raise AssertionError("the live sessions' turn index disagrees with the checkpoints' turns")


def _next_turn_reads(checkpoint: Checkpoint) -> tuple[bool, int]:
    """Which of a turn's end checkpoints its session's next turn reads (the largest is the session's
    latest): a chat turn's rendered history before a prompt end or turn end, then the longest."""
    return checkpoint.kind is CheckpointKind.CHAT_TURN, checkpoint.num_tokens
