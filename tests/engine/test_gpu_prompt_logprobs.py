"""Prompt scoring in bounded chunks on CUDA (skipped without): at most `prompt_score_rows` logit rows
per step, and the chunked scores equal the one-chunk ones (float32, the tiny MoE model)."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)


def test_chunked_scores_on_cuda_equal_the_one_chunk_ones(moe_model):
    directory, _ = moe_model
    prompts = [{"prompt_token_ids": [(7 * i + j) % 150 + 2 for i in range(300)]} for j in range(2)]
    kwargs = dict(device="cuda", dtype="float32", enable_checkpoints=False, enforce_eager=True)
    llm = LLM(str(directory), prompt_score_bytes=1, **kwargs)
    execute, rows = llm.engine.runner.execute, []

    def spy(plan, *args):
        rows.append(sum(s.prompt_logit_rows for s in plan.segments))
        return execute(plan, *args)

    llm.engine.runner.execute = spy
    chunked = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert max(rows) == 64 and sum(rows) == 2 * 299
    whole = LLM(str(directory), **kwargs).generate(prompts, PARAMS, use_tqdm=False)
    for ours, theirs in zip(chunked, whole):
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-4 for t in a)
