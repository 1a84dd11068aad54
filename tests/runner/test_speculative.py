"""Rejection sampling of speculative decoding (runner/speculative.py) keeps the target distribution:
every emitted token is distributed as plain sampling would draw it, whatever the drafts (chi-square
goodness of fit, seeded, 1e-4 level)."""

from __future__ import annotations

import torch

from forkpoint.runner.speculative import MTPDrafter

# chi-square quantiles at 1 - 1e-4 by degrees of freedom (scipy.stats.chi2.ppf(1 - 1e-4, df))
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 5: 25.74}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_every_emitted_token_follows_the_target_distribution():
    probs = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],   # position of draft 1 (= token 2)
                          [0.05, 0.30, 0.05, 0.30, 0.10, 0.20],   # position of draft 2 (= token 1)
                          [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]])  # the bonus position
    drafts = (2, 1)
    generator = torch.Generator().manual_seed(0)
    trials = 12000
    first = torch.zeros(6)
    second = torch.zeros(6)  # given the first draft was accepted
    third = torch.zeros(6)  # given both were accepted
    lengths = torch.zeros(3)
    for _ in range(trials):
        chosen = MTPDrafter._rejection_sample(probs, drafts, generator)
        lengths[len(chosen) - 1] += 1
        first[chosen[0]] += 1
        if len(chosen) > 1:
            second[chosen[1]] += 1
        if len(chosen) > 2:
            third[chosen[2]] += 1
        assert chosen[:-1] == list(drafts[: len(chosen) - 1])  # accepted tokens are drafts, in order
    assert chi_square(first, probs[0]) < CHI2_CRITICAL[5]
    assert chi_square(second, probs[1]) < CHI2_CRITICAL[5]
    assert chi_square(third, probs[2]) < CHI2_CRITICAL[5]
    # acceptance: the first draft with probability p0(2) = 0.15, then the second with p1(1) = 0.30
    expected_lengths = torch.tensor([0.85, 0.15 * 0.70, 0.15 * 0.30])
    assert chi_square(lengths, expected_lengths) < CHI2_CRITICAL[2]


def test_a_draft_outside_the_filtered_support_is_always_rejected():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        chosen = MTPDrafter._rejection_sample(probs, (3,), generator)
        assert len(chosen) == 1
        counts[chosen[0]] += 1
    assert counts[2:].sum() == 0
    assert chi_square(counts[:2], probs[0, :2]) < CHI2_CRITICAL[1]
