"""One client's share of a step's decode rows while other clients have work (issue 27, `n=128`).

On the CPU a decode step's time grows with its rows (embedded model, 2 cores, median step: 8 rows
0.066 s, 16 0.088 s, 24 0.096 s, 64 0.180 s, 136 0.351 s). One request with n=128 beside a stream
client's 8 sequences made every step of that client 136 rows, and each of its restarts waited behind
such steps (bench/hostile.py `n_128`: largest gap 4.2x its own at the default max_num_seqs).

So while another client has sequences in the engine (running or waiting), or a slot is held for a
client that just left (engine/held_slots.py: its next request is a round trip away), each client
decodes at most

    share = max(floor, the largest other client's running sequences)

of its sequences in a step (`floor`: `EngineConfig.max_decode_share`). The others skip the step: they
keep their slot, state row and KV blocks, nothing is recomputed or preempted, and no token is
sampled for them. A client alone in the engine is never capped; beside a small client a large one
still decodes `floor` rows a step; two clients of equal size never cap each other (each one's share
is the other's count). The client is engine/fair_order.py's `client_of` (the request's tenant: the
server's API key client or `user`; else the prompt, its n sequences together).

While a client has its share of a step's sequences (decodes, prefill chunks and admissions together),
none of its waiting sequences is admitted into that step (`StepShares.admits`): one request's n=128
arriving beside a stream client otherwise added 22 one-token prompts a step to the capped decodes.

Turns: a capped client's sequences that decode are taken oldest-first by the step in which each last
ran (`DecodeTurns`), ties in running order, so a sequence that skipped goes before one that just
ran and none starves: with d sequences decoding and a share of s, each waits at most ceil(d/s) - 1
steps in a row. Running prefill chunks never skip (the prefill budget governs them), nor does a
sequence that is producing a checkpoint (other requests may wait on it). Which sequences run in a
step never changes what any of them samples: each has its own generator, penalty counts and masks.

    step k:    client A (n=64): [a0 .. a15] decode, a16 .. a63 skip;   client B: [b0 .. b3] decode
    step k+1:  client A:        [a16 .. a31] decode (they ran longest ago); B: [b0 .. b3]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from forkpoint.engine.fair_order import client_of
from forkpoint.engine.prefill_budget import is_prefill
from forkpoint.engine.request import Request


def decode_share(floor: int, own: str, running_by_client: Counter[str]) -> int:
    """Most sequences client `own` decodes in a step while others have work: `floor`, or more when
    another client runs more sequences (`running_by_client`: running sequences per client)."""
    return _share(floor, own, running_by_client.most_common(2))


def _share(floor: int, own: str, largest: list[tuple[str, int]]) -> int:
    """`decode_share` from the two largest entries of the counts (`Counter.most_common(2)`): the largest
    other client's count is the first of them that is not `own`'s. A step asks for every client's
    share: one pass over the counts, not one per client (256 single-sequence clients: 65k)."""
    if floor < 1:
        raise ValueError(f"a decode share needs a floor >= 1 sequence, got {floor}")
    return max([floor] + [count for client, count in largest if client != own][:1])


def takes_turns(request: Request) -> bool:
    """Whether `request` may skip a step under the share: it decodes next (a single token past the
    prompt) and produces no checkpoint (requests may be waiting on it)."""
    return not is_prefill(request, request.num_computed_tokens) and not request.checkpointing.producing


@dataclass(frozen=True)
class StepShares:
    """One step under the share: `taking`, the running sequences that take part in it (running order);
    `running`, running sequences per client when it was planned; `floor`, the share's floor while other
    clients have work (None: one client alone, no cap)."""

    taking: list[Request]
    running: Counter[str]
    floor: int | None
    largest: list[tuple[str, int]] = field(init=False, repr=False, compare=False)  # running.most_common(2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "largest", self.running.most_common(2))

    def admits(self, client: str, in_step: int) -> bool:
        """Whether `client`, with `in_step` sequences in the step so far (decodes, prefills, admissions),
        may have one more admitted into it: below its share, or no cap. A client's new sequences would
        otherwise add rows beside its capped decodes (n=128's arrival: 22 one-token prompts a step)."""
        return self.floor is None or in_step < _share(self.floor, client, self.largest)


class DecodeTurns:
    """The steps in which running sequences last ran, and the pick of a step's decoders under the
    share. `floor` >= 1 (`EngineConfig.max_decode_share`).

    Invariant: the keys of `last_ran` are request ids of sequences that were running when it was last
    recorded (ended and preempted sequences are dropped at the next `record`)."""

    def __init__(self, floor: int) -> None:
        if floor < 1:
            raise ValueError(f"max_decode_share must be >= 1 sequence, got {floor}")
        self.floor = floor
        self.last_ran: dict[str, int] = {}

    def pick(self, running: Sequence[Request], live_clients: Collection[str], departed: bool) -> StepShares:
        """The next step's shares: the running sequences that take part in it, in running order (all of
        them when no other client than theirs has work: `live_clients`, clients with sequences running
        or waiting; `departed`, a slot is held for a client that just left), else each client's decoding
        sequences beyond its share skip, those that ran longest ago going first."""
        clients = Counter(client_of(r) for r in running)
        if len(set(live_clients) | set(clients)) <= 1 and not departed:
            return StepShares(list(running), clients, None)
        skipped: set[int] = set()
        # per client, its decoding sequences by turn: any not recorded yet first, then by
        # the step each last ran in, ties in running order
        decoding: dict[str, list[tuple[tuple[bool, int, int], Request]]] = {}
        for position, request in enumerate(running):
            if takes_turns(request):
                ran = request.request_id in self.last_ran
                turn = (ran, self.last_ran[request.request_id] if ran else 0, position)
                decoding.setdefault(client_of(request), []).append((turn, request))
        largest = clients.most_common(2)
        for client, candidates in decoding.items():
            share = _share(self.floor, client, largest)
            if len(candidates) > share:
                skipped.update(id(request) for _, request in sorted(candidates, key=lambda c: c[0])[share:])
        return StepShares([r for r in running if id(r) not in skipped], clients, self.floor)

    def record(self, ran: Sequence[Request], running: Sequence[Request], step: int) -> None:
        """Sequences `ran` took part in step `step`; `running`: the running list after it was planned."""
        running_ids = {r.request_id for r in running}
        self.last_ran = {key: value for key, value in self.last_ran.items() if key in running_ids}
        self.last_ran.update((r.request_id, step) for r in ran if r.request_id in running_ids)
