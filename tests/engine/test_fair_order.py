"""Per-client decode fairness (engine/fair_order.py): when a step cannot hold every running
sequence, one client's many sequences do not starve another client's stream, and outputs stay
those of a step that holds them all."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint import LLM, SamplingParams
from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import EngineConfig
from forkpoint.engine import scheduler as scheduler_module
from forkpoint.engine.fair_order import admission_order, step_order
from forkpoint.engine.request import Request, RequestStatus
from forkpoint.engine.scheduler import Scheduler
from tests.engine.fake_executor import FakeExecutor, append_sampled, reference
from tests.helpers import assert_same_outputs

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _request(request_id: str, parent_id: str, index: int, prompt: list[int], tenant: str = "",
             computed: int = 0) -> Request:
    request = Request(request_id, parent_id, index, prompt, (), PARAMS, 0.0, PrefixHasher(prompt, 4), None,
                      tenant=tenant)
    request.num_computed_tokens = computed
    return request


def test_order_is_unchanged_while_every_chunk_fits():
    running = [_request(f"a{i}", "a", i, [1, 2, 3], computed=2) for i in range(4)] + [_request("b", "b", 0, [4, 5])]
    assert step_order(running, budget=6, chunk_cap=8) == running  # 4 decodes and a 2-token prompt
    assert step_order(running, budget=5, chunk_cap=8) == [running[0], running[4], *running[1:4]]


def test_short_budget_takes_one_sequence_per_client_per_round():
    a = [_request(f"a{i}", f"pa{i // 2}", i % 2, [1, 2, 3], tenant="alice", computed=2) for i in range(4)]
    b = _request("b", "pb", 0, [4, 5], tenant="bob", computed=1)
    c = [_request(f"c{i}", "pc", i, [6, 7], computed=1) for i in range(2)]  # no tenant: one client per prompt
    assert step_order([*a, b, *c], budget=3, chunk_cap=8) == [a[0], b, c[0], a[1], c[1], a[2], a[3]]


def test_a_sequence_cap_below_the_running_count_takes_round_robin():
    running = [_request(f"a{i}", "a", i, [1, 2], computed=1) for i in range(3)] + [_request("b", "b", 0, [3, 4],
                                                                                            computed=1)]
    assert step_order(running, budget=100, chunk_cap=8, seq_room=4) == running
    assert step_order(running, budget=100, chunk_cap=8, seq_room=2) == [running[0], running[3], *running[1:3]]


def test_a_prefill_chunk_counts_its_capped_tokens():
    prefill = _request("p", "p", 0, list(range(20)))  # 20 tokens left, 8 a step
    decode = _request("d", "d", 0, [1, 2], computed=1)
    assert step_order([prefill, decode], budget=9, chunk_cap=8) == [prefill, decode]
    assert step_order([prefill, decode], budget=8, chunk_cap=8) == [prefill, decode]  # both first of their client
    second = _request("p2", "p", 1, list(range(20)))
    assert step_order([prefill, second, decode], budget=16, chunk_cap=8) == [prefill, decode, second]


def test_admission_is_first_come_first_served_while_all_fit():
    waiting = [_request(f"a{i}", "a", i, [1, 2]) for i in range(3)] + [_request("b", "b", 0, [3])]
    assert admission_order(waiting, [], budget=7, seq_room=4, chunk_cap=8) == waiting


def test_admission_ranks_a_client_after_its_running_sequences():
    running = [_request(f"r{i}", "pa", i, [1, 2], tenant="alice", computed=2) for i in range(2)]
    alice = [_request(f"a{i}", f"q{i}", 0, [1, 2], tenant="alice") for i in range(3)]
    bob = [_request(f"b{i}", "pb", i, [3, 4], tenant="bob") for i in range(2)]
    carol = _request("c", "pc", 0, [5])
    waiting = [*alice, bob[0], bob[1], carol]
    # ranks: alice 2, 3, 4 (two running); bob 0, 1; carol 0
    assert admission_order(waiting, running, budget=100, seq_room=3, chunk_cap=8) == [
        bob[0], carol, bob[1], alice[0], alice[1], alice[2]]
    assert admission_order(waiting, running, budget=5, seq_room=8, chunk_cap=8)[:2] == [bob[0], carol]


class _Engine:
    """The engine's loop around the scheduler with `FakeExecutor` as the runner; records which
    sequences each step planned."""

    def __init__(self, config: EngineConfig) -> None:
        self.blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, config.checkpoint_pool_size)
        self.scheduler = Scheduler(config, self.blocks, self.states, None, vocab_size=1000)
        self.executor = FakeExecutor(config.block_size)
        self.sequences: list[Request] = []
        self.planned: list[set[str]] = []

    def add(self, parent_id: str, prompt: list[int], n: int, tenant: str) -> None:
        for index in range(n):
            request = _request(f"{parent_id}#{index}", parent_id, index, prompt, tenant)
            self.sequences.append(request)
            self.scheduler.add(request)

    def run(self, cut_from_step: int, cut_budget: int) -> None:
        """Until every sequence ends; from step `cut_from_step` on, steps of `cut_budget` tokens."""
        for index in range(1000):
            if not self.scheduler.has_unfinished():
                return
            if index == cut_from_step:
                self.scheduler.config = dataclasses.replace(self.scheduler.config, max_num_batched_tokens=cut_budget)
            step = self.scheduler.schedule()
            self.planned.append({r.request_id for r in step.requests})
            # a sequence is never preempted after being planned into the same step
            assert all(r.status is RequestStatus.RUNNING and r.slot is not None for r in step.requests)
            tokens = self.executor.execute(step.plan)
            self.scheduler.commit(step)
            for request in append_sampled(step, tokens):
                if len(request.output_token_ids) >= PARAMS.max_tokens:
                    self.scheduler.finish(request, "length")
            self.scheduler.check_integrity()
            self.states.check_integrity()
        raise AssertionError("the scheduler did not drain")


def _one_client_floods(tenant_of_flood: str, tenant_of_stream: str) -> _Engine:
    """24 sequences of one client (4 prompts x n=6 of one tenant, or with no tenant one prompt x
    n=24), then another client's single stream, all admitted in the first step (64 tokens); from the
    third step on each step holds 8 tokens, as when steps are cut down (a step retried smaller after
    it ran out of memory), so a step cannot hold every running decode."""
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=32, block_size=4, num_kv_blocks=256,
                          checkpoint_pool_size=1)
    engine = _Engine(config)
    if tenant_of_flood:
        for p in range(4):
            engine.add(f"flood{p}", [7, p], 6, tenant_of_flood)
    else:
        engine.add("flood", [7, 1], 24, "")
    engine.add("stream", [9, 8], 1, tenant_of_stream)
    engine.run(cut_from_step=2, cut_budget=8)
    return engine


def _stream_steps(engine: _Engine) -> list[int]:
    return [i for i, planned in enumerate(engine.planned) if "stream#0" in planned]


@pytest.mark.parametrize("flood, stream", [("alice", "bob"), ("", "")], ids=["by_user", "n_6"])
def test_an_admitted_stream_decodes_every_step_beside_one_clients_prefills(flood, stream):
    engine = _one_client_floods(flood, stream)
    steps = _stream_steps(engine)
    assert steps == list(range(PARAMS.max_tokens)), steps  # admitted first, then a token every step
    for request in engine.sequences:
        assert request.output_token_ids == reference(request.prompt_token_ids, PARAMS.max_tokens)
    assert engine.blocks.num_used == 0 and engine.states.requests.num_used == 0


def test_without_the_fair_order_the_stream_waits_for_the_flood(monkeypatch):
    """The failure the order fixes: planned in running order, the flood's earlier-admitted prefill
    takes whole steps' budgets and the admitted stream gets no token in them."""
    monkeypatch.setattr(scheduler_module, "step_order", lambda running, *args: list(running))
    engine = _one_client_floods("alice", "bob")
    steps = _stream_steps(engine)
    assert steps[-1] >= PARAMS.max_tokens + 10, steps  # 10 steps or more without a token for it
    for request in engine.sequences:
        assert request.output_token_ids == reference(request.prompt_token_ids, PARAMS.max_tokens)


def _queued_behind_a_flood() -> _Engine:
    """One prompt x n=24 (no tenant: one client), then another client's single request; 8 sequence
    slots, so the flood's sequences cannot all run at once."""
    engine = _Engine(EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_kv_blocks=256,
                                  checkpoint_pool_size=1))
    engine.add("flood", [7, 1, 3], 24, "")
    engine.add("stream", [9, 8], 1, "")
    engine.run(cut_from_step=0, cut_budget=64)
    return engine


def test_a_new_client_is_admitted_ahead_of_a_flood_queued_before_it():
    engine = _queued_behind_a_flood()
    assert _stream_steps(engine) == list(range(PARAMS.max_tokens))  # in the first step, then every step
    for request in engine.sequences:
        assert request.output_token_ids == reference(request.prompt_token_ids, PARAMS.max_tokens)


def test_first_come_first_served_the_new_client_waits_for_the_flood(monkeypatch):
    monkeypatch.setattr(scheduler_module, "admission_order", lambda waiting, *args: list(waiting))
    steps = _stream_steps(_queued_behind_a_flood())
    assert steps[0] >= 2 * PARAMS.max_tokens, steps  # two waves of 8 flood sequences ran first


def test_outputs_equal_a_step_that_holds_every_sequence(moe_model, monkeypatch):
    """CPU float32, greedy: a client's n=12 beside two single streams, with steps cut to 8 tokens
    after the second (the fair order reorders them), gives the tokens and logprobs of steps that
    hold them all."""
    prompts = ["a flood of sequences", "one stream", "another stream"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    reordered = []

    def counted(running, *args):
        order = step_order(running, *args)
        reordered.append(order != list(running))
        return order

    monkeypatch.setattr(scheduler_module, "step_order", counted)

    def run(cut_budget: int | None) -> list:
        llm = LLM(str(moe_model[0]), num_kv_blocks=128, block_size=8, max_num_seqs=16, max_num_batched_tokens=64)
        scheduler, schedule = llm.engine.scheduler, llm.engine.scheduler.schedule

        def cut_after_two(*args, **kwargs):
            if cut_budget is not None and scheduler.num_steps == 2:
                scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=cut_budget)
            return schedule(*args, **kwargs)

        monkeypatch.setattr(scheduler, "schedule", cut_after_two)
        outs = llm.generate(prompts, [dataclasses.replace(params, n=12), params, params], use_tqdm=False)
        llm.engine.check_integrity()
        return [dataclasses.replace(out, outputs=[c]) for out in outs for c in out.outputs]

    cut = run(cut_budget=8)
    assert sum(reordered) >= 5, reordered
    reordered.clear()
    assert_same_outputs(cut, run(cut_budget=None))
    assert not any(reordered)


@settings(max_examples=150, deadline=None, derandomize=True)  # the same examples each run
@given(
    prompts=st.lists(st.tuples(st.sampled_from(["", "alice", "bob"]), st.integers(1, 12), st.integers(1, 4)),
                     min_size=1, max_size=6),
    budget=st.integers(2, 40),
    cut=st.tuples(st.integers(0, 4), st.integers(1, 8)),
    spare_blocks=st.integers(0, 12),
)
def test_cut_steps_and_preemption_keep_every_output(prompts, budget, cut, spare_blocks):
    """Random clients (tenant, prompt length, n) under a token budget cut down after a few steps
    and KV blocks short enough to preempt: every sequence ends with the fake model's greedy output,
    no step computes for a sequence it preempted, and the pools drain."""
    longest = max(length for _, length, _ in prompts) + PARAMS.max_tokens
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=8, block_size=4,
                          num_kv_blocks=-(-longest // 4) + spare_blocks, checkpoint_pool_size=1)
    engine = _Engine(config)
    for p, (tenant, length, n) in enumerate(prompts):
        engine.add(f"p{p}", [p, *range(length - 1)], n, tenant)
    engine.run(cut_from_step=cut[0], cut_budget=min(budget, cut[1]))
    for request in engine.sequences:
        assert request.finish_reason == "length"
        assert request.output_token_ids == reference(request.prompt_token_ids, PARAMS.max_tokens)
    assert engine.blocks.num_used == 0 and engine.states.requests.num_used == 0
