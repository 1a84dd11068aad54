"""apply_logits_processors against a per-row plain-PyTorch reference, and vLLM's semantics."""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch

from forkpoint.runner.logits_processors import (
    RequestProcessors,
    apply_logits_processors,
    bad_words_token_ids,
)
from forkpoint.runner.sampler import sample
from forkpoint.sampling_params import SamplingParams

V = 64


def reference(logits: torch.Tensor, rows) -> torch.Tensor:
    """One row at a time, the rules of the module docstring (no grammar)."""
    out = logits.clone()
    for r, row in enumerate(rows):
        if row is None:
            continue
        state, output = row
        for token, value in state.bias.items():
            out[r, token] += value
        if state.allowed is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[state.allowed] = True
            masked = out[r].masked_fill(~keep, float("-inf"))
            if not torch.isneginf(masked).all():
                out[r] = masked
        before = out[r].clone()
        if len(output) < state.min_tokens:
            out[r, list(state.stop_ids)] = float("-inf")
        for word in state.bad_words:
            if len(word) == 1 or list(output[-(len(word) - 1):]) == list(word[:-1]):
                out[r, word[-1]] = float("-inf")
        if torch.isneginf(out[r]).all():
            out[r] = before
    return out


def random_state(rng: random.Random) -> RequestProcessors:
    allowed = sorted(rng.sample(range(V), rng.randint(1, 6))) if rng.random() < 0.4 else None
    bias = {rng.randrange(V): rng.uniform(-5, 5) for _ in range(rng.randint(0, 4))}
    words = tuple(tuple(rng.randrange(V) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3)))
    return RequestProcessors(bias, allowed, words, rng.randint(0, 3), tuple(rng.sample(range(V), 2)), None)


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_equals_reference(seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    R = rng.randint(1, 7)
    logits = torch.randn(R, V, generator=generator)
    rows = []
    for _ in range(R):
        if rng.random() < 0.25:
            rows.append(None)
            continue
        state = random_state(rng)
        output = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
        if state.bad_words and rng.random() < 0.7:  # make a multi-token word's prefix the output's tail
            output += list(state.bad_words[0][:-1])
        rows.append((state, output))
    expected = reference(logits, rows)
    got = logits.clone()
    apply_logits_processors(got, rows)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-6)
    assert not torch.isneginf(got).all(dim=1).any()


def state(**kwargs) -> RequestProcessors:
    fields = {"bias": {}, "allowed": None, "bad_words": (), "min_tokens": 0, "stop_ids": (), "matcher": None}
    fields.update(kwargs)
    return RequestProcessors(**fields)


def test_semantics_one_by_one():
    logits = torch.zeros(1, V)
    out = logits.clone()
    apply_logits_processors(out, [(state(bias={3: 2.5, 5: -1.0}), [])])
    assert out[0, 3] == 2.5 and out[0, 5] == -1.0 and out[0, 4] == 0.0
    out = logits.clone()
    apply_logits_processors(out, [(state(allowed=[7, 9]), [])])
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [7, 9]
    out = logits.clone()
    apply_logits_processors(out, [(state(min_tokens=2, stop_ids=(1, 2)), [5])])
    assert torch.isneginf(out[0]).nonzero()[:, 0].tolist() == [1, 2]
    out = logits.clone()
    apply_logits_processors(out, [(state(min_tokens=2, stop_ids=(1, 2)), [5, 6])])  # reached: nothing masked
    assert torch.isfinite(out).all()
    out = logits.clone()  # a two-token bad word is blocked only after its first token
    apply_logits_processors(out, [(state(bad_words=((10, 11),)), [3, 10])])
    assert torch.isneginf(out[0]).nonzero()[:, 0].tolist() == [11]
    out = logits.clone()
    apply_logits_processors(out, [(state(bad_words=((10, 11),)), [3, 12])])
    assert torch.isfinite(out).all()


def test_soft_masks_that_would_empty_a_row_are_dropped():
    out = torch.zeros(1, V)
    apply_logits_processors(out, [(state(allowed=[4], min_tokens=1, stop_ids=(4,)), [])])
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [4]


def test_sampler_keeps_raw_logprobs_and_obeys_processors():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=generator)
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, logprobs=0)]
    out = sample(logits, params, [None, torch.Generator().manual_seed(1)], [((), ()), ((), ())],
                 processors=[state(allowed=[5]), state(bias={6: 100.0})])
    assert [t.token_id for t in out] == [5, 6]
    raw = torch.log_softmax(logits, dim=-1)
    assert abs(out[0].logprobs[5] - float(raw[0, 5])) < 1e-6  # the unmodified distribution's logprob
    assert torch.equal(logits, torch.randn(2, V, generator=torch.Generator().manual_seed(0)))  # input untouched


class FakeTokenizer:
    """encode: 'foo' -> [1, 2], ' foo' -> [3, 2], 'bar' -> [4], ' bar' -> [5, 4] (longer: dropped)."""

    TABLE: ClassVar[dict[str, list[int]]] = {"foo": [1, 2], " foo": [3, 2], "bar": [4], " bar": [5, 4]}

    def encode(self, text, add_special_tokens=False):
        return self.TABLE[text]


def test_bad_words_tokenised_with_and_without_leading_space():
    assert bad_words_token_ids(["  foo", "bar"], FakeTokenizer()) == ((1, 2), (3, 2), (4,))


def test_params_validation():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("inf")})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(5))
def test_cuda_equals_cpu(seed):
    from forkpoint.structured import apply_bitmask_

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, V, generator=generator)
    rows = [(random_state(rng), [rng.randrange(V) for _ in range(rng.randint(0, 3))]) for _ in range(6)]
    cpu, cuda = logits.clone(), logits.cuda()
    apply_logits_processors(cpu, rows)
    apply_logits_processors(cuda, rows)
    assert torch.equal(torch.isneginf(cuda).cpu(), torch.isneginf(cpu))
    torch.testing.assert_close(cuda.cpu()[torch.isfinite(cpu)], cpu[torch.isfinite(cpu)], rtol=0, atol=1e-6)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (V + 31) // 32), dtype=torch.int32, generator=generator)
    picked = torch.tensor([4, 1])
    apply_bitmask_(cpu, picked, bitmask)
    apply_bitmask_(cuda, picked.cuda(), bitmask.pin_memory())
    assert torch.equal(torch.isneginf(cuda).cpu(), torch.isneginf(cpu))
