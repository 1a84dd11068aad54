"""The runner's sampling stage: a plan's per-row values in, a `StepResult` out. Same tokens as the
sampler given the same seeded generators, generators kept per sequence across steps until released,
and prompt scores across a checkpoint boundary (from this step's producer row, or a kept row)."""

from __future__ import annotations

import pytest
import torch

from forkpoint.runner.prompt_logprobs import score_tokens
from forkpoint.runner.sampler import Sampler, SamplingRow
from forkpoint.runner.step_sampler import StepSampler
from forkpoint.sampling_params import SamplingParams
from forkpoint.step.plan import Segment, SegmentKind, StepPlan
from forkpoint.step.sampling import PromptScoring, StepSampling, TokenSampling

VOCAB = 40
CPU = torch.device("cpu")
TOKENS = list(range(3, 13))  # one prompt of 10 tokens


def segment(request_id: str, start: int, end: int, *, samples: bool, rows: int = 0, phase: int = 0) -> Segment:
    return Segment(request_id, start, end, TOKENS[start:end], (1,), 1, (), SegmentKind.PREFILL, phase, samples,
                   prompt_logit_rows=rows)


PARAMS = {"a": SamplingParams(temperature=0.7, seed=5, logprobs=2),
          "b": SamplingParams(temperature=0.0, logprobs=0),
          "c": SamplingParams(temperature=1.0, top_k=7, presence_penalty=0.5)}
SEEDS = {"a": 5, "b": None, "c": 1234}


def test_samples_as_the_sampler_and_keeps_each_generator_until_released():
    segments = tuple(segment(key, 0, 3, samples=True) for key in PARAMS)
    stepper = StepSampler(VOCAB, CPU)
    generators = {k: torch.Generator().manual_seed(s) if s is not None else None for k, s in SEEDS.items()}
    reference = Sampler(VOCAB, CPU)
    outputs: dict[str, list[int]] = {k: [] for k in PARAMS}
    draws = torch.Generator().manual_seed(0)
    for _ in range(3):  # later steps draw on from the same generators, with the tokens counted
        rows = tuple(TokenSampling(k, PARAMS[k], SEEDS[k], TOKENS[:3], outputs[k]) for k in PARAMS)
        logits = torch.randn(len(PARAMS), VOCAB, generator=draws)
        result = stepper.launch(StepPlan(segments, sampling=StepSampling(rows)), list(segments), logits).result()
        expected = reference.sample(logits, [SamplingRow(k, PARAMS[k], generators[k], TOKENS[:3], outputs[k])
                                             for k in PARAMS])
        assert result.request_ids == tuple(PARAMS) and result.tokens == tuple(expected)
        assert result.tokens[1].logprobs is not None and result.prompt_scores == ()
        for key, token in zip(PARAMS, result.tokens):
            outputs[key].append(token.token_id)
    stepper.check_integrity(set(PARAMS))
    with pytest.raises(AssertionError, match="'a'"):
        stepper.check_integrity({"b", "c"})  # a ended but was never released: its generator leaks
    stepper.release(["a", "b", "c", "unknown"])
    stepper.check_integrity(set())


def test_a_sampled_segment_without_a_row_is_refused():
    segments = (segment("a", 0, 3, samples=True),)
    with pytest.raises(ValueError, match="no sampling row"):
        StepSampler(VOCAB, CPU).launch(StepPlan(segments), list(segments), torch.zeros(1, VOCAB))


def test_prompt_scores_cross_the_checkpoint_boundary():
    """A producer scores tokens 1..4 and ends at the checkpoint at 4; a consumer resumes there in a
    later phase of the same step and scores token 4 from the producer's last row, then 5 and 6."""
    producer = segment("p", 0, 4, samples=False, rows=4, phase=0)
    consumer = segment("c", 4, 6, samples=True, rows=2, phase=1)
    scorings = (PromptScoring("p", 0, 3, tuple(TOKENS[1:5]), keep_boundary=True),
                PromptScoring("c", 4, 3, tuple(TOKENS[5:7]), boundary_token=TOKENS[4], boundary_of=("p", 4)))
    rows = (TokenSampling("c", SamplingParams(temperature=0.0), None),)
    plan = StepPlan((consumer, producer), sampling=StepSampling(rows, scorings))
    logits = torch.randn(1 + 6, VOCAB, generator=torch.Generator().manual_seed(1))
    result = StepSampler(VOCAB, CPU).launch(plan, [consumer], logits).result()

    prompt_rows = logits[1:]
    ours_p, ours_c = result.prompt_scores
    assert (ours_p.request_id, ours_p.start, ours_p.end, ours_c.start, ours_c.end) == ("p", 0, 4, 4, 6)
    assert ours_p.entries == dict(zip(range(1, 5), score_tokens(prompt_rows[:4], torch.tensor(TOKENS[1:5]), 3)))
    assert ours_c.entries == dict(zip((5, 6), score_tokens(prompt_rows[4:6], torch.tensor(TOKENS[5:7]), 3)))
    boundary_entry = score_tokens(prompt_rows[3:4], torch.tensor([TOKENS[4]]), 3)[0]
    assert ours_c.boundary_entry == boundary_entry and ours_p.boundary_entry is None
    assert torch.equal(ours_p.boundary, prompt_rows[3]) and ours_c.boundary is None

    # a later step resumes from the row kept with the checkpoint
    later = StepPlan((consumer,), sampling=StepSampling(rows, (PromptScoring(
        "c", 4, 3, tuple(TOKENS[5:7]), boundary_token=TOKENS[4], boundary=ours_p.boundary),)))
    again = StepSampler(VOCAB, CPU).launch(later, [consumer], torch.cat([logits[:1], logits[5:]])).result()
    assert again.prompt_scores[0].boundary_entry == boundary_entry
    assert again.prompt_scores[0].entries == ours_c.entries


def test_prompt_scoring_that_does_not_fit_its_segment_is_refused():
    scored = segment("p", 0, 4, samples=False, rows=4)
    plan = StepPlan((scored,), sampling=StepSampling((), (PromptScoring("p", 0, 3, tuple(TOKENS[1:4])),)))
    with pytest.raises(ValueError, match="3 prompt-score targets for 4"):
        StepSampler(VOCAB, CPU).launch(plan, [], torch.zeros(4, VOCAB))
