"""A step that runs out of CUDA memory is retried in smaller steps (engine/memory_retry.py), on CUDA
(skipped without): a real `torch.OutOfMemoryError` from the CUDA caching allocator, raised inside
the forward of every step over 64 tokens, fails no request, and the outputs equal a fault-free run
(float32, the tiny MoE model); with CUDA graphs and asynchronous scheduling, an injected one at
any step does the same."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from tests.engine.test_memory_retry import OutOfMemoryRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 150 + 2 for i in range(length)]}
           for j, length in enumerate([300, 12, 20, 9])]


def _same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-3 for t in x)


def test_a_real_cuda_out_of_memory_is_retried_smaller(moe_model):
    directory, _ = moe_model
    kwargs = dict(device="cuda", dtype="float32", enforce_eager=True, max_num_batched_tokens=512)
    expected = LLM(str(directory), **kwargs).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(directory), **kwargs)
    refused = []

    def allocate_too_much(module, inputs):
        if inputs[0].shape[0] > 64:  # hidden states [T, H] of a step over 64 tokens
            refused.append(inputs[0].shape[0])
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: the allocator raises

    remove = llm.engine.runner.model.model.layers[1].mlp.register_forward_pre_hook(allocate_too_much).remove
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        remove()
    assert refused and llm.metrics()["steps_retried_for_memory"] >= 1
    assert llm.metrics()["requests_failed"] == 0
    _same(outputs, expected)
    llm.engine.check_integrity()
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), expected)  # the caps were lifted, the engine serves on


@pytest.mark.parametrize("fault_at", [0, 1, 3, 5])
def test_an_injected_out_of_memory_with_graphs_and_async_scheduling(moe_model, fault_at):
    directory, _ = moe_model
    kwargs = dict(device="cuda", dtype="float32", async_scheduling=True, max_num_batched_tokens=512)
    expected = LLM(str(directory), **kwargs).generate(PROMPTS[1:], PARAMS, use_tqdm=False)
    llm = LLM(str(directory), **kwargs)
    OutOfMemoryRunner(llm.engine, lambda call, plan: call == fault_at)
    outputs = llm.generate(PROMPTS[1:], PARAMS, use_tqdm=False)
    assert llm.metrics()["steps_retried_for_memory"] == 1 and llm.metrics()["requests_failed"] == 0
    _same(outputs, expected)
    llm.engine.check_integrity()
