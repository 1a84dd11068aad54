"""Sequence slots a client's ended sequences freed, held a moment for that client (issue 27).

With every sequence slot (max_num_seqs) busy, a waiting sequence is admitted when one frees. A
streaming client's requests end and come back a round trip later; in that round trip the slots its
sequences freed went to whatever waited, and with one client's n=128 sequences waiting that was
always them: the stream's next request then waited for one of those to end (`n=128` behind
`--max-num-seqs 16`: a 1.86 s gap on the CPU, 10.9x the stream's own, bench/hostile.py). The
per-client order (engine/fair_order.py) ranks the new request first, but only once it has arrived.

So a slot freed by a running sequence is held for DECODE_GRACE_S (engine/prefill_budget.py: the same round
trip) for its client; once that client has no sequence left in the engine (its stream ended: the client left),
also for any client that runs nothing. A client is *present* from its first admission until it has no sequence
left (the scheduler keeps the set). While slots are held, a present client takes its own holds and the slots
beyond the others'; an absent one (a new or returning client: with no `user`, every request is its own client)
also takes a hold whose client left, which ends that hold. A present client whose running sequences all ended
in one step, with more queued, is still present: it is not a client coming back. After the grace a hold
lapses, so no slot idles for long. Holds change which sequences run when, never their outputs.

    step k:   8 streams end (their clients leave) -> 8 holds; n=128's queue may not take those 8 slots
    step k+1: the streams' next requests (absent clients) arrive -> each takes a held slot
    1 s later: holds not taken lapse; n=128 fills the slots

A client that streams several requests at once under one `user` does not leave when some of them end: its
other streams still run, and the slots they freed are its own until they lapse (its next requests, or its own
queue, take them; no one else). When all its streams end in one step and come back together, the first one
admitted makes it present again, and the others still take the holds their own streams left. A hold reserves
a free slot, so there are never more holds than free slots (the oldest end first). So one `user`'s streams keep
their slots beside another client's n=128 queue (`--max-num-seqs 16`, bench/hostile.py on the CPU: the
bystander's largest gap 2.93 s, 8.2x, before; 0.26-0.34 s, 1.1-1.4x, after; docs/server.md).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class _Hold(NamedTuple):
    freed: float  # time.monotonic() seconds
    owner: str  # the client whose sequence freed the slot
    owner_left: bool  # the owner has no sequence left: any client that runs nothing may take it


class HeldSlots:
    """Held slots, oldest first. A hold's owner may always take it back; any client that runs nothing
    may take one whose owner left; a client that runs sequences takes only its own. `grace_s` > 0: how
    long a hold lasts."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"a slot hold needs a grace > 0 s, got {grace_s}")
        self.grace_s = grace_s
        self._held: deque[_Hold] = deque()

    def hold(self, now: float, owner: str) -> None:
        """A sequence of client `owner` freed its slot at `now` (`owner` still runs others: `release` when
        it has none left)."""
        self._held.append(_Hold(now, owner, False))

    def release(self, owner: str) -> None:
        """`owner` has no sequence left: its holds may also go to any client that runs nothing."""
        self._held = deque(h._replace(owner_left=True) if h.owner == owner else h for h in self._held)

    def count(self, now: float) -> int:
        """Slots held at `now` (expired holds are dropped)."""
        while self._held and now - self._held[0].freed >= self.grace_s:
            self._held.popleft()
        return len(self._held)

    def trim(self, free: int, now: float) -> None:
        """A hold reserves a free slot: with only `free` slots free, the oldest holds beyond them end (their
        slots were taken another way, e.g. a finished sequence's slot freed only after its last step)."""
        self.count(now)
        while len(self._held) > max(free, 0):
            self._held.popleft()

    def left(self, now: float) -> int:
        """Slots held at `now` for clients that left: clients whose next request is a round trip away."""
        self.count(now)
        return sum(1 for h in self._held if h.owner_left)

    def barred(self, client: str, present: bool, now: float) -> int:
        """How many of the slots held at `now` `client` may not take: other clients' holds, except, when
        it runs nothing (not `present`), those whose owner left."""
        self.count(now)
        return sum(1 for h in self._held if h.owner != client and (present or not h.owner_left))

    def take(self, client: str, present: bool, now: float) -> None:
        """`client` was given a slot: the oldest hold it owns ends, else, when it is absent, the oldest
        hold whose owner left; else no hold ends (the slot was a free one)."""
        self.count(now)
        for index, h in enumerate(self._held):
            if h.owner == client:
                del self._held[index]
                return
        if not present:
            for index, h in enumerate(self._held):
                if h.owner_left:
                    del self._held[index]
                    return
