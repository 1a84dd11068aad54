"""The vectorised sampler against its per-row reference, its penalty state across steps, and its
one host copy per step."""

from __future__ import annotations

import pytest
import torch

from forkpoint.runner.sampler import Sampler, SamplingRow, reference_sample, sample
from forkpoint.sampling_params import SamplingParams

VOCAB = 400
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=20, logprobs=2),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1, top_k=50, top_p=0.9, logprobs=0),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=0.0, presence_penalty=1.0, repetition_penalty=0.8, logprobs=3),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=0.5, top_p=0.05, frequency_penalty=-1.0, logprobs=5),
]


def generators(seed: int) -> list[torch.Generator | None]:
    return [None if p.greedy else torch.Generator().manual_seed(seed * 100 + i) for i, p in enumerate(MIXED)]


def histories(gen: torch.Generator) -> list[tuple[list[int], list[int]]]:
    return [(torch.randint(0, VOCAB, (7,), generator=gen).tolist(),
             torch.randint(0, VOCAB, (i,), generator=gen).tolist()) for i in range(len(MIXED))]


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_equals_the_reference_on_fresh_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), VOCAB, generator=gen) * 4
    hist = histories(gen)
    fast = sample(logits, MIXED, generators(seed), hist)
    rows = [SamplingRow(str(i), p, g, *h) for i, (p, g, h) in enumerate(zip(MIXED, generators(seed), hist))]
    spec = reference_sample(logits, rows)
    assert [t.token_id for t in fast] == [t.token_id for t in spec]
    for a, b in zip(fast, spec):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert a.logprobs.keys() == b.logprobs.keys()
            for token in a.logprobs:
                assert a.logprobs[token] == pytest.approx(b.logprobs[token], abs=1e-6)
                assert a.logprobs[token].rank == b.logprobs[token].rank


def test_greedy_is_the_argmax_of_the_penalised_logits():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_penalty_state_across_steps_matches_rebuilding_from_history():
    gen = torch.Generator().manual_seed(11)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    params = [MIXED[4], MIXED[5], MIXED[1]]
    prompts = [torch.randint(0, VOCAB, (9,), generator=gen).tolist() for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    fast_gens = [torch.Generator().manual_seed(i) for i in range(3)]
    spec_gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for step in range(12):
        logits = torch.randn(3, VOCAB, generator=gen)
        logits[:, :4] += 6.0  # a few likely tokens, so penalties have repeats to act on
        rows = [SamplingRow(f"r{i}", p, fast_gens[i], prompts[i], list(outputs[i])) for i, p in enumerate(params)]
        spec = reference_sample(logits, [SamplingRow(f"r{i}", p, spec_gens[i], prompts[i], list(outputs[i]))
                                         for i, p in enumerate(params)])
        fast = sampler.sample(logits, rows)
        assert [t.token_id for t in fast] == [t.token_id for t in spec], f"step {step}"
        for i, token in enumerate(fast):
            outputs[i].append(token.token_id)
    assert any(len(set(o)) < len(o) for o in outputs)  # tokens did repeat
    assert len(sampler.penalties) == 2  # only the penalised rows hold state
    sampler.check_integrity({"r0", "r1", "r2"})
    sampler.free("r0")
    with pytest.raises(AssertionError, match="r1"):
        sampler.check_integrity({"r0", "r2"})  # r1 ended but was never freed: a leak
    sampler.free("r1")
    sampler.free("unknown")
    sampler.check_integrity(set())
    assert len(sampler.penalties) == 0


def test_stale_state_is_rebuilt_from_the_history():
    """A row whose history no longer matches what was counted (e.g. a reused id) starts over."""
    sampler = Sampler(VOCAB, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.5
    assert sampler.sample(logits, [SamplingRow("a", params, None, [], [])])[0].token_id == 5
    # the engine would now append 5; this history says 6 was generated twice instead
    assert sampler.sample(logits, [SamplingRow("a", params, None, [], [6, 6])])[0].token_id == 5
    # (kept state would say 5 once: 6 would win with 2.5 against 3 - 2)


def test_the_pool_of_penalty_rows_grows_and_reuses_rows():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    for i in range(9):
        sampler.sample(torch.randn(1, VOCAB), [SamplingRow(f"k{i}", params, None, [1], [])])
    capacity = sampler.penalties.counts.shape[0]
    assert capacity >= 9
    for i in range(9):
        sampler.free(f"k{i}")
    for i in range(9):
        sampler.sample(torch.randn(1, VOCAB), [SamplingRow(f"j{i}", params, None, [1], [])])
    assert sampler.penalties.counts.shape[0] == capacity
    sampler.check_integrity({f"j{i}" for i in range(9)})


def test_one_host_copy_per_step(monkeypatch):
    copies = []
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            copies.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    rows = [SamplingRow(str(i), p, g, [1, 2], [3]) for i, (p, g) in enumerate(zip(MIXED, generators(1)))]
    for _ in range(3):
        copies.clear()
        sampler.sample(torch.randn(len(MIXED), VOCAB, generator=gen), rows)
        assert copies == ["tolist"]
        rows = [SamplingRow(r.key, r.params, r.generator, r.prompt_token_ids, [*r.output_token_ids, 0])
                for r in rows]


def test_rows_and_logits_must_agree():
    with pytest.raises(ValueError, match="2 logits rows for 1 sampling rows"):
        Sampler(VOCAB, torch.device("cpu")).sample(torch.zeros(2, VOCAB), [SamplingRow("a", MIXED[0], None)])


@pytest.mark.gpu
def test_vectorised_equals_the_reference_on_cuda():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(len(MIXED), VOCAB, generator=gen) * 4).to(device)
    hist = histories(gen)

    def gens():
        return [None if p.greedy else torch.Generator(device=device).manual_seed(i) for i, p in enumerate(MIXED)]

    fast = sample(logits, MIXED, gens(), hist)
    spec = reference_sample(logits, [SamplingRow(str(i), p, g, *h)
                                     for i, (p, g, h) in enumerate(zip(MIXED, gens(), hist))])
    assert [t.token_id for t in fast] == [t.token_id for t in spec]
