"""The prefill budget of a step that decodes (engine/prefill_budget.py): a long prompt's chunks stay
within it while streams decode, progress every step, leave room for prompts that arrive behind it,
take the whole step when nothing decodes, and change no output."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint import LLM, SamplingParams
from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import CPU_SERVE_PREFILL_TOKENS_WITH_DECODES, SCAN_CHUNK_TOKENS, EngineConfig
from forkpoint.engine.prefill_budget import DECODE_GRACE_S, PrefillRoom, is_prefill, prefill_room, running_floor
from forkpoint.engine.request import Request
from forkpoint.engine.scheduler import Scheduler
from forkpoint.server.engine_args import add_engine_args, engine_kwargs, server_engine_kwargs
from tests.engine.fake_executor import FakeExecutor, append_sampled, reference
from tests.helpers import assert_same_outputs


@pytest.fixture(autouse=True)
def every_prefill_long(monkeypatch):
    """The budget's mechanics, with every prefill long (none exempt as short: SHORT_PREFILL_BUDGETS 0);
    tests/engine/test_prefill_budget_short.py tests the exemption."""
    monkeypatch.setattr("forkpoint.engine.prefill_budget.SHORT_PREFILL_BUDGETS", 0)


def _request(request_id: str, prompt_len: int, max_tokens: int = 8, computed: int = 0,
             outputs: int = 0) -> Request:
    prompt = [(7 * i + len(request_id)) % 100 + 1 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, request_id, 0, prompt, (), params, 0.0, PrefixHasher(prompt, 4), None)
    request.output_token_ids = [1] * outputs
    request.num_computed_tokens = computed
    return request


# ------------------------------------------------------------------ the policy alone
def test_is_prefill_tells_prompt_and_recompute_from_a_decode():
    assert is_prefill(_request("a", 10), 0)
    assert is_prefill(_request("a", 10, outputs=1), 9)  # the prompt's last token
    assert not is_prefill(_request("a", 10, outputs=1), 10)  # the next token: a decode
    assert is_prefill(_request("a", 10, outputs=5), 10)  # outputs recomputed after a preemption


def test_no_decode_no_cap():
    running = [_request("long", 1000, computed=128)]
    assert prefill_room(running, [], budget=64, chunk_cap=8192, seq_room=8) is None


def test_a_decode_caps_the_step_and_holds_what_waiting_prompts_take():
    decoding = _request("d", 5, computed=5, outputs=1)  # its sampled token is next
    running = [decoding, _request("long", 1000, computed=128)]
    assert prefill_room(running, [], budget=64, chunk_cap=8192, seq_room=8) == PrefillRoom(64, 0)
    waiting = [_request("w1", 9), _request("w2", 5)]
    assert prefill_room(running, waiting, budget=64, chunk_cap=8192, seq_room=8) == PrefillRoom(64, 14)
    assert prefill_room(running, waiting, budget=64, chunk_cap=8192, seq_room=1) == PrefillRoom(64, 9)
    # a long waiting prompt holds at most the budget less the running prefills' floor (half)
    assert prefill_room(running, [_request("w", 500)], budget=64, chunk_cap=8192, seq_room=8) == PrefillRoom(64, 32)


def test_the_first_running_prefill_holds_what_the_running_prefills_after_it_take():
    decoding = _request("d", 5, computed=5, outputs=1)  # its sampled token is next
    long, short = _request("long", 1000, computed=128), _request("short", 20, computed=16)
    room = prefill_room([decoding, long, short], [_request("w", 6)], budget=64, chunk_cap=8192, seq_room=8)
    assert room == PrefillRoom(64, 4 + 6)
    room = prefill_room([short, long], [], budget=64, chunk_cap=8192, seq_room=8, recently_decoded=True)
    assert room == PrefillRoom(64, 32)  # the short one is first: it leaves the long one all but its floor


def test_the_running_floor_is_half_and_one_scan_chunk_in_exact_mode():
    assert running_floor(64, None) == 32
    assert running_floor(1, None) == 1
    assert running_floor(65, None) == 33
    assert running_floor(100, SCAN_CHUNK_TOKENS) == SCAN_CHUNK_TOKENS
    assert running_floor(64, SCAN_CHUNK_TOKENS) == 64  # nothing held: a shorter chunk could never end aligned
    with pytest.raises(ValueError, match="held"):
        PrefillRoom(64, 64)


def test_the_config_and_the_servers_default():
    assert EngineConfig(max_num_batched_tokens=4096).prefill_tokens_with_decodes() is None  # offline: no cap
    assert EngineConfig(max_prefill_tokens_with_decodes=300).prefill_tokens_with_decodes() == 300
    small_steps = EngineConfig(max_prefill_tokens_with_decodes=300, max_num_batched_tokens=32)
    assert small_steps.prefill_tokens_with_decodes() == 32
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=False)
    cpu, cuda = parser.parse_args(["--device", "cpu"]), parser.parse_args(["--device", "cuda"])
    assert server_engine_kwargs(cpu)["max_prefill_tokens_with_decodes"] == CPU_SERVE_PREFILL_TOKENS_WITH_DECODES
    assert server_engine_kwargs(cpu, replicas=True)["max_prefill_tokens_with_decodes"] == 64
    assert engine_kwargs(cpu)["max_prefill_tokens_with_decodes"] is None  # forkpoint generate / bench, LLM
    assert server_engine_kwargs(cuda)["max_prefill_tokens_with_decodes"] is None  # not measured on CUDA
    assert engine_kwargs(parser.parse_args(["--device", "cuda", "--max-prefill-tokens-with-decodes", "512"]))[
        "max_prefill_tokens_with_decodes"] == 512
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes must be >= 1"):
        EngineConfig(max_prefill_tokens_with_decodes=0)
    with pytest.raises(ValueError, match="checkpoint_exact needs max_prefill_tokens_with_decodes >= 64"):
        EngineConfig(checkpoint_exact=True, max_prefill_tokens_with_decodes=32)


# ------------------------------------------------------------------ the scheduler with a fake model
STEP_S = 0.05  # a step's time on the fake clock: the grace (1 s) spans 20 steps

class _Run:
    """The engine's loop around the scheduler with FakeExecutor as the model; per step, the prefill
    tokens it planned, whether it decoded, and each sequence's planned tokens. `attention_parity`: the
    scheduler's (None: chunks the same at every position)."""

    def __init__(self, config: EngineConfig, attention_parity: int | None = None) -> None:
        self.blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, config.checkpoint_pool_size)
        self.scheduler = Scheduler(config, self.blocks, self.states, None, vocab_size=1000,
                                   attention_parity=attention_parity)
        self.executor = FakeExecutor(config.block_size)
        self.requests: list[Request] = []
        self.steps: list[dict] = []  # {"prefill": tokens, "decodes": n, "tokens": {id: n}}
        self.now = 0.0  # the clock schedule() reads; each step takes STEP_S

    def add(self, request: Request) -> None:
        self.requests.append(request)
        self.scheduler.add(request)

    def step(self) -> None:
        step = self.scheduler.schedule(now=self.now)
        self.now += STEP_S
        tokens = {r.request_id: 0 for r in step.requests}
        starts = {r.request_id: r.num_computed_tokens for r in step.requests}
        for segment in step.plan.segments:
            tokens[segment.request_id] += segment.end - segment.start
        by_id = {r.request_id: r for r in step.requests}
        prefill = sum(n for rid, n in tokens.items() if is_prefill(by_id[rid], starts[rid]))
        self.steps.append({"prefill": prefill, "decodes": len(tokens) - sum(
            1 for rid in tokens if is_prefill(by_id[rid], starts[rid])), "tokens": tokens})
        sampled = self.executor.execute(step.plan)
        self.scheduler.commit(step)
        for request in append_sampled(step, sampled):
            if len(request.output_token_ids) >= request.params.max_tokens:
                self.scheduler.finish(request, "length")
        self.scheduler.check_integrity()
        self.states.check_integrity()

    def drain(self) -> None:
        for _ in range(2000):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def check_outputs(self) -> None:
        for request in self.requests:
            assert request.output_token_ids == reference(request.prompt_token_ids, request.params.max_tokens)
        assert self.blocks.num_used == 0 and self.states.requests.num_used == 0


def _config(**kwargs) -> EngineConfig:
    settings_ = dict(device="cpu", max_num_batched_tokens=256, max_num_seqs=16, block_size=4, num_kv_blocks=512,
                     checkpoint_pool_size=1, max_prefill_tokens_with_decodes=32)
    settings_.update(kwargs)
    return EngineConfig(**settings_)


def test_a_long_prompt_beside_decodes_takes_the_budget_and_progresses_every_step():
    run = _Run(_config())
    for i in range(4):
        run.add(_request(f"s{i}", 3, max_tokens=60))
    run.step()  # the streams' prompts, then they decode
    long = _request("long", 400, max_tokens=2)
    run.add(long)
    computed = []
    while long.num_computed_tokens < 400:
        run.step()
        computed.append(long.num_computed_tokens)
        assert run.steps[-1]["decodes"] == 4  # every stream has its token in every step
        assert run.steps[-1]["prefill"] <= 32
    assert computed == list(range(32, 400, 32)) + [400]  # 32 tokens each step, none skipped
    run.drain()
    run.check_outputs()


def test_with_no_decode_a_long_prompt_takes_the_whole_step():
    run = _Run(_config())
    long = _request("long", 600, max_tokens=2)
    run.add(long)
    run.step()
    assert long.num_computed_tokens == 256
    run.drain()
    run.check_outputs()


def _stream_beside_a_long_prompt() -> tuple[_Run, Request]:
    """One stream decoding, then an 800-token prompt admitted beside it (its first chunk planned)."""
    run = _Run(_config())
    run.add(_request("stream", 3, max_tokens=80))
    run.step()
    long = _request("long", 800, max_tokens=2)
    run.add(long)
    run.step()
    return run, long


def test_a_prompt_arriving_behind_a_running_long_prompt_is_admitted_in_the_next_step():
    run, long = _stream_beside_a_long_prompt()
    run.step()  # the long prompt runs, taking the whole prefill budget
    assert run.steps[-1]["tokens"]["long"] == 32
    short = _request("next", 6, max_tokens=4)
    run.add(short)
    before = long.num_computed_tokens
    run.step()
    assert run.steps[-1]["tokens"]["next"] == 6  # admitted whole, beside the long prompt's chunk
    assert long.num_computed_tokens - before == 26  # what was left of the 32 (at least the floor, 16)
    assert run.steps[-1]["prefill"] == 32
    run.drain()
    run.check_outputs()


def test_a_prompt_admitted_in_part_behind_a_running_long_prompt_ends_in_the_next_step():
    run, long = _stream_beside_a_long_prompt()
    first, second = _request("first", 20, max_tokens=3), _request("second", 20, max_tokens=3)
    run.add(first)
    run.add(second)
    run.step()  # the long prompt keeps its floor (16); the first arrival gets the other 16 of its 20
    assert run.steps[-1]["tokens"]["long"] == 16 and run.steps[-1]["tokens"]["first"] == 16
    assert "second" not in run.steps[-1]["tokens"]
    run.step()  # the first's last 4 and 12 of the second's 20 come before the long prompt's share
    assert run.steps[-1]["tokens"] == {"stream": 1, "long": 16, "first": 4, "second": 12}
    run.step()
    assert run.steps[-1]["tokens"]["second"] == 8 and run.steps[-1]["tokens"]["long"] == 24
    run.drain()
    run.check_outputs()


def test_streams_that_end_together_leave_steps_capped_for_the_grace():
    """Streams of one length end in one step; until their client's next requests arrive the long
    prompt runs alone, still capped within DECODE_GRACE_S of the last decode, whole after it."""
    run = _Run(_config())
    for i in range(2):
        run.add(_request(f"s{i}", 3, max_tokens=3))
    long = _request("long", 2000, max_tokens=2)
    run.step()  # the streams' prompts, then they decode
    run.add(long)
    while any(not r.is_finished for r in run.requests if r is not long):
        run.step()
    capped_until = long.num_computed_tokens
    assert run.steps[-1]["prefill"] <= 32
    run.now += DECODE_GRACE_S / 2
    run.step()  # nothing decodes, but within the grace
    assert long.num_computed_tokens - capped_until == 32
    run.now += DECODE_GRACE_S
    before = long.num_computed_tokens
    run.step()  # past it: the whole step's budget
    assert long.num_computed_tokens - before == 256
    run.drain()
    run.check_outputs()


def test_two_long_prompts_share_the_budget_and_each_ends():
    run = _Run(_config())
    run.add(_request("stream", 3, max_tokens=200))
    run.step()
    first, second = _request("first", 300, max_tokens=2), _request("second", 300, max_tokens=2)
    run.add(first)
    run.add(second)
    while not (first.is_finished and second.is_finished):
        run.step()
        assert run.steps[-1]["prefill"] <= 32
    run.drain()
    run.check_outputs()


def test_exact_mode_chunks_end_at_scan_chunk_boundaries_and_progress():
    run = _Run(_config(checkpoint_exact=True, max_prefill_tokens_with_decodes=64))
    run.add(_request("stream", 3, max_tokens=40))
    run.step()
    long = _request("long", 300, max_tokens=2)
    run.add(long)
    seen = []
    while long.num_computed_tokens < 300:
        run.step()
        seen.append(long.num_computed_tokens)
    assert seen == [64, 128, 192, 256, 300]
    run.drain()
    run.check_outputs()


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=6),
    budget=st.integers(4, 96),
    prefill=st.integers(1, 96),
)
def test_random_arrivals_keep_the_budget_and_every_output(prompts, budget, prefill):
    """Prompts (length, max_tokens, arrival step) under random step and prefill budgets: a step that
    decodes never takes more prefill tokens than the budget, a running prefill progresses in every
    step whose decodes leave a token of the step's budget, and every output is the fake model's
    greedy output."""
    run = _Run(_config(max_num_batched_tokens=budget, max_prefill_tokens_with_decodes=prefill))
    cap = min(prefill, budget)
    arrivals = sorted((arrival, i, length, tokens) for i, (length, tokens, arrival) in enumerate(prompts))
    step = 0
    while arrivals or run.scheduler.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, i, length, tokens = arrivals.pop(0)
            run.add(_request(f"p{i}", length, max_tokens=tokens))
        prefilling_before = any(is_prefill(r, r.num_computed_tokens) for r in run.scheduler.running)
        decoding_before = sum(not is_prefill(r, r.num_computed_tokens) for r in run.scheduler.running)
        if run.scheduler.has_unfinished():
            run.step()
            if decoding_before:
                assert run.steps[-1]["prefill"] <= cap
                if prefilling_before and decoding_before < budget:
                    assert run.steps[-1]["prefill"] >= 1  # a running prefill progresses
        step += 1
        assert step < 3000
    run.check_outputs()


def test_outputs_equal_steps_without_the_budget(model_dir):
    """CPU float32, greedy, tiny model: three streams and a 150-token prompt that arrives while they
    decode (16 prefill tokens a step beside them, with auto checkpoints cutting its chunks) give the
    tokens and logprobs of steps with no prefill budget (every prompt whole in one step)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    long_prompt = {"prompt_token_ids": [(37 * i) % 150 + 5 for i in range(150)]}

    def run(budget: int) -> tuple[list, list[int]]:
        llm = LLM(str(model_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=256,
                  max_prefill_tokens_with_decodes=budget)
        engine = llm.engine
        for i in range(3):
            engine.add_request(f"s{i}", f"stream {i} says", params, stream=False)
        engine.step()  # the streams decode from here on
        engine.add_request("long", long_prompt, params, stream=False)
        long, progress, outs = engine.sequences("long")[0], [], []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
            progress.append(long.num_computed_tokens)
        engine.check_integrity()
        return sorted(outs, key=lambda out: out.request_id), progress

    capped, progress = run(16)
    # the long prompt ran in chunks of at most 16 tokens beside the streams (fewer further in: the tiny
    # model's attention parity is small, tests/engine/test_prefill_budget_context.py)
    assert progress[0] == 16 and all(0 < b - a <= 16 for a, b in zip(progress[:8], progress[1:9]))
    whole, whole_progress = run(256)
    assert whole_progress[0] == 150
    assert_same_outputs(capped, whole)
