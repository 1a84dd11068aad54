"""The sampler draws from the distribution vLLM's filters define (chi-square goodness of fit against
targets computed here in float64 from the definitions, 1e-4 level), a check that fails on a wrong
sampler; a seeded row's tokens do not depend on what else is in its batch or on the chunking; the
two-level race covers a padded vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from forkpoint.runner import random_draw
from forkpoint.runner.sampler import Sampler, SamplingRow, block_size, reference_sample, sample, sampling_weights
from forkpoint.sampling_params import SamplingParams

VOCAB = 100  # blocks of 16: 7 blocks, the last padded
DRAWS = 20_000
CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=10),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "combined": SamplingParams(temperature=1.3, top_k=30, top_p=0.9, min_p=0.02),
}


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution of vLLM's filters, in float64, by their definitions (one sort, no thresholds)."""
    scores = logits.double() / params.temperature
    probs = torch.softmax(scores, dim=-1)
    keep = probs >= params.min_p * probs.max()
    order = scores.argsort(descending=True)
    if 0 < params.top_k < scores.numel():
        keep[order[params.top_k:]] = False
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass_before = kept[order].cumsum(0) - kept[order]  # mass of the tokens ranked above each
    keep[order[mass_before >= params.top_p]] = False
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic over the bins expected at >= 5 draws (the rest pooled into one bin) and
    its 1 - 1e-4 critical value (Wilson-Hilferty); a draw outside the support is an infinite statistic."""
    total = float(counts.sum())
    if float(counts[probs == 0].sum()) > 0:
        return math.inf, 0.0
    expected = probs.double() * total
    big = expected >= 5
    observed = torch.cat([counts.double()[big], counts.double()[~big & (probs > 0)].sum()[None]])
    expected = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    nonzero = expected > 0
    statistic = float(((observed[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum())
    df = int(nonzero.sum()) - 1
    z = 3.7190  # standard normal quantile at 1 - 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def logits_under_test() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2.0


def counts_of(logits: torch.Tensor, params: SamplingParams, seeded: bool) -> torch.Tensor:
    """Token counts of DRAWS rows of `logits` sampled in one call (seeded: a generator per row;
    else the default generator, seeded here and restored after)."""
    rows = DRAWS if not seeded else DRAWS // 5
    batch = logits.expand(rows, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        generators = [torch.Generator().manual_seed(i) if seeded else None for i in range(rows)]
        tokens = [t.token_id for t in sample(batch, [params] * rows, generators)]
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_target_distribution(case):
    logits, params = logits_under_test(), CASES[case]
    probs = target(logits, params)
    for seeded in (False, True):
        statistic, critical = chi_square(counts_of(logits, params, seeded), probs)
        assert statistic < critical, (case, seeded, statistic, critical)


@pytest.mark.parametrize(("drawn", "expected"), [
    (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)),  # temperature ignored
    (SamplingParams(temperature=1.0, top_k=11), SamplingParams(temperature=1.0, top_k=10)),  # one token too many
    (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.8)),
    (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.1)),  # min-p ignored
])
def test_the_check_rejects_a_wrong_sampler(drawn, expected):
    """The goodness-of-fit check has the power to see a sampler that gets a filter wrong."""
    logits = logits_under_test()
    statistic, critical = chi_square(counts_of(logits, drawn, seeded=False), target(logits, expected))
    assert statistic > critical


def test_a_seeded_row_draws_the_same_tokens_in_any_batch_and_chunking(monkeypatch):
    """Rows sampled alone, then among other rows (seeded and not) with 3 rows a chunk: each seeded
    row's tokens are the same at every step."""
    vocab = 300
    params = [CASES["temperature"], CASES["top_p"], CASES["combined"], SamplingParams(temperature=0.9, min_p=0.05)]
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(len(params), vocab, generator=gen) * 3 for _ in range(5)]
    alone = []
    for i, p in enumerate(params):
        generator = torch.Generator().manual_seed(100 + i)
        alone.append([sample(step[i:i + 1], [p], [generator])[0].token_id for step in steps])
    monkeypatch.setattr(random_draw, "CHUNK_BYTES", 3 * 4 * vocab)
    generators = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    together: list[list[int]] = [[] for _ in params]
    for step in steps:
        others = torch.randn(7, vocab, generator=gen)
        batch = torch.cat([others[:2], step[:2], others[2:5], step[2:], others[5:]])
        rows = ([None] * 2 + [0, 1] + [None] * 3 + [2, 3] + [None] * 2)
        row_params = [params[r] if r is not None else SamplingParams(temperature=1.0, top_k=5) for r in rows]
        row_gens = [generators[r] if r is not None else None for r in rows]
        out = sample(batch, row_params, row_gens)
        for position, r in enumerate(rows):
            if r is not None:
                together[r].append(out[position].token_id)
    assert together == alone


def test_wide_top_p_sets_grow_the_bound_and_agree_with_the_full_sort():
    """Flat logits with top-p 0.97: kept sets beyond the CPU's first topk bound (256) are found by
    the growing bound, and draws equal the reference's (full sort)."""
    vocab = 3000
    params = [SamplingParams(temperature=1.5, top_p=0.97), SamplingParams(temperature=1.0, top_p=0.5, top_k=2000)]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(4)) * 0.5
    kept = (sampling_weights(logits, params) > 0).sum(dim=-1)
    assert int(kept[0]) > 256 * 8 and int(kept[1]) > 256  # both growth steps are taken
    for seed in range(5):
        fast = sample(logits, params, [torch.Generator().manual_seed(seed + i) for i in range(len(params))])
        spec = reference_sample(logits, [SamplingRow(str(i), p, torch.Generator().manual_seed(seed + i))
                                         for i, p in enumerate(params)])
        assert [t.token_id for t in fast] == [t.token_id for t in spec]


def test_the_race_reaches_the_last_token_of_a_padded_vocabulary():
    vocab = 50  # blocks of 8: the seventh holds tokens 48, 49 and six padded zeros
    assert block_size(vocab) == 8 and block_size(248_320) == 512
    logits = torch.full((64, vocab), -30.0)
    logits[:, 49] = 0.0
    logits[:, 47] = -0.5
    with torch.random.fork_rng():
        torch.manual_seed(1)
        tokens = {t.token_id for t in sample(logits, [SamplingParams(temperature=1.0)] * 64, [None] * 64)}
    assert tokens == {47, 49}


def test_sampling_is_chunked_on_cpu_with_the_same_tokens(monkeypatch):
    """One row a chunk gives the tokens and logprobs of one chunk for all rows (penalties, greedy rows
    and logprobs among them)."""
    vocab = 200
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=2),
              SamplingParams(temperature=1.3, top_k=30, top_p=0.9, min_p=0.02, logprobs=0),
              SamplingParams(temperature=0.8, frequency_penalty=0.5), SamplingParams(temperature=0.0, logprobs=4)]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5)) * 3

    def run() -> list[tuple]:
        rows = [SamplingRow(str(i), p, torch.Generator().manual_seed(i), [1, 2, 3], [4, 4, 5])
                for i, p in enumerate(params)]
        out = Sampler(vocab, torch.device("cpu")).sample(logits, rows)
        return [(t.token_id, None if t.logprobs is None else [(k, float(v), v.rank) for k, v in t.logprobs.items()])
                for t in out]

    whole = run()
    monkeypatch.setattr(random_draw, "CHUNK_BYTES", 4 * vocab)
    assert random_draw.chunk_rows(len(params), vocab, torch.device("cpu")) == 1
    assert run() == whole
    assert [entry is None for _, entry in whole] == [False, False, True, False]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_draws_follow_the_target_distribution(case):
    """The same code on CUDA (full-sort top-p, one chunk): the target distribution."""
    device = torch.device("cuda")
    logits, params = logits_under_test(), CASES[case]
    batch = logits.to(device).expand(DRAWS, -1).contiguous()
    torch.cuda.manual_seed(0)
    tokens = [t.token_id for t in sample(batch, [params] * DRAWS, [None] * DRAWS)]
    statistic, critical = chi_square(torch.bincount(torch.tensor(tokens), minlength=VOCAB), target(logits, params))
    assert statistic < critical, (case, statistic, critical)


@pytest.mark.gpu
def test_cuda_greedy_and_seeded_draws_match_the_cpu_over_the_full_vocabulary():
    """248,320 tokens: greedy rows give the CPU's argmax on CUDA; seeded CUDA rows equal the reference
    run on CUDA with generators of the same seeds (the reference's own draws)."""
    device = torch.device("cuda")
    vocab = 248_320
    params = [SamplingParams(temperature=0.0), CASES["temperature"], CASES["top_p"], CASES["combined"]]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(6)) * 3
    cpu = sample(logits, params, [None] * len(params))
    cuda = sample(logits.to(device), params,
                  [None if p.greedy else torch.Generator(device=device).manual_seed(i) for i, p in enumerate(params)])
    assert cuda[0].token_id == cpu[0].token_id == int(logits[0].argmax())
    spec = reference_sample(logits.to(device), [
        SamplingRow(str(i), p, None if p.greedy else torch.Generator(device=device).manual_seed(i))
        for i, p in enumerate(params)])
    assert [t.token_id for t in cuda] == [t.token_id for t in spec]
