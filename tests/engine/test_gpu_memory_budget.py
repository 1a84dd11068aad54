"""One memory budget and the default host tier on CUDA (skipped without): checkpoint rows come from the
device budget, the host tier is on without being asked for (sized from the machine), and sessions that
spill to it and come back produce the outputs of an engine without checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.sizing import MAX_CHECKPOINTS_PER_REQUEST_ROW, default_host_tier_bytes, physical_memory_bytes
from tests.helpers import assert_same_outputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)


def test_default_engine_sizes_checkpoints_from_the_budget_and_turns_the_host_tier_on(moe_model):
    llm = LLM(str(moe_model[0]), device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=8)
    engine = llm.engine
    # a tiny model's budget would give millions of rows: the per-request-row bound applies
    assert engine.state_pool.checkpoints.count == MAX_CHECKPOINTS_PER_REQUEST_ROW * 8
    expected = default_host_tier_bytes(physical_memory_bytes(), on_cuda=True)
    host = engine.registry.host
    assert (host.capacity_bytes if host is not None else 0) == expected
    print(f"GPU_MEMORY_BUDGET host tier {expected / 2**30:.1f} GiB; {engine.block_pool.num_blocks} KV blocks")


def test_sessions_spilling_to_the_default_host_tier_equal_the_plain_run(moe_model):
    """4 completion sessions x 3 turns, 2 device checkpoint rows: turn ends spill to the host tier
    (default size) and come back; every output equals the engine's without checkpoints."""
    if default_host_tier_bytes(physical_memory_bytes(), on_cuda=True) == 0:
        pytest.skip("this machine's memory gives no default host tier")
    generator = torch.Generator().manual_seed(5)
    prompts = [[10 + s] + torch.randint(0, 150, (47,), generator=generator).tolist() for s in range(4)]
    llm = LLM(str(moe_model[0]), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=256,
              checkpoint_pool_size=2)
    plain = LLM(str(moe_model[0]), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=256,
                enable_checkpoints=False)
    for _ in range(3):
        for session, prompt in enumerate(prompts):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
            assert_same_outputs(out, plain.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False))
            llm.engine.check_integrity()
            prompts[session] = prompt + list(out[0].outputs[0].token_ids) + torch.randint(
                0, 150, (8,), generator=generator).tolist()
    metrics = llm.metrics()
    assert metrics["checkpoints_spilled"] > 0 and metrics["checkpoints_restored"] > 0
