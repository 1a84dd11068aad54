"""Sequence slots a departed client freed, held a moment for a client that runs nothing (issue 27).

With every sequence slot (max_num_seqs) busy, a waiting sequence is admitted when one frees. A
streaming client's requests end and come back a round trip later; in that round trip the slots its
sequences freed went to whatever waited, and with one client's n=128 sequences waiting that was
always them: the stream's next request then waited for one of those to end (`n=128` behind
`--max-num-seqs 16`: a 1.86 s gap on the CPU, 10.9x the stream's own, bench/hostile.py). The
per-client order (engine/fair_order.py) ranks the new request first, but only once it has arrived.

So a slot freed by a sequence whose client then has no sequence left in the engine (its stream
ended: the client left) is held for DECODE_GRACE_S (engine/prefill_budget.py: the same round trip).
A client is *present* from its first admission until it has no sequence left (the scheduler keeps
the set). While slots are held, a present client takes only the slots beyond them; an absent one
(a new or returning client: with no `user`, every request is its own client) takes a held slot,
which ends that hold. A present client whose running sequences all ended in one step, with more
queued, is still present: it is not a client coming back. After the grace a hold lapses, so no
slot idles for long. Holds change which sequences run when, never their outputs.

    step k:   8 streams end (their clients leave) -> 8 holds; n=128's queue may not take those 8 slots
    step k+1: the streams' next requests (absent clients) arrive -> each takes a held slot
    1 s later: holds not taken lapse; n=128 fills the slots

A client that streams several requests at once under one `user` does not leave when some of them end: its
other streams still run. A slot freed by a sequence whose client is still present is held *for that client*
(an owned hold): only that client takes it (its next request, a round trip later, or its own queue), no one
else until it lapses; when its owner leaves, it becomes an ordinary hold. A hold reserves a free slot, so
there are never more holds than free slots (the oldest end first). So one `user`'s streams keep their slots
beside another client's n=128 queue (`--max-num-seqs 16`, bench/hostile.py on the CPU: the bystander's largest
gap 2.93 s before, 1.2-1.3 s after; docs/server.md).
"""

from __future__ import annotations

from collections import deque


class HeldSlots:
    """Held slots, oldest first: (time.monotonic() seconds it was freed, owner). The owner is the present
    client whose own sequence freed the slot, or None for a client that left (any client that runs
    nothing may take it). `grace_s` > 0: how long a hold lasts."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"a slot hold needs a grace > 0 s, got {grace_s}")
        self.grace_s = grace_s
        self._held: deque[tuple[float, str | None]] = deque()

    def hold(self, now: float, owner: str | None = None) -> None:
        """A sequence freed its slot at `now`: its client left (owner None), or is still present (`owner`)."""
        self._held.append((now, owner))

    def release(self, owner: str) -> None:
        """`owner` left (it has no sequence left): the holds it owned are now for any client that runs nothing."""
        self._held = deque((freed, None if held_for == owner else held_for) for freed, held_for in self._held)

    def count(self, now: float) -> int:
        """Slots held at `now`, owned or not (expired holds are dropped)."""
        while self._held and now - self._held[0][0] >= self.grace_s:
            self._held.popleft()
        return len(self._held)

    def trim(self, free: int, now: float) -> None:
        """A hold reserves a free slot: with only `free` slots free, the oldest holds beyond them end (their
        slots were taken another way, e.g. a finished sequence's slot freed only after its last step)."""
        self.count(now)
        while len(self._held) > max(free, 0):
            self._held.popleft()

    def left(self, now: float) -> int:
        """Slots held at `now` for clients that left (no owner): clients whose next request is a round trip away."""
        self.count(now)
        return sum(1 for _, owner in self._held if owner is None)

    def barred(self, client: str, present: bool, now: float) -> int:
        """How many of the slots held at `now` `client` may not take: those other clients own, and, when
        it is present (it runs sequences), those of clients that left."""
        self.count(now)
        return sum(1 for _, owner in self._held if owner != client and (owner is not None or present))

    def take(self, client: str, present: bool, now: float) -> None:
        """`client` was given a slot: the oldest hold it owns ends, else, when it is absent, the oldest
        hold of a client that left; else no hold ends (the slot was a free one)."""
        self.count(now)
        for wanted in (client, None) if not present else (client,):
            for index, (_, owner) in enumerate(self._held):
                if owner == wanted:
                    del self._held[index]
                    return
