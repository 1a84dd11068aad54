"""One sequence being generated, and its place in the checkpoint protocol.

A prompt with `n > 1` becomes n sequences that share the prompt (see engine.py). Token layout of a
sequence: `token_ids = prompt_token_ids + output_token_ids`; `num_computed_tokens` of them have
state in the request's slot and KV blocks. A step computes `token_ids[num_computed : num_computed + k]`;
when that reaches the end of `token_ids`, the step's logits sample the next token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from forkpoint.cache.checkpoint_types import CacheMissReason, Checkpoint, CheckpointKind
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.inputs.multimodal import MultimodalPrompt
from forkpoint.runner.logits_processors import RequestProcessors
from forkpoint.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CheckpointProgress:
    """A request's part in the checkpoint protocol. Written by the scheduler only.

    producing: PENDING checkpoints this request writes, by position; auto_positions: positions the
    engine placed automatic checkpoints at for this request (engine/auto_checkpoints.py); waiting_on: the unready
    checkpoint it is deferred on; reserved: the checkpoint it will read, held while it is queued for
    admission (so that no registration evicts it first); deferred_since: start of the current wait
    (the wait bound counts from here); was_deferred: counted once in requests_deferred;
    gave_up_waiting: the wait bound was hit, it never waits for an unready checkpoint again.
    """

    producing: list[Checkpoint] = field(default_factory=list)
    auto_positions: dict[int, CheckpointKind] = field(default_factory=dict)
    waiting_on: Checkpoint | None = None
    reserved: Checkpoint | None = None
    read_from: Checkpoint | None = None  # the checkpoint its current computation started from
    deferred_since: float | None = None
    was_deferred: bool = False
    gave_up_waiting: bool = False
    shared: SharedPrefix | None = None  # what the prompt shares with earlier ones (auto_checkpoints.py)
    miss_counted: bool = False  # its cache miss reason was counted (once, at its first admission)


@dataclass(frozen=True)
class SharedPrefix:
    """What a new prompt shares with the sequences seen before it, for saying why reuse stopped.

    reusable: the longest prefix a checkpoint could give it (the shared length, less the token a reader
    computes itself); placed: positions in 1..reusable where checkpoints were placed on that earlier
    sequence; in_turn: the prompt leaves it after its last turn boundary (in its generation prompt or
    output: a template or a client re-rendered that turn)."""

    reusable: int
    placed: tuple[int, ...]
    in_turn: bool


@dataclass(eq=False)
class Request:
    request_id: str
    parent_id: str
    index: int
    prompt_token_ids: list[int]
    checkpoint_positions: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    hasher: PrefixHasher
    seed: int | None  # the sampling generator's seed (None: greedy); the runner holds the generator
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # prompt logprobs (when asked for): position -> entry for the prompt token at that position
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    num_computed_tokens: int = 0
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    checkpointing: CheckpointProgress = field(default_factory=CheckpointProgress)
    finish_reason: str | None = None
    first_token_time: float | None = None
    # when it was first admitted into a step (kept across preemptions), and the scheduler's step count
    # at arrival and at that admission (RequestMetrics.queued_steps: the steps it waited behind)
    first_scheduled_time: float | None = None
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    # the step that sampled its first token (the count at its planning, as first_scheduled_step; None: none
    # yet): RequestMetrics.prefill_steps, the steps from its first admission to its first token
    first_token_step: int | None = None
    # images: placed in prompt_token_ids, with the rotary positions of every token (None: text only)
    multimodal: MultimodalPrompt | None = None
    # logits processors and grammar state (None: none asked for); released when the prompt leaves
    processors: RequestProcessors | None = None
    # a chat's turn boundaries (inputs/turns.py): automatic CHAT_TURN checkpoints, not markers
    turn_positions: tuple[int, ...] = ()
    # False: a chat whose template re-renders the reply, so no turn-end checkpoint is kept (inputs/turns.py)
    turn_end_reusable: bool = True
    # why reuse stopped short of what the prompt shares with earlier ones (None: it did not), set at admission
    cache_miss_reason: CacheMissReason | None = None
    # speculative decoding: the MTP head's drafts of the tokens after the last one, verified next step
    # (engine/speculative.py); set by the engine with each step's tokens, used up by the plan
    draft_token_ids: tuple[int, ...] = ()
    # the client it comes from (the server's `user`; "" for none): its checkpoints count against that
    # tenant's fair share of the checkpoint pool (cache/eviction.py)
    tenant: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating the whole sequence (a per-step hot path)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
