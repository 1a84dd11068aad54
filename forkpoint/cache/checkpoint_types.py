"""The checkpoint value and its vocabulary: its life-cycle state, why it exists (its kind), why a
request's reuse stopped short of what it shares (a cache-miss reason), and the registry's counters.

A `Checkpoint` is written only by `CheckpointRegistry` (cache/checkpoints.py, which documents the
states and their transitions) and by its eviction policy (cache/eviction.py, the fields `value`,
`last_used` and `turn`); everyone else reads it.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class CheckpointState(enum.Enum):
    PENDING = "pending"
    ORPHANED = "orphaned"
    READY = "ready"
    EVICTED = "evicted"  # removed from the registry (a stale reference reads this)


class CheckpointKind(enum.Enum):
    """Why a checkpoint exists: a marker (or checkpoint_positions) or the engine's own placement."""

    MARKER = "marker"
    SHARED_PREFIX = "shared_prefix"  # the common prefix of requests that arrived together
    JUNCTION = "junction"  # where a prompt leaves a prefix computed before
    PROMPT_END = "prompt_end"  # all but the last token of a prompt (the same prompt sent again)
    TURN_END = "turn_end"  # prompt plus all but the last output token of a finished request
    CHAT_TURN = "chat_turn"  # a chat's rendered history before its generation prompt (or a tool result's end)

    @property
    def automatic(self) -> bool:
        return self is not CheckpointKind.MARKER

    @property
    def ends_turn(self) -> bool:
        """Where a conversation's next turn can start (a session's latest checkpoint is one of these)."""
        return self in (CheckpointKind.CHAT_TURN, CheckpointKind.PROMPT_END, CheckpointKind.TURN_END)


class CacheMissReason(enum.Enum):
    """Why a request's reuse stopped short of the tokens it shares with prompts computed before
    (`RequestOutput.cache_miss_reason`; None there when it reused all it could)."""

    DISABLED = "disabled"  # checkpoints are off (enable_checkpoints=False)
    BELOW_MINIMUM = "below_minimum"  # the shared prefix is shorter than auto_checkpoint_min_tokens
    NO_CHECKPOINT = "no_checkpoint"  # no state was kept where the prompt leaves the earlier one
    TEMPLATE_DIVERGENCE = "template_divergence"  # it leaves an earlier turn inside that turn's generation prompt
    # or output: the template re-rendered it, or the client's text re-tokenised differently
    EVICTED_DEVICE = "evicted_device"  # a checkpoint stood there and was evicted (no host tier)
    EVICTED_HOST = "evicted_host"  # ... and is not in the host tier either
    EVICTED_DISK = "evicted_disk"  # ... nor in the disk tier (checkpoint_dir), or its file is gone
    DISK_TRUNCATED = "disk_truncated"  # its file in the disk tier is shorter than its header says
    DISK_CORRUPT = "disk_corrupt"  # its file's checksum, magic or fields do not match (deleted)
    DISK_FOREIGN = "disk_foreign"  # its file was written for another model, dtype, layout or tokenizer
    DISK_READ_ERROR = "disk_read_error"  # the operating system could not read its file
    WAIT_TIMEOUT = "wait_timeout"  # it stopped waiting for an unready checkpoint (checkpoint_wait_s)
    PROMPT_LOGPROBS = "prompt_logprobs"  # the checkpoint there carries no prompt scores for its top-k
    RECOMPUTE_FASTER = "recompute_faster"  # a host or disk tier held it, and moving it back was measured
    # slower than computing the tokens it saves (cache/reuse_rule.py)



@dataclass(eq=False)
class Checkpoint:
    """Read-only for everyone but `CheckpointRegistry` and its eviction policy (see the module docstring)."""

    key: bytes
    num_tokens: int
    slot: int
    kind: CheckpointKind
    state: CheckpointState
    producer: str | None
    # the position its state and KV hold (<= num_tokens, the prefix it is keyed by); less only with
    # checkpoint_exact, where readers compute tokens [state_tokens, ...) themselves
    state_tokens: int = -1
    # prompt logprobs of the prefix, for readers that ask for them (opaque here; see
    # runner/prompt_logprobs.py PromptScores): the top-k its producer computes (None: it computes none)
    # and, once written, the scores themselves
    prompt_scores_k: int | None = None
    prompt_scores: object | None = None
    blocks: list[int] = field(default_factory=list)
    producer_blocks: list[int] = field(default_factory=list)
    pins: int = 0
    waiters: int = 0
    reserved: int = 0  # queued requests that will read it (scheduler: reserve / unreserve)
    hits: int = 0
    last_used: int = 0
    registered_at: float = 0.0
    # eviction (cache/eviction.py): its GreedyDual value, and the id of the request whose turn
    # it ends (CHAT_TURN, PROMPT_END, TURN_END) while that turn's session waits for its next turn
    value: float = 0.0
    turn: str | None = None
    # it ended a turn whose session's next turn came (read this turn's checkpoints): the host tier does
    # not keep it unless it is read again (cache/checkpoints.py `evict_one`)
    passed: bool = False
    owner: str | None = ""  # the tenant it counts against (cache/eviction.py, "Tenants")

    def __post_init__(self) -> None:
        if self.state_tokens < 0:
            self.state_tokens = self.num_tokens
        if not 0 < self.state_tokens <= self.num_tokens:
            raise ValueError(f"a checkpoint's state position {self.state_tokens} must lie in 1..{self.num_tokens}")

    @property
    def ready(self) -> bool:
        return self.state is CheckpointState.READY


@dataclass
class CheckpointCounters:
    """Per kind: created (became ready), hits (segments that read it), tokens_saved, evicted;
    evicted_session_latest: evictions of a live session's latest checkpoint (the last resort);
    unspilled_passed: evictions with a host tier that did not spill, the checkpoint's session having
    moved past it (cache/checkpoints.py `evict_one`)."""

    created: Counter[CheckpointKind] = field(default_factory=Counter)
    hits: Counter[CheckpointKind] = field(default_factory=Counter)
    tokens_saved: Counter[CheckpointKind] = field(default_factory=Counter)
    evicted: Counter[CheckpointKind] = field(default_factory=Counter)
    evicted_session_latest: int = 0
    unspilled_passed: int = 0
