"""The order in which a step plans its running sequences: per-client round robin when they do not all fit.

A client is a sequence's `tenant` (the server's `user` field), or, for a sequence without one, its
prompt (`parent_id`: the n sequences of one prompt are one client). While the step's token budget
holds every running sequence's next chunk, the order is the running order (admission order) and
nothing changes. When it does not, the sequences go in rounds: round k holds each client's k-th
running sequence (a client's own sequences keep their running order), the clients in the order of
their first running sequence. So within the step's limits the sequences of clients with fewer
sequences scheduled this step go first: one client's n=128 sequences cannot take every token of a
step from another client's single stream, which decodes every step while the budget holds one
sequence per client. Deterministic (no clock, no randomness), so outputs do not depend on it beyond
which sequences a step holds.

Neither vLLM nor SGLang orders running sequences by client; both plan them first come, first served.
"""

from __future__ import annotations

from collections.abc import Sequence

from forkpoint.engine.request import Request


def client_of(request: Request) -> str:
    """The client a sequence's share is counted for: its tenant, else its prompt."""
    return f"tenant:{request.tenant}" if request.tenant else f"prompt:{request.parent_id}"


def step_order(running: Sequence[Request], budget: int, chunk_cap: int) -> list[Request]:
    """`running` in the order a step with `budget` tokens (at most `chunk_cap` per sequence) plans
    them: unchanged when every sequence's next chunk fits (its upper bound: the tokens it has left,
    capped, plus its drafts), else round robin by client (module docstring). A permutation of `running`."""
    demand = sum(min(r.num_tokens - r.num_computed_tokens, chunk_cap) + len(r.draft_token_ids) for r in running)
    if demand <= budget:
        return list(running)
    by_client: dict[str, list[Request]] = {}
    for request in running:
        by_client.setdefault(client_of(request), []).append(request)
    queues = list(by_client.values())
    return [queue[rank] for rank in range(max(map(len, queues))) for queue in queues if rank < len(queue)]
