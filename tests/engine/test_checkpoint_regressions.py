"""Deterministic reproductions of scheduling corner cases that once gave wrong outputs (each found by
the property test in test_checkpoint_properties.py), checked against the no-checkpoint run."""

from __future__ import annotations

import dataclasses

import torch

from forkpoint import LLM, SamplingParams
from tests.tiny_models import words

MARK = "<|mamba_checkpoint|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
ANCHOR = torch.randint(0, 150, (12,), generator=torch.Generator().manual_seed(12)).tolist()


def record_plans(llm: LLM) -> list:
    """Every StepPlan the engine's scheduler hands out from now on."""
    scheduler = llm.engine.scheduler
    schedule, plans = scheduler.schedule, []

    def recording(*args, **kwargs):
        step = schedule(*args, **kwargs)
        plans.append(step.plan)
        return step

    scheduler.schedule = recording
    return plans


def has_chained_copy(plans) -> bool:
    """Some step copies from a block that an earlier copy of the same step writes."""
    return any(later.src_block == earlier.dst_block
               for plan in plans for i, earlier in enumerate(plan.kv_copies) for later in plan.kv_copies[i + 1:])


def assert_equal_to_no_checkpoint_run(model_dir, outs) -> None:
    plain = LLM(str(model_dir), enable_checkpoints=False, num_kv_blocks=32)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    for out, ref in zip(outs, refs):
        expected = ref.outputs[0]
        for completion in out.outputs:
            assert completion.token_ids == expected.token_ids, out.request_id
            for ours, theirs in zip(completion.logprobs, expected.logprobs):
                assert ours.keys() == theirs.keys()
                assert all(abs(ours[t] - theirs[t]) <= 1e-5 for t in ours)


def resume_inside_a_block(model_dir) -> LLM:
    """An engine holding a ready 3-token checkpoint (block_size 16: it ends inside block 0)."""
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=16, max_num_batched_tokens=64)
    llm.generate(f"{words(*ANCHOR[:3])} {MARK} {words(*ANCHOR[3:], 7)}", GREEDY, use_tqdm=False)
    assert llm.metrics()["checkpoints_created"] == 1
    return llm


def test_n2_siblings_of_a_prompt_that_resumes_inside_the_block(model_dir):
    """Sibling #0 resumes from the 3-token checkpoint (copy 1: its block's first 3 KV slots) and
    writes the siblings' checkpoint at 13, in the same block; sibling #1 shares it in the same step
    (copy 2: 13 slots of #0's block). Copy 2 must see copy 1's slots, not what the block held before."""
    llm = resume_inside_a_block(model_dir)
    plans = record_plans(llm)
    out = llm.generate(f"{words(*ANCHOR)} {words(40, 41)}", dataclasses.replace(GREEDY, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.num_cached_tokens == 13
    assert has_chained_copy(plans)
    assert_equal_to_no_checkpoint_run(model_dir, [out])
    llm.engine.check_integrity()


def test_same_step_consumer_of_a_producer_that_resumes_inside_the_block(model_dir):
    """The same chain with markers: a producer resumes from the 3-token checkpoint and writes one at 10
    (same block); a request arriving with it shares the 10-token prefix in the same step."""
    llm = resume_inside_a_block(model_dir)
    plans = record_plans(llm)
    prompts = [f"{words(*ANCHOR[:10])} {MARK} {words(*ANCHOR[10:], 50)}", f"{words(*ANCHOR[:10])} {words(60, 61)}"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [3, 10]
    assert has_chained_copy(plans)
    assert_equal_to_no_checkpoint_run(model_dir, outs)
    llm.engine.check_integrity()
