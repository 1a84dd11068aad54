"""What the runner samples and scores in a step: per-row host values, carried in the plan
(`StepPlan.sampling`). The engine builds them from its requests (engine/step_io.py); the runner
turns them into device work (runner/step_sampler.py). No tensors here.

Ownership: the runner keeps the per-sequence device state across steps (penalty counts, the
generator made from `seed`) until the engine `release`s the sequence. The grammar matcher inside
`processors` is the request's (engine side): the runner reads it to fill and apply the step's mask,
and the engine advances it with each token it commits (engine/output_processor.py), so a mask always
follows the tokens the host has seen (a grammar row is never scheduled ahead of its last token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forkpoint.sampling_params import SamplingParams

if TYPE_CHECKING:
    from forkpoint.runner.logits_processors import RequestProcessors


@dataclass
class TokenSampling:
    """How to sample the next token of the sampling segment of `request_id` (one per step).

    seed: the sequence's generator seed (None: greedy, no generator); the runner seeds a generator
    with it the first time it samples the sequence and keeps drawing from that one.
    prompt_token_ids / output_token_ids: the sequence's tokens so far, read when the step is executed
    (penalty counts are built from them once; bad words and min_tokens read the output);
    processors: its logits-processor state (None: none asked for);
    num_unseen: output tokens already sampled on the device that `output_token_ids` lacks (a step
    fed from the step before: asynchronous scheduling).

    Not frozen, as step/plan.py's `Segment`: one per sampled sequence per step, and a frozen `__init__`
    took 0.9 us against 0.25 us (engine/step_io.py's `plan_with_sampling` at 256 sequences: 0.38 ms
    against 0.23 ms). Nothing writes its fields once it is built."""

    request_id: str
    params: SamplingParams
    seed: int | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    processors: RequestProcessors | None = None
    num_unseen: int = 0


@dataclass(frozen=True)
class PromptScoring:
    """Prompt logprobs of the segment of `request_id` starting at `start`, top `k`.

    targets: the prompt tokens at start + 1 .. start + len(targets), scored by the segment's
    `prompt_logit_rows` rows (one each).
    boundary_token: the prompt token at `start` (None: none there, or no boundary to score it from),
    scored from the logits row that ends the prefix the segment resumes after: `boundary` (a row kept
    by an earlier step, `SegmentScores.boundary`) or `boundary_of` = (request id, end) of a segment of
    this step whose last row it is (a producer writing that checkpoint in an earlier phase).
    keep_boundary: return the segment's last row as `SegmentScores.boundary` (the segment ends where a
    checkpoint that keeps prompt scores is written)."""

    request_id: str
    start: int
    k: int
    targets: tuple[int, ...] = ()
    boundary_token: int | None = None
    boundary: object | None = None
    boundary_of: tuple[str, int] | None = None
    keep_boundary: bool = False


@dataclass(frozen=True)
class StepSampling:
    """rows: one per sampling segment (matched by request id); scores: one per segment of a request
    that asks for prompt logprobs, in packed order (`StepPlan.ordered`)."""

    rows: tuple[TokenSampling, ...] = ()
    scores: tuple[PromptScoring, ...] = ()
