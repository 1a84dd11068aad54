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
"""

from __future__ import annotations

from collections import deque


class HeldSlots:
    """Times at which held slots were freed, oldest first (time.monotonic() seconds); `grace_s`
    > 0: how long a hold lasts."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"a slot hold needs a grace > 0 s, got {grace_s}")
        self.grace_s = grace_s
        self._freed: deque[float] = deque()

    def hold(self, now: float) -> None:
        """A sequence whose client has nothing left in the engine freed its slot at `now`."""
        self._freed.append(now)

    def count(self, now: float) -> int:
        """Slots held at `now` (expired holds are dropped)."""
        while self._freed and now - self._freed[0] >= self.grace_s:
            self._freed.popleft()
        return len(self._freed)

    def take(self, now: float) -> None:
        """An absent client took a slot: the oldest hold ends."""
        if self.count(now):
            self._freed.popleft()
