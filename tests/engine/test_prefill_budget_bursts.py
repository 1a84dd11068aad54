"""A burst of short prompts from one client beside another client's streams (issue 27, engine/prefill_budget.py:
SHORT_REPEAT_BUDGETS, SHORT_SEQUENCE_TOKENS; engine/fair_order.py): in a step that decodes, a client's first
short prefill runs whole and its others, each counted with its sequence's cost, take at most the repeat room;
the streams decode every step; their client's next request is admitted ahead of the burst's queue; the burst
is served in the steps its cost needs; outputs are those of steps with no budget."""

from __future__ import annotations

import math

from forkpoint import SamplingParams
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.engine.prefill_budget import short_cost, short_repeat_room, short_room
from forkpoint.engine.request import Request
from tests.engine.test_prefill_budget import _config, _Run
from tests.engine.test_prefill_budget_short import engine_with_streams
from tests.helpers import assert_same_outputs, finish

B = 32  # _config's max_prefill_tokens_with_decodes
BURST, BURST_TOKENS = 80, 10  # 80 prompts of 10 tokens: 800 tokens, 1,680 with their sequences' cost


def _request(request_id: str, prompt_len: int, tenant: str, max_tokens: int) -> Request:
    prompt = [(7 * i + 3 * len(request_id) + sum(map(ord, request_id))) % 100 + 1 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, request_id, 0, prompt, (), params, 0.0, PrefixHasher(prompt, 4), None, tenant=tenant)


def _burst_beside_streams() -> tuple[_Run, list[Request], list[Request], Request]:
    """Client a's 4 streams decode; client b's 80 short prompts arrive, then a's next request (a stream's
    next turn); run until the burst is served."""
    run = _Run(_config(max_num_batched_tokens=2048, max_num_seqs=128, num_kv_blocks=1024))
    streams = [_request(f"a{i}", 3, "a", max_tokens=200) for i in range(4)]
    for request in streams:
        run.add(request)
    run.step()  # the streams' prompts; from now on they decode
    burst = [_request(f"b{i}", BURST_TOKENS, "b", max_tokens=1) for i in range(BURST)]
    for request in burst:
        run.add(request)
    turn = _request("a-next", 12, "a", max_tokens=4)
    run.add(turn)
    while not all(r.is_finished for r in burst):
        run.step()
        assert len(run.steps) < 100, "the burst was not served"
    return run, streams, burst, turn


def test_a_clients_burst_takes_one_whole_prompt_and_the_repeat_room_a_step_and_the_streams_decode_every_step():
    run, streams, burst, turn = _burst_beside_streams()
    for step in run.steps[1:]:
        assert all(step["tokens"].get(s.request_id) == 1 for s in streams), step  # every stream, every step
        costs = [short_cost(n) for rid, n in step["tokens"].items() if rid.startswith("b")]
        # b's first prompt of the step whole, the others within the repeat room (each with its sequence's cost)
        assert sum(costs[1:]) <= short_repeat_room(B), step
        assert sum(costs) <= short_room(B), step
    # served in the steps its cost needs, not more
    per_step = 1 + short_repeat_room(B) // short_cost(BURST_TOKENS)
    assert len(run.steps) - 1 <= math.ceil(BURST / per_step) + 1, len(run.steps)
    run.drain()
    run.check_outputs()


def test_a_clients_restarted_streams_come_back_in_one_step_beside_anothers_burst():
    """a's 8 streams end in one step while b's 60 prompts wait; a's 8 next requests (9 tokens each)
    arrive after them and run in the next step: the repeat room is a client's own, so b's queue
    (ranked as early: no b sequence runs) does not take it. Shared by the clients, it took 3 steps."""
    run = _Run(_config(max_num_batched_tokens=2048, max_num_seqs=128, num_kv_blocks=2048,
                       max_prefill_tokens_with_decodes=64))  # the CPU server's B: 7 x 20 fit its repeat room
    streams = [_request(f"a{i}", 9, "a", max_tokens=3) for i in range(8)]
    for request in streams:
        run.add(request)
    run.step()
    for request in [_request(f"b{i}", 20, "b", max_tokens=1) for i in range(60)]:
        run.add(request)
    while not all(s.is_finished for s in streams):
        run.step()
    restarts = [_request(f"{s.request_id}-next", 9, "a", max_tokens=3) for s in streams]
    for request in restarts:
        run.add(request)
    run.step()
    assert [run.steps[-1]["tokens"].get(r.request_id) for r in restarts] == [9] * 8, run.steps[-1]
    assert sum(1 for rid in run.steps[-1]["tokens"] if rid.startswith("b")) >= 1  # the burst goes on beside them
    run.drain()
    run.check_outputs()


def test_first_short_prompts_of_different_clients_share_the_whole_stack():
    """Chat turns of different sessions (no `user`: each prompt its own client) beside decodes: each
    is its client's first, so they stack up to the short room, not the repeat room."""
    run = _Run(_config(max_num_batched_tokens=2048))
    run.add(_request("s", 3, "a", max_tokens=20))
    run.step()
    turns = [_request(f"t{i}", 100, "", max_tokens=2) for i in range(4)]  # 4 x 111 > the repeat room
    for request in turns:
        run.add(request)
    run.step()
    assert [run.steps[-1]["tokens"].get(t.request_id) for t in turns] == [100] * 4
    assert 4 * short_cost(100) > short_repeat_room(B)
    run.drain()
    run.check_outputs()


def test_the_streams_client_next_request_is_admitted_ahead_of_the_burst():
    """a's request arrived after b's 80 prompts; a has 4 running sequences and b none, so by rank a's
    request goes after b's 4th: in the first step (first come, first served put it behind all 80)."""
    run, _, _, turn = _burst_beside_streams()
    assert run.steps[1]["tokens"].get(turn.request_id) == len(turn.prompt_token_ids), run.steps[1]
    run.drain()
    run.check_outputs()


def test_one_short_prompt_past_the_stack_still_runs_whole():
    """A prompt of 16 x B tokens (short: the most that is) beside decodes runs whole in one step, alone."""
    run = _Run(_config(max_num_batched_tokens=2048))
    run.add(_request("s", 3, "a", max_tokens=20))
    run.step()
    large = _request("large", 16 * B, "b", max_tokens=2)
    small = _request("small", 5, "b", max_tokens=2)
    run.add(large)
    run.add(small)
    run.step()
    assert run.steps[-1]["tokens"].get("large") == 16 * B and "small" not in run.steps[-1]["tokens"]
    assert short_cost(16 * B) > short_room(B)  # past the stack: only the first of a step may do that
    run.step()
    assert run.steps[-1]["tokens"].get("small") == 5
    run.drain()
    run.check_outputs()


def test_outputs_of_a_burst_equal_steps_without_the_budget(model_dir):
    """CPU float32, greedy with logprobs, tiny model: 6 short prompts of client b arriving together
    while client a's two streams decode, with B = 8 (one whole, then the repeat room of 32: one more a
    step), give
    the tokens and logprobs of steps with no prefill budget (all six in one step)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)

    def run(budget: int | None) -> tuple[list, int]:
        engine = engine_with_streams(model_dir, budget, 512, params)
        for i in range(6):
            engine.add_request(f"p{i:02d}", {"prompt_token_ids": [(29 * j + 5 * i) % 150 + 5 for j in range(10)]},
                               params, stream=False, tenant="b")
        engine.step()
        admitted = sum(bool(engine.sequences(f"p{i:02d}")[0].num_computed_tokens) for i in range(6))
        return finish(engine), admitted

    capped, admitted = run(8)
    assert admitted == 1 + short_repeat_room(8) // short_cost(10)
    whole, admitted = run(None)
    assert admitted == 6
    assert_same_outputs(capped, whole)
