"""One step as the scheduler plans it and the engine settles it: `ScheduledStep` (the runner's plan
plus what commit / fail must settle), `StepLimits` (caps a memory retry sets: engine/memory_retry.py)
and `StepPlanning` (the scratch state of one `Scheduler.schedule()` call, which turns token ranges
into segments)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forkpoint.cache.checkpoint_types import Checkpoint
from forkpoint.engine.prefill_budget import short_cost
from forkpoint.engine.request import Request
from forkpoint.step.plan import KVCopy, Segment, SegmentKind, StepPlan, Verify


@dataclass
class ScheduledStep:
    """One step as the engine sees it: the runner's `plan` plus what commit/fail must settle.

    requests[i] owns plan.segments[i]; written: (checkpoint, producer) pairs this step writes;
    consumed: checkpoints pinned by this step's readers (one entry per pin); finished: requests
    that ended while scheduling (they can never fit); index: the scheduler's count of non-empty steps
    before this one (`Scheduler.num_steps` when it was planned: a request's first_scheduled_step)."""

    plan: StepPlan
    requests: list[Request]
    written: list[tuple[Checkpoint, Request]]
    consumed: list[Checkpoint]
    finished: list[Request]
    index: int

    @property
    def empty(self) -> bool:
        return self.plan.empty


@dataclass(frozen=True)
class StepLimits:
    """Caps on one step below the configured ones (engine/memory_retry.py sets them after a step ran
    out of memory): at most `max_tokens` tokens and `max_seqs` sequences, and at most `max_chunk` of
    the tokens for one sequence of `chunked` (request ids; None: every sequence), so a long prefill
    leaves room for the others' decodes. All >= 1, max_chunk <= max_tokens."""

    max_tokens: int
    max_seqs: int
    max_chunk: int
    chunked: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if min(self.max_tokens, self.max_seqs, self.max_chunk) < 1 or self.max_chunk > self.max_tokens:
            raise ValueError(f"step limits must be >= 1 with max_chunk <= max_tokens, got {self.max_tokens} tokens, "
                             f"{self.max_seqs} sequences, {self.max_chunk} per sequence")


@dataclass
class StepPlanning:
    """Scratch state of one `Scheduler.schedule()` call: the segments planned so far and what they
    take (pins, checkpoints written, prompt-logit rows), under the step's `StepLimits` if any."""

    segments: list[Segment] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)
    written: list[tuple[Checkpoint, Request]] = field(default_factory=list)
    consumed: list[Checkpoint] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    written_phase: dict[int, int] = field(default_factory=dict)  # id(checkpoint) -> phase writing it
    verifies: list[Verify] = field(default_factory=list)
    score_rows: int = 0  # prompt-logit rows planned so far (at most Scheduler.score_rows)
    seq_room: int | None = None  # sequences the step may still take under its StepLimits (None: no cap)
    chunk_cap: int | None = None  # tokens of one sequence under its StepLimits (None: Scheduler.chunk_cap)
    chunked: frozenset[str] | None = None  # the sequences chunk_cap applies to (None: all)
    # prefill tokens the step may still take while sequences decode in it, and how many of them the
    # first running prefill leaves for the other prefills (engine/prefill_budget.py; None: no cap)
    prefill_left: int | None = None
    prefill_held: int = 0
    # short prefills' cost (they run whole, engine/prefill_budget.py: `short_cost`) the step may still
    # take while sequences decode in it (None: no cap), what the first of them may take (`short_whole`),
    # how many it has planned, and whether one waiting had to wait for the next step
    short_left: int | None = None
    short_whole: int = 0
    short_seqs: int = 0
    short_full: bool = False
    # the short-room cost of each client's (engine/fair_order.py's client_of) short prefills planned in this
    # step after its first (a client with a short prefill here has an entry), and how much that may be
    # (`short_repeat_room`)
    repeats: dict[str, int] = field(default_factory=dict)
    repeat_room: int = 0
    score_cap: int | None = None  # prompt-logit rows of a step that decodes (None: Scheduler.score_rows)

    def add_segment(self, request: Request, start: int, end: int, initial: int, dests: tuple[int, ...],
                    kind: SegmentKind, phase: int) -> None:
        """Plan tokens [start, end) of `request` as one segment read from state row `initial`, written
        to rows `dests`, in `phase` of the forward."""
        num_tokens = request.num_tokens
        scored = request.params.prompt_logprobs is not None
        rows = max(0, min(end, len(request.prompt_token_ids) - 1) - start) if scored else 0  # prompt-logit rows
        self.segments.append(Segment(
            request_id=request.request_id, start=start, end=end, token_ids=request.tokens(start, end),
            block_table=request.blocks, initial_slot=initial, dest_slots=dests, kind=kind, phase=phase,
            samples=end == num_tokens, multimodal=request.multimodal, prompt_logit_rows=rows,
            next_token=request.tokens(end, end + 1)[0] if end < num_tokens else None))
        self.score_rows += rows
        self.requests.append(request)

    def prefill_cap(self) -> int | None:
        """Prefill tokens the next chunk may take (None: no cap below the step's token budget)."""
        return None if self.prefill_left is None else self.prefill_left - self.prefill_held

    def take_prefill(self, cost: int) -> None:
        """A long prefill's chunk is planned: it takes `cost` of the prefill room (its tokens scaled by
        their context position, engine/prefill_budget.py `context_cost`). The room never goes below 0:
        a chunk of the floor may cost more than was left."""
        if self.prefill_left is not None:
            self.prefill_left = max(0, self.prefill_left - cost)

    def short_cap(self, client: str | None = None) -> int | None:
        """Short-room cost the next short prefill (of `client`; None: any) may take (None: no cap): the
        first of the step runs whole (`short_whole`), the others share what is left of the stack, and
        a client's second and later ones at most what is left of its repeat room."""
        if self.short_left is None:
            return None
        cap = self.short_left if self.short_seqs else max(self.short_left, self.short_whole)
        return min(cap, self.repeat_room - self.repeats[client]) if client in self.repeats else cap

    def take_short(self, count: int, client: str) -> None:
        """A short prefill of `count` tokens of `client` is planned (the rooms never go below 0: the
        first may take more than the stack)."""
        if self.short_left is not None:
            cost = short_cost(count)
            self.short_left = max(0, self.short_left - cost)
            self.repeats[client] = self.repeats[client] + cost if client in self.repeats else 0
            self.short_seqs += 1

    def release_held_prefill(self) -> None:
        """The first running prefill is planned: the other prefills may take what it left them."""
        self.prefill_held = 0

    def take_seq(self) -> None:
        if self.seq_room is not None:
            self.seq_room -= 1

    @property
    def seqs_full(self) -> bool:
        return self.seq_room == 0
