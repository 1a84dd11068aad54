"""The order in which a step takes its sequences: per-client round robin when they do not all fit.

A client is a sequence's `tenant` (the server's `user` field), or, for a sequence without one, its
prompt (`parent_id`: the n sequences of one prompt are one client). Two orders, one rule: within the
step's limits, the sequences of clients with fewer sequences in the step go first.

- Running sequences (`step_order`): while the step's token budget holds every running sequence's
  next chunk, the running order (admission order) and nothing changes. When it does not, rounds:
  round k holds each client's k-th running sequence, in running order. One client's n=128 sequences
  then cannot take every token of a step from another client's single stream, which decodes every
  step while the budget holds one sequence per client.
- Waiting sequences (`admission_order`): while the step has room (tokens and sequence slots; in a
  step that decodes, its prefill and short rooms: engine/prefill_budget.py) for every waiting prompt,
  the queue order (first come, first served). When it does not, a client's
  k-th waiting sequence ranks after its running ones (rank = its running sequences + k) and lower
  ranks are admitted first, ties in queue order: a client whose many sequences run or wait does not
  hold another client's first request behind them.

Deterministic (no clock, no randomness); outputs do not depend on the order, only which sequences a
step holds. Neither vLLM nor SGLang orders by client; both take sequences first come, first served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from forkpoint.engine.request import Request


def client_of(request: Request) -> str:
    """The client a sequence counts for: its tenant, else its prompt."""
    return f"tenant:{request.tenant}" if request.tenant else f"prompt:{request.parent_id}"


def _fit(requests: Iterable[Request], budget: int, chunk_cap: int, seq_tokens: int = 0) -> bool:
    """Whether `budget` tokens hold an upper bound on what `requests` take this step: what each has
    left, capped at `chunk_cap`, plus its drafts, plus `seq_tokens` a sequence. Stops at the first
    request past the budget."""
    for request in requests:
        budget -= (min(request.num_tokens - request.num_computed_tokens, chunk_cap) + len(request.draft_token_ids)
                   + seq_tokens)
        if budget < 0:
            return False
    return True


def _round_robin(requests: Sequence[Request], ahead: Counter[str]) -> list[Request]:
    """`requests` sorted by rank (the client's sequences `ahead` plus how many of its own come
    before it here), ties in their given order."""
    seen: Counter[str] = Counter()
    ranked = []
    for position, request in enumerate(requests):
        client = client_of(request)
        ranked.append((ahead[client] + seen[client], position, request))
        seen[client] += 1
    return [request for _, _, request in sorted(ranked, key=lambda entry: entry[:2])]


def step_order(running: Sequence[Request], budget: int, chunk_cap: int, seq_room: int | None = None) -> list[Request]:
    """`running` in the order a step with `budget` tokens (at most `chunk_cap` per sequence) and at
    most `seq_room` sequences (None: no cap below max_num_seqs) plans them: unchanged when every
    next chunk fits, else round robin by client. A permutation of `running`."""
    if (seq_room is None or len(running) <= seq_room) and _fit(running, budget, chunk_cap):
        return list(running)
    return _round_robin(running, Counter())


def admission_order(waiting: Sequence[Request], running: Sequence[Request], budget: int, seq_room: int,
                    chunk_cap: int, seq_tokens: int = 0) -> list[Request]:
    """`waiting` in the order a step with `budget` tokens left and room for `seq_room` more
    sequences tries to admit them: the queue order when all fit (each sequence counted with
    `seq_tokens` more: a step that decodes counts short prefills so, engine/prefill_budget.py), else
    by rank (module docstring). A permutation of `waiting`."""
    if len(waiting) <= seq_room and _fit(waiting, budget, chunk_cap, seq_tokens):
        return list(waiting)
    return _round_robin(waiting, Counter(client_of(r) for r in running))
