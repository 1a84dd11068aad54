"""What the runner hands back for one step: the sampled tokens and the prompt scores.

Everything here is host data except the opaque `boundary` rows, which the runner makes and reads
and the layers above only pass back (kept with a checkpoint, `PromptScores`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forkpoint.outputs import Logprob


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None


@dataclass(frozen=True)
class SegmentScores:
    """Prompt logprobs of the segment [start, end) of `request_id`.

    entries: {position: {token: Logprob}} for the prompt tokens its rows scored (start + 1 ..), each
    with the actual token and the top k; boundary_entry: the token at `start` scored from the boundary
    row the plan named (None: none named or none at hand); boundary: the segment's last logits row
    when the plan asked to keep it (runner-owned [vocab] float32; opaque here)."""

    request_id: str
    start: int
    end: int
    entries: dict[int, dict[int, Logprob]]
    boundary_entry: dict[int, Logprob] | None = None
    boundary: object | None = None


@dataclass(frozen=True)
class Verified:
    """Speculative decoding: what a `Verify` of the plan yields. tokens: the accepted drafts, then the
    target's own token (1 .. m + 1 tokens, in order); num_drafts: the m drafts verified."""

    request_id: str
    tokens: tuple[SampledToken, ...]
    num_drafts: int


@dataclass(frozen=True)
class StepResult:
    """request_ids[i] sampled tokens[i] (the sampling segments, packed order, except those of verifying
    requests); prompt_scores: one per `PromptScoring` of the plan, in its order; verified: one per
    `Verify` of the plan; drafts: request id -> the tokens the MTP head drafted after this step's
    last token (speculative decoding; empty otherwise)."""

    request_ids: tuple[str, ...]
    tokens: tuple[SampledToken, ...]
    prompt_scores: tuple[SegmentScores, ...] = ()
    verified: tuple[Verified, ...] = ()
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptScores:
    """Prompt logprobs a checkpoint carries for its readers: `entries[p]` for the prefix tokens
    p = 1 .. state_tokens - 1 (top `k`), and `boundary`, the runner's logits row at position
    state_tokens - 1 (a `SegmentScores.boundary`), which scores each reader's own token at state_tokens."""

    k: int
    entries: dict[int, dict[int, Logprob]]
    boundary: object


def truncate(entry: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """`entry` (the actual `token` and a top-k' with k' >= k) cut to the actual token and the top k."""
    return {t: v for t, v in entry.items() if t == token or v.rank <= k}
