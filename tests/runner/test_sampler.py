"""Sampler: filters keep only allowed tokens; logprobs are those of the raw distribution."""

from __future__ import annotations

import torch

from forkpoint.runner.sampler import sample
from forkpoint.sampling_params import SamplingParams


def draws(logits: torch.Tensor, params: SamplingParams, count: int = 300) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {sample(logits[None], [params], [generator])[0].token_id for _ in range(count)}


def test_filters_restrict_the_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.65)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, min_p=0.4)) == {0, 1, 2}
    assert draws(logits, SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draws(logits, SamplingParams(temperature=0.0)) == {0}


def test_logprobs_are_raw_and_include_the_sampled_token():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=generator)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, top_k=5, logprobs=0),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, [None, torch.Generator().manual_seed(2), None])
    raw = torch.log_softmax(logits, dim=-1)
    assert out[0].token_id == int(logits[0].argmax()) and len(out[0].logprobs) == 3
    for token, value in out[0].logprobs.items():
        assert abs(value - float(raw[0, token])) < 1e-6
    assert [v.rank for v in out[0].logprobs.values()] == [1, 2, 3]
    assert out[0].logprobs[out[0].token_id].logprob == max(out[0].logprobs.values())  # vLLM-style access
    assert list(out[1].logprobs) == [out[1].token_id]
    assert out[1].logprobs[out[1].token_id].rank == int((raw[1] > raw[1, out[1].token_id]).sum()) + 1
    assert abs(out[1].logprobs[out[1].token_id] - float(raw[1, out[1].token_id])) < 1e-6
    assert out[2].logprobs is None


def test_penalties_follow_vllm_semantics():
    from forkpoint.runner.sampler import apply_penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    prompt, output = [0], [2, 2, 3]
    presence = apply_penalties(logits, SamplingParams(presence_penalty=0.5), prompt, output)
    assert torch.allclose(presence, torch.tensor([2.0, -1.0, 0.0, 2.5]))
    frequency = apply_penalties(logits, SamplingParams(frequency_penalty=0.5), prompt, output)
    assert torch.allclose(frequency, torch.tensor([2.0, -1.0, -0.5, 2.5]))
    repetition = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0, 1], [3])
    assert torch.allclose(repetition, torch.tensor([1.0, -2.0, 0.5, 1.5]))
    # greedy follows the penalised logits; logprobs stay those of the raw distribution
    out = sample(logits[None], [SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=1)], [None],
                 [(prompt, output)])[0]
    assert out.token_id == 0
    assert abs(out.logprobs[0] - float(torch.log_softmax(logits, -1)[0])) < 1e-6


def test_penalty_ranges_are_validated():
    import pytest

    for kwargs in (dict(presence_penalty=3.0), dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
