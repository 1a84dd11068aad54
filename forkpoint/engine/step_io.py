"""The engine's side of sampling and prompt scoring: the per-row values a plan carries to the runner
(step/sampling.py), built from the step's requests, and the prompt scores of a `StepResult` put back
onto the requests and the checkpoints they write. Host data only: the runner does the tensor work.

Prompt scores across a checkpoint: a segment that ends where a checkpoint it writes keeps its state
leaves the prefix's scores with that checkpoint (`PromptScores`: the entries and the runner's last
logits row); a segment that starts at a checkpoint takes the prefix's scores from it, and the runner
scores its token at the boundary from that row (from this step's producer row when both meet in one
step: the producer's segment runs in an earlier phase, so its scores are attached first).
"""

from __future__ import annotations

import dataclasses

from forkpoint.cache.checkpoint_types import Checkpoint
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.engine.request import Request
from forkpoint.engine.step_planning import ScheduledStep
from forkpoint.step.plan import StepPlan
from forkpoint.step.result import PromptScores, SegmentScores, StepResult, truncate
from forkpoint.step.sampling import PromptScoring, StepSampling, TokenSampling


def plan_with_sampling(step: ScheduledStep, num_unseen: int = 0) -> StepPlan:
    """`step.plan` with its sampling rows and prompt scorings (for the segments of requests that ask
    for prompt logprobs that score rows or resume at a checkpoint). num_unseen: output tokens each
    sampled sequence has on the device only (1 for a step fed from the step before)."""
    by_id = {request.request_id: request for request in step.requests}
    rows = tuple(_token_sampling(by_id[s.request_id], num_unseen) for s in step.plan.segments if s.samples)
    return dataclasses.replace(step.plan, sampling=StepSampling(rows, _prompt_scorings(step, by_id)))


def _prompt_scorings(step: ScheduledStep, by_id: dict[str, Request]) -> tuple[PromptScoring, ...]:
    """The step's prompt scorings, in packed order; none when no request in it asks for prompt logprobs
    (a decode step's segments are then not even put in packed order)."""
    if all(request.params.prompt_logprobs is None for request in step.requests):
        return ()
    producers = {id(checkpoint): producer for checkpoint, producer in step.written}
    writes = _writes(step)
    scores = []
    for segment in step.plan.ordered():
        request = by_id[segment.request_id]
        k = request.params.prompt_logprobs
        if k is None:
            continue
        first, count = segment.start + 1, segment.prompt_logit_rows
        source = _resumed_from(request, segment.start)
        if not count and source is None:
            continue  # a decode, or a chunk past the prompt: nothing to score or take
        boundary = boundary_of = boundary_token = None
        if source is not None and segment.start < len(request.prompt_token_ids):
            boundary_token = request.prompt_token_ids[segment.start]
            if source.prompt_scores is not None:
                boundary = source.prompt_scores.boundary
            elif id(source) in producers:  # written in this step by an earlier phase
                boundary_of = (producers[id(source)].request_id, source.state_tokens)
        written = writes.get((id(request), segment.end))
        targets = tuple(request.prompt_token_ids[first: first + count])
        scores.append(PromptScoring(segment.request_id, segment.start, k, targets, boundary_token, boundary,
                                    boundary_of, written is not None and written.prompt_scores_k is not None))
    return tuple(scores)


def record_prompt_scores(step: ScheduledStep, result: StepResult, registry: CheckpointRegistry | None) -> None:
    """Put the result's prompt scores (packed order) on the step's requests, taking a resumed
    prefix's scores from its checkpoint and leaving them with each checkpoint written at a segment's end."""
    by_id = {request.request_id: request for request in step.requests}
    writes = _writes(step)
    for scores in result.prompt_scores:
        request = by_id[scores.request_id]
        k = request.params.prompt_logprobs
        source = _resumed_from(request, scores.start)
        if source is not None and source.prompt_scores is not None:
            _take_prefix_scores(request, source.prompt_scores, scores, k)
        request.prompt_logprobs.update(scores.entries)
        written = writes.get((id(request), scores.end))
        if written is not None and written.prompt_scores_k is not None and scores.boundary is not None:
            entries = {p: request.prompt_logprobs.get(p) for p in range(1, scores.end)}
            if None not in entries.values():  # complete (always, unless a fault interrupted a chain)
                registry.attach_prompt_scores(written, PromptScores(k, entries, scores.boundary))


def _token_sampling(request: Request, num_unseen: int) -> TokenSampling:
    return TokenSampling(request.request_id, request.params, request.seed, request.prompt_token_ids,
                         request.output_token_ids, request.processors, num_unseen)


def _writes(step: ScheduledStep) -> dict[tuple[int, int], Checkpoint]:
    """(id(producer), position) -> the checkpoint it writes there in this step."""
    return {(id(producer), c.state_tokens): c for c, producer in step.written}


def _resumed_from(request: Request, start: int) -> Checkpoint | None:
    """The checkpoint a segment of `request` starting at `start` resumes from, if any."""
    source = request.checkpointing.read_from
    return source if source is not None and start == source.state_tokens else None


def _take_prefix_scores(request: Request, carried: PromptScores, scores: SegmentScores, k: int) -> None:
    """Scores of prompt tokens 1 .. start from a checkpoint ending at `start` (top-k cut to `k`)."""
    tokens = request.prompt_token_ids
    request.prompt_logprobs.update({p: truncate(e, tokens[p], k) for p, e in carried.entries.items()})
    if scores.start < len(tokens):
        request.prompt_logprobs[scores.start] = scores.boundary_entry
