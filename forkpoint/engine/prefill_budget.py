"""How many prefill tokens a step takes while sequences decode in it (issue 27, head-of-line blocking).

A decoding stream emits one token per step, so its token gap is the time of the steps it is in. A
long prompt's chunk in the same step stretches that step: on the CPU a 512-token chunk at position
8k-16k of a 16k prompt made the step 10x a decode step (config.py, the table before EngineConfig).
So a step that decodes takes at most B prefill tokens in all (B =
`EngineConfig.prefill_tokens_with_decodes()`: Sarathi-Serve's stall-free token budget), and a step
with no decode takes the full max_num_batched_tokens (nothing waits on it; throughput first).

"Decodes" includes the last DECODE_GRACE_S seconds: streams that end together (a client's requests
of one length, started together) leave the long prompt alone in the running list for the round trip
until their client's next requests arrive, and a full-budget step begun in that window held them
17 s on the CPU (bench/hostile.py, 16k prompt). The grace covers that round trip: the bystander's
largest gap while idle, restarts included, was 0.19 s on an idle machine and 0.57 s under a load
average of 5 to 9 (docs/server.md).

Within B, running sequences' prefill chunks are planned first, in the step's order
(`Scheduler.schedule`), then admissions. A long prompt running first could take all of B every step
and hold out, until it ends, the short prompts behind it: a stream's next request, waiting or
admitted with part of its prompt. So the *first* running prefill leaves the other prefills (running
after it, then the waiting sequences that have room) what they would take, at most B minus its
floor: max(ceil(B / 2), one scan chunk with checkpoint_exact, else 1 token), capped at B, so it
progresses every step. The others then take what is left in order. Holding changes which tokens a
step computes, never the results: chunked prefill is exact.

    step that decodes:   [decodes (not counted in B)] [first running prefill <= B - held] [other prefills <= rest of B]
                         [short prefills, each whole: the first <= SHORT_PREFILL_BUDGETS x B, all together
                          <= SHORT_STACK_BUDGETS x B, each counted with SHORT_SEQUENCE_TOKENS (`short_room`);
                          a client's second and later <= SHORT_REPEAT_BUDGETS x B]
    step with no decode: [running prefills and admissions <= max_num_batched_tokens]

A long prefill's token costs more the further into its context it is: its attention reads every
position before it (on the CPU a 64-token chunk's step went from 1.16x a decode step at 0-2k positions to
1.39x at 14-16k, bench/mixed_step_cost.py). So in a step that decodes, a long prefill's chunk of t tokens
from context position c takes t x (1 + c / C) of B (`context_cost`), and takes at most what is left
divided by that factor (`context_tokens`): B / (1 + c / C) tokens alone, never fewer than one scan chunk
with checkpoint_exact, else 1 token, so it progresses every step. C, the attention parity: the context
length at which a token's attention costs what its matrix products do (engine/attention_parity.py,
counted from the model's shape; `EngineConfig.attention_parity_tokens` overrides it). Short prefills,
decodes and a step with no decode are not scaled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from forkpoint.engine.request import Request

DECODE_GRACE_S = 1.0  # seconds after the last step with a decode during which steps stay capped
# a prefill of at most this many budgets (B) in all is short and runs whole beside decodes: a chat turn
# computes its new text (hundreds of tokens; a first turn with a document, about a thousand), and with B = 64
# on the CPU the cap had doubled a chat server's time to first token (docs/server.md); the stall it costs a
# stream is one step, not the tens of seconds of a long prompt's
SHORT_PREFILL_BUDGETS = 16
# short prefills stacked in one step that decodes: at most this many budgets in all, each counted with
# SHORT_SEQUENCE_TOKENS (the first of the step runs whole even past it, up to SHORT_PREFILL_BUDGETS x B). 8
# looked slower for chat turns: bench/agent_sessions.py's small CPU config (4 sessions), alternating with
# f7cbad6 (16, sequences not counted), reused turn 1's TTFT p50 287-619 ms against 265-282 ms, the reuse phase
# 6.1-8.3 s against 4.2-4.8 s, 3 runs each at load 1.3-2.5 (docs/server.md, issue 27's bursts)
SHORT_STACK_BUDGETS = 16
# a client's second and later short prefills in one step that decodes: at most this many budgets in all, per
# client (engine/fair_order.py's client_of: a `user`, else one prompt). One client's burst then
# takes one whole prompt and this much a step, not the whole stack: 16 marker prompts of one client (816
# tokens) made a step 0.69-0.74 s beside the bystander's 0.13-0.26 s decode steps under load 3.5
# (bench/hostile.py, bench/step_trace.py; docs/server.md, issue 27's bursts). Different clients' first short
# prefills (chat turns of different sessions) still share the whole stack. Shared by all clients, the room went
# to the burst's queue, which ranked first, and a bystander's 8 restarted streams took 3 steps to come back.
# 8 measured against 4 (bench/hostile.py with `user`, load 2.5-3.5): beside 80 marker prompts the bystander's
# worst gap was 2.6x and 1.7x its baseline at 8 (steps of 9-10 prompts, 0.35-0.39 s, a restart spans 2-3
# steps), 1.5x in 3 runs at 4; the flood's own TTFT p50 2.25 and 1.94 s at 8, 1.74-3.50 s at 4
SHORT_REPEAT_BUDGETS = 4
# what one short prefill sequence costs a step beyond its tokens, in prefill tokens: its sampling, its state
# row and its segment's setup. bench/burst_step_cost.py on the CPU with the embedded model (f7cbad6, 2 cores,
# load 1.6): a step = 83 ms + 0.99 ms a sequence + 0.087 ms a token, so one sequence costs what 11 tokens do
SHORT_SEQUENCE_TOKENS = 11


# what one prompt-logit row (a scored prompt position: a [vocabulary] row of logits, its log-softmax and
# top-k) costs in prefill tokens of a step that decodes, measured on the CPU with the embedded model: a
# step of 8 decodes and 64 scored rows took 0.33 s against 0.06 s for the decodes alone (4.3 ms a row),
# a 64-token chunk of a plain prompt at 0-4k 0.02-0.04 s more (0.3-0.6 ms a token); bench/hostile.py's
# prompt_logprobs_4k: 5.6x the bystander's gap (docs/server.md). 16, not 8 (session 19): at 8, B = 64 gave the
# echo_logprobs_8k case 8 rows a step, ~34 ms at 4.3 ms a row (the rows do not grow with the position), over
# half the streams' decode step, and the bystander's largest gap was 1.8-2.0x its baseline in 3 runs; at 16
# the scoring takes twice the steps
SCORE_ROW_TOKENS = 16


def score_rows_with_decodes(budget: int, scan_chunk: int | None) -> int:
    """Prompt-logit rows a step that decodes computes, all scored prompts together: B /
    SCORE_ROW_TOKENS, at least one scan chunk (`scan_chunk`, with checkpoint_exact: a scored chunk
    ends at a scan-chunk boundary), at least one row."""
    return max(budget // SCORE_ROW_TOKENS, scan_chunk or 1)


def short_room(budget: int) -> int:
    """Short prefills' cost (`short_cost`), all of them together, in a step that decodes with prefill
    budget `budget` (B): SHORT_STACK_BUDGETS x B. The first short prefill of the step runs whole even
    past it (`short_whole`); the others stack only up to it (a burst of chat turns, 80 marker prompts,
    64 one-token requests: the burst as a whole), and the next wait for the next step."""
    return SHORT_STACK_BUDGETS * budget


def short_repeat_room(budget: int) -> int:
    """Short prefills' cost, after a client's first of the step, in a step that decodes with prefill
    budget `budget` (B): SHORT_REPEAT_BUDGETS x B per client (they also count against `short_room`)."""
    return SHORT_REPEAT_BUDGETS * budget


def short_whole(budget: int) -> int:
    """The most a short prefill costs (`short_cost` of SHORT_PREFILL_BUDGETS x B tokens): the first of
    a step that decodes may take this much, so every short prefill runs whole in some step."""
    return short_cost(SHORT_PREFILL_BUDGETS * budget)


def short_cost(tokens: int) -> int:
    """What a short prefill of `tokens` tokens takes of the short room: its tokens and
    SHORT_SEQUENCE_TOKENS for the sequence (a burst's cost is its sequences' as much as its tokens')."""
    return tokens + SHORT_SEQUENCE_TOKENS


def is_capped_prefill(request: Request, start: int, budget: int, origin: int) -> bool:
    """Whether computing `request` from `start` is prefill work that counts against the budget B of a
    step that decodes: a long prefill, more than SHORT_PREFILL_BUDGETS x B tokens from `origin`, the
    token its admission started computing from (after what its checkpoint supplied; a running
    request's `num_cached_tokens`). A short one runs whole, beside the decodes."""
    return is_prefill(request, start) and request.num_tokens - origin > SHORT_PREFILL_BUDGETS * budget


def is_prefill(request: Request, start: int) -> bool:
    """Whether computing `request` from token `start` is prefill work: a prompt token, or a recomputed
    output after preemption (more than the one next token left). A decode (or a speculative verify,
    whose drafts are not in num_tokens) computes exactly the last token past the prompt."""
    return start < len(request.prompt_token_ids) or request.num_tokens - start > 1


def context_tokens(room: int, position: int, parity: int | None, scan_chunk: int | None) -> int:
    """Tokens a long prefill from context position `position` (>= 0) may take of `room` prefill tokens left
    in a step that decodes: room / (1 + position / parity), rounded down, at least one scan chunk
    (`scan_chunk`, with checkpoint_exact: its chunks end at scan-chunk boundaries) or else 1 token, never
    more than `room`. `parity`: C (engine/attention_parity.py); None: `room` (no cost by position)."""
    if parity is None:
        return room
    return min(room, max(scan_chunk or 1, room * parity // (parity + position)))


def context_cost(tokens: int, position: int, parity: int | None) -> int:
    """What `tokens` tokens of a long prefill from context position `position` take of a step's prefill
    room: tokens x (1 + position / parity), rounded up (`parity` None: `tokens`)."""
    if parity is None:
        return tokens
    return -(-tokens * (parity + position) // parity)


@dataclass(frozen=True)
class PrefillRoom:
    """A step's prefill tokens while sequences decode in it: `total` in all, of which the first
    running prefill leaves `held` to the others. 0 <= held <= total - 1."""

    total: int
    held: int

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.held < self.total:
            raise ValueError(f"a prefill room needs total >= 1 and 0 <= held < total, got total {self.total}, "
                             f"held {self.held}")


def running_floor(budget: int, scan_chunk: int | None) -> int:
    """Prefill tokens the running sequences keep however much waits: half of `budget` (rounded up),
    at least one scan chunk (`scan_chunk`, with checkpoint_exact: a shorter chunk rounds down to
    nothing), never more than `budget`."""
    return min(budget, max(-(-budget // 2), scan_chunk or 1))


def prefill_room(running: Sequence[Request], waiting: Iterable[Request], budget: int, chunk_cap: int,
                 seq_room: int, scan_chunk: int | None = None, *, recently_decoded: bool = False) -> PrefillRoom | None:
    """The step's prefill room, or None when no running sequence decodes and none did within
    DECODE_GRACE_S (`recently_decoded`): no cap below the step's.

    running: in the order the step plans them; budget: B, the prefill tokens of a step that decodes
    (>= 1); chunk_cap: the most tokens of one sequence per step; seq_room: how many waiting
    sequences the step can still admit (in `waiting`'s order); scan_chunk: SCAN_CHUNK_TOKENS with
    checkpoint_exact, else None. Held: what the running prefills after the first and those waiting
    sequences would take this step (their tokens left, capped at chunk_cap; a waiting one's
    checkpoint may make it less), at most B minus `running_floor`."""
    if budget < 1:
        raise ValueError(f"the prefill budget of a step that decodes must be >= 1, got {budget}")
    if not recently_decoded and not any(not is_prefill(r, r.num_computed_tokens) for r in running):
        return None
    free = budget - running_floor(budget, scan_chunk)
    prefills = [r for r in running if is_capped_prefill(r, r.num_computed_tokens, budget, r.num_cached_tokens)]
    others = [r.num_tokens - r.num_computed_tokens for r in prefills[1:]]
    long_waiting = SHORT_PREFILL_BUDGETS * budget  # a waiting prompt this short will not count against B
    others += [r.num_tokens for _, r in zip(range(seq_room), waiting) if r.num_tokens > long_waiting]
    need = 0
    for tokens in others:
        if need >= free:
            break
        need += min(tokens, chunk_cap)
    return PrefillRoom(budget, min(need, free))
