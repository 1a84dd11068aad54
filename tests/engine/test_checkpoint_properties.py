"""Property test: whatever the arrival order, token budget, pool sizes, aborts and marker layout,
every completed request equals its no-checkpoint run and every pool is consistent and drained.
A step may also fail (the runner raises): the requests in it end, the others go on unharmed.
The same policy without a model, at many more examples: tests/engine/test_scheduler_properties.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkpoint import LLM, SamplingParams
from forkpoint.engine.engine import StepFailed
from tests.tiny_models import words

MARK = "<|mamba_checkpoint|>"
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
ANCHORS = [torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17, 30)]


@pytest.fixture(scope="module")
def reference(moe_model):
    """Greedy outputs of the no-checkpoint engine, memoised per prompt."""
    llm = LLM(str(moe_model[0]), enable_checkpoints=False, num_kv_blocks=64)
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(token_ids: list[int]) -> list[int]:
        key = tuple(token_ids)
        if key not in cache:
            out = llm.generate({"prompt_token_ids": token_ids}, PARAMS, use_tqdm=False)[0]
            cache[key] = out.outputs[0].token_ids
        return cache[key]

    return run


request_strategy = st.fixed_dictionaries({
    "anchor": st.integers(0, len(ANCHORS) - 1),
    "inner_marker": st.integers(0, 8),  # 0: none, else a nested marker that many tokens in
    "outer_marker": st.booleans(),
    "suffix": st.lists(st.integers(0, 149), min_size=1, max_size=6),
    "arrival": st.integers(0, 6),
    "abort_at": st.one_of(st.none(), st.integers(0, 12)),
    "n": st.integers(1, 2),
})


def render(spec: dict) -> str:
    anchor = ANCHORS[spec["anchor"]]
    parts = []
    inner = spec["inner_marker"]
    if inner:
        parts += [words(*anchor[:inner]), MARK, words(*anchor[inner:])]
    else:
        parts.append(words(*anchor))
    if spec["outer_marker"]:
        parts.append(MARK)
    parts.append(words(*spec["suffix"]))
    return " ".join(parts)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=7),
    budget=st.integers(6, 64),
    chunk_cap=st.one_of(st.none(), st.integers(4, 20)),
    block_size=st.sampled_from([4, 8, 16]),
    spare_blocks=st.integers(1, 30),
    checkpoint_slots=st.integers(1, 4),
    fault_at=st.one_of(st.none(), st.integers(0, 10)),
    auto_min_tokens=st.sampled_from([4, 12, 10_000]),  # 10_000: automatic checkpoints never placed
)
def test_outputs_always_equal_the_no_checkpoint_run(moe_model, reference, requests, budget, chunk_cap, block_size,
                                                    spare_blocks, checkpoint_slots, fault_at, auto_min_tokens):
    longest = max(len(ANCHORS[r["anchor"]]) + len(r["suffix"]) for r in requests) + PARAMS.max_tokens + 1
    llm = LLM(str(moe_model[0]), max_num_batched_tokens=budget, long_prefill_token_threshold=chunk_cap,
              block_size=block_size, num_kv_blocks=-(-longest // block_size) + spare_blocks,
              checkpoint_pool_size=checkpoint_slots, max_num_seqs=4, auto_checkpoint_min_tokens=auto_min_tokens)
    engine = llm.engine
    execute, calls = engine.runner.execute, []

    def faulty_execute(plan):
        calls.append(plan)
        if len(calls) - 1 == fault_at:
            raise RuntimeError("injected fault")
        return execute(plan)

    engine.runner.execute = faulty_execute
    finished = {}
    aborted = set()
    for step in range(400):
        for index, spec in enumerate(requests):
            if spec["arrival"] == step:
                engine.add_request(f"r{index}", render(spec), dataclasses.replace(PARAMS, n=spec["n"]))
            if spec["abort_at"] is not None and spec["abort_at"] == step and f"r{index}" not in finished:
                engine.abort_request(f"r{index}")
                aborted.add(f"r{index}")
        try:
            outputs = engine.step()
        except StepFailed as failure:
            assert failure.request_ids and isinstance(failure.cause, RuntimeError)
            aborted.update(failure.request_ids)
            outputs = failure.outputs
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
        if step > 12 and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("engine did not drain")
    for request_id, output in finished.items():
        for completion in output.outputs:  # n = 2 siblings share the prompt through a checkpoint
            assert completion.token_ids == reference(output.prompt_token_ids), request_id
    assert len(finished) + len(aborted - set(finished)) == len(requests)
    metrics = llm.metrics()
    assert metrics["state_slots_used"] == 0 and metrics["checkpoints_pending"] == 0
    held = {b for c in engine.registry for b in c.blocks}
    assert metrics["kv_blocks_used"] == len(held)
