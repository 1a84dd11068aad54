"""The per-step ForwardBatch layout: decodes first, then one packed call per phase."""

from __future__ import annotations

import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.state_pool import ZERO_SLOT
from forkpoint.runner.model_runner import build_forward_batch
from forkpoint.runner.sampler import sample

MARK = "<|mamba_checkpoint|>"


def test_same_step_producer_and_consumers_form_two_phases(moe_model):
    llm = LLM(str(moe_model[0]), num_kv_blocks=64, block_size=8)
    engine = llm.engine
    anchor = " ".join(f"w{i}" for i in range(13))  # 13 tokens: the shared last block is partial
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("p", f"{anchor} {MARK} w20 w21", params)
    engine.add_request("c1", f"{anchor} {MARK} w22", params)
    engine.add_request("c2", f"{anchor} w23 w24 w25", params)
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, sampled = build_forward_batch(plan, 8, torch.device("cpu"))

    assert batch.decode is None and len(batch.phases) == 2
    first, second = batch.phases
    checkpoint = step.written[0][0]
    assert first.cu_seqlens_host == (0, 13) and first.initial_slots.tolist() == [ZERO_SLOT]
    assert first.dest_slots.tolist() == [checkpoint.slot]  # the prefix writes only the checkpoint row
    assert second.cu_seqlens_host == (0, 2, 3, 6)  # producer tail, then both consumers
    assert second.initial_slots.tolist() == [checkpoint.slot] * 3
    assert (first.token_start, first.token_end, second.token_start, second.token_end) == (0, 13, 13, 19)
    # every new token's KV slot lies in its own sequence's block table
    for row, segment in enumerate(plan.ordered()):
        lo = batch.attention.cu_seqlens_q_host[row]
        for offset, position in enumerate(range(segment.start, segment.end)):
            block = segment.block_table[position // 8]
            assert batch.attention.slot_mapping[lo + offset] == block * 8 + position % 8
    # consumers copy the 5 prefix tokens of the shared partial block into their own block
    assert len(plan.kv_copies) == 2 and all(c.num_tokens == 5 for c in plan.kv_copies)
    assert batch.attention.cow_src.numel() == 10
    assert batch.logits_indices.tolist() == [14, 15, 18] and len(sampled) == 3

    logits = engine.runner.model(batch, engine.runner.caches)
    engine.scheduler.commit(step)
    assert checkpoint.ready and llm.metrics()["checkpoints_created"] == 1
    requests = {r.request_id: r for r in step.requests}
    tokens = sample(logits, [requests[s.request_id].params for s in sampled], [None] * 3)
    for segment, token in zip(sampled, tokens):
        engine._append_token(requests[segment.request_id], token.token_id, token.logprobs, 0.0)
    # the next step is pure decode: one token per sequence, from and to the private slots
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = build_forward_batch(plan, 8, torch.device("cpu"))
    assert batch.phases == () and batch.decode.num_tokens == 3
    assert sorted(batch.decode.slots.tolist()) == sorted(r.slot for r in step.requests)
    for request_id in ("p", "c1", "c2"):
        engine.abort_request(request_id)
    engine.check_integrity()
