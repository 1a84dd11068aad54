"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Log-probabilities are those of the model's unmodified distribution (as vLLM's default), for the
sampled token and the top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forkpoint.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[SampledToken]:
    """logits: [R, vocab] float32; one SamplingParams and generator per row."""
    if logits.shape[0] == 0:
        return []
    greedy_ids = logits.argmax(dim=-1)
    chosen = greedy_ids.clone()
    for row, p in enumerate(params):
        if not p.greedy:
            chosen[row] = _sample_row(logits[row], p, generators[row])
    want_logprobs = [p.logprobs is not None for p in params]
    logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    chosen_host = chosen.tolist()
    results = []
    for row, p in enumerate(params):
        entry = None
        if logprobs is not None and p.logprobs is not None:
            values, ids = torch.topk(logprobs[row], p.logprobs) if p.logprobs else (logprobs[row][:0], chosen[:0])
            entry = dict(zip(ids.tolist(), values.tolist()))
            entry[chosen_host[row]] = float(logprobs[row, chosen_host[row]])
        results.append(SampledToken(chosen_host[row], entry))
    return results


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [vocab] -> scalar token id tensor."""
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
