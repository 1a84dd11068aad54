"""Prompt log-probabilities: how likely each prompt token was given the tokens before it (the
runner's scoring, runner/step_sampler.py; what a checkpoint keeps of them: step/result.py `PromptScores`)."""

from __future__ import annotations

import torch

from forkpoint.outputs import Logprob


def score_tokens(logits: torch.Tensor, next_tokens: torch.Tensor, k: int) -> list[dict[int, Logprob]]:
    """logits: [P, vocab] float32, row i scoring token next_tokens[i] ([P] long, same device).
    Returns per row {token: Logprob} with the actual token and the top k (ranks from 1), from one
    log_softmax, one top-k and one host copy per tensor."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits, dim=-1)
    actual = logprobs.gather(1, next_tokens[:, None])[:, 0]
    ranks = (logprobs > actual[:, None]).sum(dim=-1) + 1
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], next_tokens[:, None][:, :0])
    entries = []
    for token, value, rank, ids, values in zip(next_tokens.tolist(), actual.tolist(), ranks.tolist(),
                                               top_ids.tolist(), top_values.tolist()):
        entry = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, values))}
        entry[token] = Logprob(value, rank)
        entries.append(entry)
    return entries
