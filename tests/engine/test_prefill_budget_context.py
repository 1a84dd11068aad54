"""A long prefill's chunk by its context position (engine/prefill_budget.py: `context_tokens`,
`context_cost`): in a step that decodes it shrinks to B / (1 + position / C), never below one token (one
scan chunk with checkpoint_exact), a step with no decode is not scaled, and the outputs do not change."""

from __future__ import annotations

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.config import SCAN_CHUNK_TOKENS
from forkpoint.engine.prefill_budget import SHORT_PREFILL_BUDGETS, context_cost, context_tokens
from tests.engine.test_prefill_budget import _config, _request, _Run
from tests.helpers import assert_same_outputs, finish

B = 32  # _config's max_prefill_tokens_with_decodes
LONG = SHORT_PREFILL_BUDGETS * B + 300  # a long prefill: counted against B


def test_the_chunk_shrinks_with_the_position_to_its_floor():
    assert context_tokens(64, 0, 1000, None) == 64
    assert context_tokens(64, 1000, 1000, None) == 32  # twice the cost a token: half the tokens
    assert context_tokens(64, 15000, 1000, None) == 4
    assert context_tokens(64, 10 ** 9, 1000, None) == 1  # never below one token
    assert context_tokens(128, 10 ** 9, 1000, SCAN_CHUNK_TOKENS) == SCAN_CHUNK_TOKENS  # exact mode: one scan chunk
    assert context_tokens(20, 10 ** 9, 1000, SCAN_CHUNK_TOKENS) == 20  # never above the room
    assert context_tokens(64, 5000, None, None) == 64  # no parity: no scaling
    assert context_cost(4, 15000, 1000) == 64 and context_cost(3, 500, 1000) == 5 and context_cost(7, 9, None) == 7


def _long_beside_a_stream(parity: int | None, length: int = LONG, **config) -> tuple[_Run, object]:
    run = _Run(_config(**config), attention_parity=parity)
    run.add(_request("stream", 3, max_tokens=400))
    run.step()  # the stream decodes from here on
    long = _request("long", length, max_tokens=2)
    run.add(long)
    return run, long


def test_a_long_prefill_takes_fewer_tokens_further_into_its_context():
    run, long = _long_beside_a_stream(parity=128)
    chunks = {}  # position -> tokens of the step
    while not long.is_finished and long.num_computed_tokens < LONG:
        position = long.num_computed_tokens
        run.step()
        chunks[position] = run.steps[-1]["tokens"]["long"]
        assert run.steps[-1]["decodes"] == 1 and chunks[position] >= 1
        assert context_cost(chunks[position], position, 128) <= B or chunks[position] == 1
    assert chunks[0] == B
    assert chunks[max(chunks)] < chunks[0] // 4  # past 4 C: under a quarter of B
    for position, tokens in chunks.items():
        assert tokens == max(1, min(B * 128 // (128 + position), LONG - position))
    run.drain()
    run.check_outputs()


def test_without_a_parity_the_chunks_stay_the_budget():
    run, long = _long_beside_a_stream(parity=None)
    while long.num_computed_tokens < LONG - B:
        run.step()
        assert run.steps[-1]["tokens"]["long"] == B


def test_exact_mode_keeps_one_scan_chunk_at_boundaries():
    length = SHORT_PREFILL_BUDGETS * 128 + 300
    run, long = _long_beside_a_stream(parity=16, length=length, checkpoint_exact=True, num_kv_blocks=1024,
                                      max_prefill_tokens_with_decodes=128, max_num_batched_tokens=512)
    seen = []
    while long.num_computed_tokens < length:
        run.step()
        seen.append(long.num_computed_tokens)
    assert seen[0] == 128 and seen[1] == 192  # 128 / (1 + 128 / 16) rounds up to the floor, one scan chunk
    assert all(p % SCAN_CHUNK_TOKENS == 0 for p in seen[:-1]) and seen[-1] == length
    run.drain()
    run.check_outputs()


def test_a_step_with_no_decode_is_not_scaled():
    run = _Run(_config(), attention_parity=16)
    long = _request("long", LONG, max_tokens=2)
    run.add(long)
    run.step()
    run.step()
    assert long.num_computed_tokens == 2 * 256  # the step's whole budget, at position 256 too


@pytest.fixture
def every_prefill_long(monkeypatch):
    monkeypatch.setattr("forkpoint.engine.prefill_budget.SHORT_PREFILL_BUDGETS", 0)


def test_outputs_equal_chunks_of_any_context(model_dir, every_prefill_long):
    """CPU float32, greedy, tiny model: streams beside a 150-token prompt whose chunks shrink from 16 to
    3 tokens by position (C = 32) give the tokens and logprobs of the prompt run whole."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": [(37 * i) % 150 + 5 for i in range(150)]}

    def run(budget: int) -> tuple[list, list[int]]:
        engine = LLM(str(model_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=256,
                     max_prefill_tokens_with_decodes=budget, attention_parity_tokens=32,
                     enable_checkpoints=False).engine
        for i in range(2):
            engine.add_request(f"s{i}", f"stream {i} says", params, stream=False)
        engine.step()
        engine.add_request("long", prompt, params, stream=False)
        long, progress = engine.sequences("long")[0], []
        while long.num_computed_tokens < 150:
            engine.step()
            progress.append(long.num_computed_tokens)
        return finish(engine), progress

    scaled, progress = run(16)
    assert progress[:3] == [16, 26, 34]  # 16, then 16 x 32 / (32 + 16) = 10, then 16 x 32 / 58 = 8
    whole, whole_progress = run(256)
    assert whole_progress == [150]
    assert_same_outputs(scaled, whole)
