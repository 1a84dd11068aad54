"""Held slots (engine/held_slots.py): with every sequence slot busy, a stream whose requests end and
come back a round trip later gets its slots back at once instead of waiting behind one client's
many queued sequences; a hold nobody takes lapses after the grace; outputs do not change."""

from __future__ import annotations

import dataclasses

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import EngineConfig
from forkpoint.engine.held_slots import HeldSlots
from forkpoint.engine.prefill_budget import DECODE_GRACE_S
from forkpoint.engine.request import Request
from forkpoint.engine.scheduler import Scheduler
from tests.engine.fake_executor import FakeExecutor, append_sampled, reference
from tests.engine.test_faults import assert_drained, assert_outputs_equal
from tests.tiny_models import token_words

FLOOD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
STREAM = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
STEP_S = 0.05  # the fake clock's step time: a round trip of one step is well inside the grace


def test_a_hold_lasts_the_grace_and_ends_when_taken():
    holds = HeldSlots(1.0)
    holds.hold(10.0, "a")
    holds.hold(10.5, "a")
    holds.release("a")
    assert holds.count(10.9) == 2
    holds.take("c", False, 10.9)
    assert holds.count(10.9) == 1
    assert holds.count(11.5) == 0  # the second lapsed 1 s after it was freed
    holds.take("c", False, 11.5)  # nothing held: nothing to take
    assert holds.count(11.5) == 0
    with pytest.raises(ValueError, match="grace"):
        HeldSlots(0.0)


def test_a_hold_is_its_owners_and_once_it_left_also_any_idle_clients():
    """a's hold (a still present) is a's alone; g's (g left) goes to g or to a client that runs nothing,
    not to another present client."""
    holds = HeldSlots(1.0)
    holds.hold(0.0, "a")
    holds.hold(0.0, "g")
    holds.release("g")
    assert holds.barred("a", True, 0.1) == 1  # g's
    assert holds.barred("g", True, 0.1) == 1  # g came back and runs again: a's bars it, its own does not
    assert holds.barred("b", False, 0.1) == 1  # a's
    assert holds.barred("b", True, 0.1) == 2
    assert holds.left(0.1) == 1
    holds.take("b", True, 0.1)  # a present client given a free slot ends no hold
    assert holds.count(0.1) == 2
    holds.take("g", True, 0.1)  # its own, though it is present again
    assert holds.barred("b", False, 0.1) == 1 and holds.count(0.1) == 1
    holds.take("a", True, 0.1)
    assert holds.count(0.1) == 0
    for owner in ("a", "g", "b"):
        holds.hold(0.2, owner)
    holds.trim(1, 0.3)  # one free slot: only the newest hold is kept
    assert holds.count(0.3) == 1 and holds.barred("a", True, 0.3) == 1 and holds.barred("b", True, 0.3) == 0


class _Loop:
    """The engine's loop around the scheduler with `FakeExecutor` as the runner and a fake clock
    (STEP_S a step): 4 sequence slots; `streams` clients each keep one 4-token request going, the
    next arriving `round_trip` steps after the last ended (each request its own client, as a
    server's requests without a `user`); one prompt x n=24 (`flood_tokens` each) arrives in step
    `flood_step`, behind them."""

    def __init__(self, streams: int, round_trip: int, rounds: int, flood_tokens: int = FLOOD.max_tokens,
                 stream_tokens: int = STREAM.max_tokens, flood_step: int = 1, stream_user: str = "",
                 stagger: bool = False) -> None:
        # stream_user: the streams' requests share this tenant (one client, as a server's requests with one
        # `user`); stagger: stream s asks stream_tokens + s tokens, so that they end in different steps
        config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_kv_blocks=256,
                              checkpoint_pool_size=1)
        self.blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, config.checkpoint_pool_size)
        self.scheduler = Scheduler(config, self.blocks, self.states, None, vocab_size=1000)
        self.executor = FakeExecutor(config.block_size)
        self.round_trip, self.rounds, self.stream_user, self.stagger = round_trip, rounds, stream_user, stagger
        self.sequences: list[Request] = []
        self.stream_tokens = stream_tokens
        self.arrivals: dict[int, list[Request]] = {0: [self._stream(s, 0) for s in range(streams)]}
        flood = dataclasses.replace(FLOOD, max_tokens=flood_tokens)
        self.arrivals.setdefault(flood_step, []).extend(
            self._request(f"flood#{i}", "flood", i, [7, 1, 3], flood) for i in range(24))
        self.arrived: dict[str, int] = {}  # request id -> step it arrived
        self.admitted: dict[str, int] = {}  # request id -> step it was first planned
        self.planned: dict[int, int] = {}  # step -> sequences it planned

    def _request(self, request_id: str, parent_id: str, index: int, prompt: list[int],
                 params: SamplingParams) -> Request:
        request = Request(request_id, parent_id, index, prompt, (), params, 0.0, PrefixHasher(prompt, 4), None)
        self.sequences.append(request)
        return request

    def _stream(self, stream: int, round_: int) -> Request:
        tokens = self.stream_tokens + (stream if self.stagger else 0)
        request = self._request(f"s{stream}r{round_}", f"s{stream}r{round_}", 0, [9, stream, round_],
                                dataclasses.replace(STREAM, max_tokens=tokens))
        request.tenant = self.stream_user
        return request

    def run(self) -> None:
        for index in range(400):
            now = index * STEP_S
            for request in self.arrivals.pop(index, []):
                self.arrived[request.request_id] = index
                self.scheduler.add(request, now)
            if not self.scheduler.has_unfinished() and not self.arrivals:
                return
            step = self.scheduler.schedule(now)
            if step.empty:  # the streams' next requests are on their way
                continue
            self.planned[index] = len(set(step.requests))
            for request in step.requests:
                self.admitted.setdefault(request.request_id, index)
            tokens = self.executor.execute(step.plan)
            self.scheduler.commit(step)
            for request in append_sampled(step, tokens):
                if len(request.output_token_ids) >= request.params.max_tokens:
                    self.scheduler.finish(request, "length", now=now)
                    if request.parent_id == "flood":
                        continue
                    stream, round_ = map(int, request.request_id[1:].split("r"))
                    if round_ + 1 < self.rounds:  # the stream's next request, a round trip later
                        self.arrivals.setdefault(index + 1 + self.round_trip, []).append(
                            self._stream(stream, round_ + 1))
            self.scheduler.check_integrity()
            self.states.check_integrity()
        raise AssertionError("the scheduler did not drain")

    def waits(self) -> list[int]:
        """Steps each stream request waited from its arrival to its first planned step (round 0 excluded:
        it came before the flood)."""
        return [self.admitted[i] - self.arrived[i] for i in self.arrived if i.startswith("s") and not i.endswith("r0")]

    def check_outputs(self) -> None:
        for request in self.sequences:
            assert request.finish_reason == "length"
            assert request.output_token_ids == reference(request.prompt_token_ids, request.params.max_tokens)
        assert self.blocks.num_used == 0 and self.states.requests.num_used == 0


def test_a_returning_stream_takes_its_slot_back_before_a_queued_flood():
    """2 streams and n=24 on 4 slots: each stream's next request, arriving one step after its last
    ended, is planned in the step it arrives in (the flood's queue left its slot alone)."""
    loop = _Loop(streams=2, round_trip=1, rounds=4)
    loop.run()
    assert loop.waits() == [0] * 6, loop.waits()
    loop.check_outputs()


def test_streams_of_one_user_keep_their_slots_while_some_of_them_run():
    """3 streams under one `user` (one client, ending in different steps, so it stays present) and
    n=24 of another client on 4 slots: each stream's next request, a step after its last ended, is
    planned in the step it arrives in: the slot its stream freed was held for its client."""
    loop = _Loop(streams=3, round_trip=1, rounds=4, stream_user="bystander", stagger=True)
    loop.run()
    assert loop.waits() == [0] * 9, loop.waits()
    loop.check_outputs()


def test_streams_of_one_user_ending_together_all_get_their_slots_back():
    """3 streams under one `user` end in the same step (the client leaves) and come back together: the
    first one admitted makes the client present again, and the other two still take the holds their
    own streams left, before the flood's queue."""
    loop = _Loop(streams=3, round_trip=1, rounds=4, stream_user="bystander")
    loop.run()
    assert loop.waits() == [0] * 9, loop.waits()
    loop.check_outputs()


def test_a_flood_whose_running_sequences_all_ended_takes_no_held_slot():
    """Streams and the flood's first sequences start together and end in the same step: in the next
    step the flood runs nothing but is still in the engine (queued), so it takes only the slots
    beyond those held, and the streams' next requests get theirs on arrival."""
    loop = _Loop(streams=2, round_trip=1, rounds=3, flood_tokens=4, stream_tokens=4, flood_step=0)
    loop.run()
    assert loop.waits() == [0] * 4, loop.waits()
    loop.check_outputs()


def test_without_holds_the_stream_waits_for_a_flood_sequence_to_end():
    """The failure holds fix: with holds that lapse at once, the flood's queue takes the slots in the
    round trip, and the stream's next request waits for one of the flood's 12-token sequences."""
    loop = _Loop(streams=2, round_trip=1, rounds=4)
    loop.scheduler.held_slots = HeldSlots(1e-9)
    loop.run()
    assert max(loop.waits()) >= 8, loop.waits()
    loop.check_outputs()


def test_a_hold_nobody_takes_lapses_and_the_flood_fills_the_slot():
    """A stream that does not come back within the grace: its slot goes to the flood once the hold
    lapses (DECODE_GRACE_S after it was freed), never before."""
    loop = _Loop(streams=1, round_trip=1, rounds=1, flood_tokens=40)  # no flood sequence ends before the lapse
    loop.run()
    ended = loop.admitted["s0r0"] + STREAM.max_tokens - 1  # the step the stream's request ended in
    lapse = ended + round(DECODE_GRACE_S / STEP_S)  # the first step at or past the grace
    assert all(loop.planned[step] == 3 for step in range(ended + 1, lapse)), loop.planned
    assert loop.planned[lapse] == 4, loop.planned  # then the flood fills the fourth slot
    loop.check_outputs()


def test_outputs_with_held_slots_equal_a_plain_run(moe_model):
    """CPU float32, greedy with logprobs: a prompt x n=8 on 3 slots beside a stream whose second
    request arrives a step after its first ended (it takes the held slot) gives the tokens and
    logprobs of each request run alone."""
    flood = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, n=8)
    stream = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompts = {"s0": (token_words(70, 5), stream), "flood": (token_words(71, 4), flood),
               "s1": (token_words(72, 6), stream)}

    def alone(request_id: str) -> list:
        llm = LLM(str(moe_model[0]), num_kv_blocks=64, block_size=8)
        prompt, params = prompts[request_id]
        out = llm.generate([prompt], [params], use_tqdm=False)[0]
        return [(c.token_ids, c.logprobs) for c in out.outputs]

    llm = LLM(str(moe_model[0]), num_kv_blocks=64, block_size=8, max_num_seqs=3)
    engine = llm.engine
    engine.add_request("s0", *prompts["s0"])
    finished: dict[str, list] = {}
    ended = arrived = admitted = None  # the steps s0 ended in, s1 was added in and first ran in
    for step in range(200):
        if step == 1:
            engine.add_request("flood", *prompts["flood"])
        if ended is not None and step == ended + 2:  # a step after s0's slot freed: the stream's next request
            engine.add_request("s1", *prompts["s1"])
            arrived = step
        outputs = engine.step()
        if admitted is None and any(r.parent_id == "s1" for r in engine.scheduler.running):
            admitted = step
        for output in outputs:
            if output.finished:
                finished[output.request_id] = [(c.token_ids, c.logprobs) for c in output.outputs]
        if ended is None and "s0" in finished:
            ended = step
        engine.check_integrity()
        if len(finished) == 3 and not engine.has_unfinished_requests():
            break
    assert arrived is not None and admitted == arrived  # it took the slot s0 left, with 6 flood sequences queued
    for request_id in prompts:
        assert_outputs_equal(finished[request_id], alone(request_id), request_id)
    assert_drained(llm)


def test_a_client_running_sequences_waits_while_the_free_slots_are_held():
    """Scheduler level, the rule itself: 2 of 3 free slots held; a client that runs a sequence gets
    the one slot beyond them, a client that runs nothing gets a held one."""
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_kv_blocks=64,
                          checkpoint_pool_size=1)
    scheduler = Scheduler(config, BlockPool(64, 4), StatePool(4, 1), None, vocab_size=1000)
    runner = Request("a#0", "a", 0, [1, 2], (), FLOOD, 0.0, PrefixHasher([1, 2], 4), None)
    scheduler.add(runner, 0.0)
    scheduler.commit(scheduler.schedule(0.0))
    runner.output_token_ids.append(5)  # its sampled token: it decodes next
    scheduler.held_slots.hold(0.0, "gone")
    scheduler.held_slots.hold(0.0, "gone")
    scheduler.held_slots.release("gone")
    more = [Request(f"a#{i}", "a", i, [1, 2], (), FLOOD, 0.0, PrefixHasher([1, 2], 4), None) for i in (1, 2, 3)]
    newcomer = Request("b#0", "b", 0, [3, 4], (), FLOOD, 0.0, PrefixHasher([3, 4], 4), None)
    for request in more:
        scheduler.add(request, 0.0)
    step = scheduler.schedule(0.1)
    assert {r.request_id for r in step.requests} == {"a#0", "a#1"}  # one slot beyond the 2 held
    scheduler.commit(step)
    scheduler.add(newcomer, 0.1)
    step = scheduler.schedule(0.2)
    assert "b#0" in {r.request_id for r in step.requests} and scheduler.held_slots.count(0.2) == 1
    scheduler.commit(step)
