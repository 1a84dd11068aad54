"""The runner's last stage of a step: sample the sampling segments' rows and score the prompt rows,
from the plan's per-row values (`StepPlan.sampling`, step/sampling.py) and the forward's logits.

    logits [R + P, V]:  rows 0 .. R-1  the R sampling segments (packed order)   -> Sampler.sample_async
                        rows R ..      the P prompt-logit rows, segment by segment -> score_tokens

Sampling is only enqueued: `PendingStep.feed` holds the chosen ids on the device (the next step's
inputs under asynchronous scheduling) and `PendingStep.result()` waits for their host copy. Prompt
scores are read back at once (a step that scores is never scheduled ahead).

State across steps, per sequence, until `release`: the penalty counts (`Sampler`) and the
generator seeded from `TokenSampling.seed` on the sequence's first sampled token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from forkpoint.runner.prompt_logprobs import score_tokens
from forkpoint.runner.sampler import PendingSample, Sampler, SamplingRow
from forkpoint.step.plan import Segment, StepPlan
from forkpoint.step.result import SegmentScores, StepResult
from forkpoint.step.sampling import PromptScoring, TokenSampling


class PendingStep:
    """A step whose forward and sampling are enqueued. feed: [R] long on the device, the sampled ids
    (a later plan's `fed_row`s index them); `result()` waits for this step's host copy only."""

    def __init__(self, sampled: PendingSample, request_ids: tuple[str, ...], scores: tuple[SegmentScores, ...]):
        self._sampled, self._request_ids, self._scores = sampled, request_ids, scores

    @property
    def feed(self) -> torch.Tensor:
        return self._sampled.token_ids

    def result(self) -> StepResult:
        return StepResult(self._request_ids, tuple(self._sampled.result()), self._scores)


class StepSampler:
    """Samples and scores a step's logits on `device`; owns the per-sequence sampling state."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.sampler = Sampler(vocab_size, device)
        self._generators: dict[str, torch.Generator] = {}

    def launch(self, plan: StepPlan, sampled: Sequence[Segment], logits: torch.Tensor) -> PendingStep:
        """logits: [len(sampled) + prompt rows, V] float32 of `plan`'s forward (`build_forward_batch`'s
        rows); `sampled`: the sampling segments in row order."""
        rows_by_id = {row.request_id: row for row in plan.sampling.rows}
        rows = []
        for segment in sampled:
            spec = rows_by_id.get(segment.request_id)
            if spec is None:
                raise ValueError(f"the segment of {segment.request_id} samples but the plan has no sampling row "
                                 "for it (StepPlan.sampling.rows)")
            rows.append(SamplingRow(spec.request_id, spec.params, self._generator(spec), spec.prompt_token_ids,
                                    spec.output_token_ids, spec.processors, spec.num_unseen))
        pending = self.sampler.sample_async(logits[: len(sampled)], rows)
        scores = self._score(plan, logits[len(sampled):]) if plan.sampling.scores else ()
        return PendingStep(pending, tuple(s.request_id for s in sampled), scores)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget ended sequences (unknown ids are ignored)."""
        for request_id in request_ids:
            self.sampler.free(request_id)
            self._generators.pop(request_id, None)

    def check_integrity(self, live_ids: set[str]) -> None:
        """State is held only for live sequences; raises AssertionError."""
        self.sampler.check_integrity(live_ids)
        leaked = set(self._generators) - live_ids
        if leaked:
            raise AssertionError(f"sampling generators kept for sequences that have ended: {sorted(leaked)[:5]}")

    def generator(self, spec: TokenSampling) -> torch.Generator | None:
        """The sequence's generator (made from `spec.seed` the first time; None when greedy): the one its
        plain sampling draws from, so speculative steps continue the same stream."""
        return self._generator(spec)

    def _generator(self, spec: TokenSampling) -> torch.Generator | None:
        if spec.seed is None:
            return None
        generator = self._generators.get(spec.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(spec.seed)
            self._generators[spec.request_id] = generator
        return generator

    def _score(self, plan: StepPlan, rows: torch.Tensor) -> tuple[SegmentScores, ...]:
        """Prompt scores of the plan's `PromptScoring`s. rows: [P, V], each scored segment's
        `prompt_logit_rows` in packed order."""
        segments = plan.ordered()
        offsets, offset = {}, 0
        for segment in segments:
            offsets[(segment.request_id, segment.start)] = offset
            offset += segment.prompt_logit_rows
        by_start = {(s.request_id, s.start): s for s in segments}
        last_rows = {(s.request_id, s.end): offsets[(s.request_id, s.start)] + s.prompt_logit_rows - 1
                     for s in segments if s.prompt_logit_rows}
        return tuple(self._score_segment(spec, by_start, offsets, last_rows, rows) for spec in plan.sampling.scores)

    def _score_segment(self, spec: PromptScoring, by_start: dict[tuple[str, int], Segment],
                       offsets: dict[tuple[str, int], int], last_rows: dict[tuple[str, int], int],
                       rows: torch.Tensor) -> SegmentScores:
        segment = by_start.get((spec.request_id, spec.start))
        if segment is None:
            raise ValueError(f"prompt scoring for {spec.request_id} at {spec.start} names no segment of the plan")
        count = segment.prompt_logit_rows
        if len(spec.targets) != count:
            raise ValueError(f"{len(spec.targets)} prompt-score targets for {count} prompt-logit rows "
                             f"({spec.request_id} at {spec.start})")
        entries, offset = {}, offsets[(spec.request_id, spec.start)]
        if count:
            first = spec.start + 1
            targets = torch.tensor(spec.targets, device=rows.device)
            entries = dict(zip(range(first, first + count), score_tokens(rows[offset: offset + count], targets,
                                                                            spec.k)))
        boundary = spec.boundary
        if boundary is None and spec.boundary_of is not None and spec.boundary_of in last_rows:
            boundary = rows[last_rows[spec.boundary_of]]
        boundary_entry = None
        if spec.boundary_token is not None and boundary is not None:
            target = torch.tensor([spec.boundary_token], device=boundary.device)
            boundary_entry = score_tokens(boundary[None], target, spec.k)[0]
        kept = rows[offset + count - 1].clone() if spec.keep_boundary and count else None
        return SegmentScores(spec.request_id, spec.start, segment.end, entries, boundary_entry, kept)
