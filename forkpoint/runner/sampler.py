"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Log-probabilities are those of the model's unmodified distribution (as vLLM's default), for the
sampled token and the top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forkpoint.outputs import Logprob
from forkpoint.runner.logits_processors import ProcessorRow, apply_logits_processors
from forkpoint.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
           processors: Sequence[ProcessorRow | None] | None = None) -> list[SampledToken]:
    """logits: [R, vocab] float32; one SamplingParams and generator per row; histories[row] =
    (prompt ids, output ids so far), needed only by rows with penalties; processors[row]: the
    row's logits-processor state and output ids (runner/logits_processors.py), or None.

    Log-probabilities of all rows that ask for them come from one log_softmax and one top-k over
    those rows, and reach the host with the chosen ids: a fixed number of device-to-host copies
    per step, whatever R is."""
    if logits.shape[0] == 0:
        return []
    raw = logits
    if processors is not None and any(row is not None for row in processors):
        logits = logits.clone()
        apply_logits_processors(logits, processors)
    penalised = [row for row, p in enumerate(params) if p.has_penalties]
    if penalised:
        if histories is None:
            raise ValueError("penalties need the token histories of their rows")
        logits = logits.clone()
        for row in penalised:
            logits[row] = apply_penalties(logits[row], params[row], *histories[row])
    chosen = logits.argmax(dim=-1)
    for row, p in enumerate(params):
        if not p.greedy:
            chosen[row] = _sample_row(logits[row], p, generators[row])
    logits = raw  # log-probabilities are those of the unmodified distribution
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return [SampledToken(token_id, None) for token_id in chosen.tolist()]
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
    top_k = max(params[row].logprobs for row in rows)
    top_values, top_ids = torch.topk(logprobs, top_k, dim=-1)
    chosen_values = logprobs.gather(1, chosen.index_select(0, index)[:, None])
    chosen_ranks = (logprobs > chosen_values).sum(dim=-1) + 1
    chosen_host = chosen.tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_values, chosen_ranks = chosen_values[:, 0].tolist(), chosen_ranks.tolist()
    entries: dict[int, dict[int, Logprob]] = {}
    for i, row in enumerate(rows):
        k = params[row].logprobs
        entry = {token: Logprob(value, rank + 1) for rank, (token, value) in
                 enumerate(zip(top_ids[i][:k], top_values[i][:k]))}
        entry[chosen_host[row]] = Logprob(chosen_values[i], chosen_ranks[i])
        entries[row] = entry
    return [SampledToken(token_id, entries.get(row)) for row, token_id in enumerate(chosen_host)]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """logits: [vocab] -> penalised copy (vLLM's presence, frequency and repetition penalties)."""
    vocab = logits.shape[0]
    out = logits.clone()
    output = torch.tensor([t for t in output_ids if t < vocab], dtype=torch.long, device=logits.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([t for t in prompt_ids if t < vocab], dtype=torch.long, device=logits.device)
        seen = torch.unique(torch.cat([seen, output]))
        values = out[seen]
        out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(output, minlength=vocab).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


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
