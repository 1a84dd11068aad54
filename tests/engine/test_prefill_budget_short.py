"""Short prefills run whole beside decodes (engine/prefill_budget.py, SHORT_PREFILL_BUDGETS): the budget of
a step that decodes counts long prefills only, so a chat turn's new text (or a first turn with its document)
is not cut into budget-sized chunks, while a long prompt still is."""

from __future__ import annotations

from forkpoint import LLM, SamplingParams
from forkpoint.engine.prefill_budget import SHORT_PREFILL_BUDGETS, PrefillRoom, is_capped_prefill, prefill_room
from tests.engine.test_prefill_budget import _config, _request, _Run
from tests.helpers import assert_same_outputs, finish

B = 32  # _config's max_prefill_tokens_with_decodes
SHORT = SHORT_PREFILL_BUDGETS * B


def test_a_prefill_is_long_by_what_its_admission_computes():
    assert is_capped_prefill(_request("long", SHORT + 1), 0, B, origin=0)
    assert not is_capped_prefill(_request("short", SHORT), 0, B, origin=0)
    cached = _request("turn", SHORT + 300, computed=300)  # a checkpoint supplied 300 tokens: SHORT left
    assert not is_capped_prefill(cached, 300, B, origin=300)
    assert not is_capped_prefill(_request("d", 5, computed=5, outputs=1), 5, B, origin=0)  # a decode


def test_the_room_counts_long_prefills_only():
    decoding = _request("d", 5, computed=5, outputs=1)
    long, short = _request("long", 4 * SHORT, computed=64), _request("short", 100, computed=16)
    room = prefill_room([decoding, short, long], [_request("w", 50)], budget=B, chunk_cap=8192, seq_room=8)
    assert room == PrefillRoom(B, 0)  # the long one is the first capped prefill; nothing long behind it


def test_a_short_prompt_beside_decodes_runs_whole_and_a_long_one_is_capped():
    run = _Run(_config())  # steps of 256 tokens, B = 32
    for i in range(4):
        run.add(_request(f"s{i}", 3, max_tokens=80))
    run.step()  # the streams' prompts, then they decode
    short = _request("short", SHORT - 24, max_tokens=2)  # 488 tokens: 2 steps of up to 252, not 16 of 32
    run.add(short)
    run.step()
    run.step()
    assert short.num_computed_tokens == SHORT - 24 and all(s["decodes"] >= 4 for s in run.steps[1:])
    long = _request("long", SHORT + 200, max_tokens=2)
    run.add(long)
    for _ in range(5):
        run.step()
        assert 0 < run.steps[-1]["tokens"]["long"] <= B  # capped, and progressing every step
    run.drain()
    run.check_outputs()


def test_short_prefills_stack_only_up_to_the_short_room_beside_decodes():
    """Five 300-token prompts (short: each runs whole) arrive together while streams decode: a step
    takes whole ones up to SHORT_PREFILL_BUDGETS x B tokens in all (512 here: one at a time, since
    two are 600), in arrival order, never one cut in two; with no decode they would all run in one
    step."""
    run = _Run(_config(max_num_batched_tokens=2048))  # B = 32, short room 512
    for i in range(4):
        run.add(_request(f"s{i}", 3, max_tokens=40))
    run.step()
    burst = [_request(f"b{i}", 300, max_tokens=2) for i in range(5)]
    for request in burst:
        run.add(request)
    for _ in range(5):
        run.step()
        step = run.steps[-1]
        assert step["decodes"] >= 4 and step["prefill"] <= SHORT, step
        assert [step["tokens"].get(r.request_id, 0) for r in burst].count(300) == 1, step
    assert [r.num_computed_tokens >= 300 for r in burst] == [True] * 5
    run.drain()
    run.check_outputs()


def test_a_short_prompt_as_large_as_the_room_runs_whole_beside_a_burst():
    """A prompt of exactly the short room after smaller ones took part of it waits one step and then
    runs whole (not cut), and the ones behind it are not admitted ahead of it."""
    run = _Run(_config(max_num_batched_tokens=2048))
    for i in range(2):
        run.add(_request(f"s{i}", 3, max_tokens=40))
    run.step()
    small, large, after = _request("small", 100, max_tokens=2), _request("large", SHORT, max_tokens=2), \
        _request("after", 50, max_tokens=2)
    for request in (small, large, after):
        run.add(request)
    run.step()
    assert run.steps[-1]["tokens"].get("small") == 100 and "large" not in run.steps[-1]["tokens"]
    assert "after" not in run.steps[-1]["tokens"]  # admission stops at the first that does not fit
    run.step()
    assert run.steps[-1]["tokens"].get("large") == SHORT
    run.drain()
    run.check_outputs()


def engine_with_streams(model_dir, budget: int | None, max_num_batched_tokens: int, params: SamplingParams):
    """A tiny-model engine (prefill budget beside decodes `budget`) whose two streams, s0 and s1, have
    taken their first step."""
    engine = LLM(str(model_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=max_num_batched_tokens,
                 max_prefill_tokens_with_decodes=budget).engine
    for i in range(2):
        engine.add_request(f"s{i}", f"stream {i} says", params, stream=False)
    engine.step()
    return engine


def test_outputs_with_the_short_room_equal_steps_without_the_budget(model_dir):
    """CPU float32, greedy with logprobs, tiny model: three 100-token prompts arriving together while
    two streams decode, with B = 8 (short room 128: one prompt a step), give the tokens and logprobs
    of steps with no prefill budget (all three in one step)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(budget: int | None) -> tuple[list, int]:
        engine = engine_with_streams(model_dir, budget, 512, params)
        for i in range(3):
            engine.add_request(f"p{i}", {"prompt_token_ids": [(31 * j + i) % 150 + 5 for j in range(100)]}, params,
                               stream=False)
        engine.step()
        admitted = sum(bool(engine.sequences(f"p{i}")[0].num_computed_tokens) for i in range(3))
        return finish(engine), admitted

    capped, admitted = run(8)
    assert admitted == 1  # one 100-token prompt in the step beside the streams
    whole, admitted = run(None)
    assert admitted == 3
    assert_same_outputs(capped, whole)
