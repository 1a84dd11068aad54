"""One client's share of a step's decodes (engine/decode_share.py): beside another client's streams a
request with a large n decodes at most its share a step, its other sequences take turns oldest first
and keep their state, the streams decode every step, and outputs do not change."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint import LLM, SamplingParams, StructuredOutputsParams
from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import CPU_SERVE_DECODE_SHARE, EngineConfig
from forkpoint.engine.decode_share import DecodeTurns, decode_share
from forkpoint.engine.request import Request, RequestStatus
from forkpoint.engine.scheduler import Scheduler
from forkpoint.server.cli import build_parser
from forkpoint.server.engine_args import engine_kwargs, server_engine_kwargs
from tests.engine.fake_executor import FakeExecutor, append_sampled, reference
from tests.engine.test_faults import assert_drained
from tests.engine.test_speculative import SPEC
from tests.helpers import assert_same_outputs
from tests.tiny_models import add_mtp_weights, token_words

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARE = 8


def _request(request_id: str, parent_id: str, index: int, prompt: list[int], tenant: str = "",
             params: SamplingParams = GREEDY, computed: int | None = None) -> Request:
    request = Request(request_id, parent_id, index, prompt, (), params, 0.0, PrefixHasher(prompt, 4), None,
                      tenant=tenant)
    if computed is not None:  # decoding: the prompt computed and one output token sampled
        request.output_token_ids.append(1)
        request.num_computed_tokens = len(prompt) if computed else 0
    return request


def _decoders(client: str, n: int) -> list[Request]:
    return [_request(f"{client}#{i}", client, i, [1, 2, 3], computed=1) for i in range(n)]


# ---------------------------------------------------------------------------------------------- the rule
def test_the_share_is_the_floor_or_the_largest_other_client():
    running = Counter({"big": 64, "small": 4, "mid": 12})
    assert decode_share(8, "big", running) == 12  # the largest other client runs more than the floor
    assert decode_share(16, "big", running) == 16
    assert decode_share(8, "small", running) == 64  # a small client is never capped by a larger one
    assert decode_share(8, "big", Counter({"big": 64})) == 8  # others waiting, none running: the floor
    with pytest.raises(ValueError, match="floor >= 1"):
        decode_share(0, "big", running)
    with pytest.raises(ValueError, match="max_decode_share must be >= 1"):
        DecodeTurns(0)
    with pytest.raises(ValueError, match="max_decode_share must be >= 1"):
        EngineConfig(max_decode_share=0)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcde"), st.integers(1, 6)), st.sampled_from("abcdef"), st.integers(1, 5))
def test_the_share_from_the_two_largest_counts_is_the_rule(counts, own, floor):
    """decode_share reads only the two largest counts (one pass a step, not one per client): it is the
    floor or the largest other client's count, ties for the largest included."""
    running = Counter(counts)
    assert decode_share(floor, own, running) == max([floor] + [n for client, n in running.items() if client != own])


def test_a_lone_client_is_never_capped():
    turns = DecodeTurns(SHARE)
    big = _decoders("big", 64)
    assert turns.pick(big, live_clients={"prompt:big"}, departed=False).taking == big
    # a client that just left (a held slot) may come back within the grace: the share holds meanwhile
    assert len(turns.pick(big, live_clients={"prompt:big"}, departed=True).taking) == SHARE


def test_equal_clients_do_not_cap_each_other_and_prefills_never_skip():
    turns = DecodeTurns(SHARE)
    a, b = _decoders("a", 20), _decoders("b", 20)
    assert turns.pick(a + b, live_clients={"prompt:a", "prompt:b"}, departed=False).taking == a + b
    prefilling = [_request(f"p#{i}", "big", i, [1, 2, 3], computed=0) for i in range(12)]
    big = _decoders("big", 20) + prefilling
    picked = turns.pick(big + _decoders("s", 2), live_clients={"prompt:big", "prompt:s"}, departed=False).taking
    assert sum(r.parent_id == "big" and r.num_computed_tokens > 0 for r in picked) == SHARE
    assert all(r in picked for r in prefilling)  # prefill chunks are the prefill budget's, not the share's


def test_turns_go_oldest_first_and_none_waits_more_than_its_rounds():
    turns = DecodeTurns(SHARE)
    big, small = _decoders("big", 20), _decoders("small", 3)
    running = big + small
    waited = Counter()
    for step in range(12):
        picked = turns.pick(running, live_clients={"prompt:big", "prompt:small"}, departed=False).taking
        assert all(s in picked for s in small)
        assert sum(r in picked for r in big) == SHARE
        for request in big:
            waited[request.request_id] = 0 if request in picked else waited[request.request_id] + 1
            assert waited[request.request_id] <= math.ceil(20 / SHARE) - 1
        turns.record(picked, running, step)
    picked = turns.pick(running, {"prompt:big", "prompt:small"}, False).taking
    ran_last = [turns.last_ran[r.request_id] for r in big if r in picked]
    assert max(ran_last) <= min(turns.last_ran[r.request_id] for r in big if r not in picked)  # oldest first
    turns.record([], running[:5], 12)
    assert set(turns.last_ran) == {f"big#{i}" for i in range(5)}  # ended sequences are forgotten


# ---------------------------------------------------------------------------------------------- the engine
class _Loop:
    """The engine's loop around the scheduler with `FakeExecutor` as the runner: one prompt x n=64
    (client "big") and 4 single-sequence streams of another client ("small", `tenant`); the `first`
    client's arrive before the first step, the other's before the second. Records which sequences
    each step planned."""

    def __init__(self, share: int | None, abort_skipped_at: int | None = None, first: str = "big") -> None:
        config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=128, block_size=4, num_kv_blocks=1024,
                              checkpoint_pool_size=1, max_decode_share=share)
        self.blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, config.checkpoint_pool_size)
        self.scheduler = Scheduler(config, self.blocks, self.states, None, vocab_size=1000)
        self.executor = FakeExecutor(config.block_size)
        self.big = [_request(f"big#{i}", "big", i, [7, 1, 3]) for i in range(64)]
        self.small = [_request(f"small{s}", f"small{s}", 0, [9, s], tenant="small",
                                params=dataclasses.replace(GREEDY, max_tokens=20)) for s in range(4)]
        self.arrivals = [self.big, self.small] if first == "big" else [self.small, self.big]
        self.planned: list[list[Request]] = []
        self.aborted: Request | None = None
        self.abort_skipped_at = abort_skipped_at

    def run(self) -> _Loop:
        for index in range(500):
            if index >= len(self.arrivals) and not self.scheduler.has_unfinished():
                return self
            now = index * 0.05  # a fake clock: a held slot lapses 20 steps after its client left
            for request in self.arrivals[index] if index < len(self.arrivals) else ():
                self.scheduler.add(request, now)
            step = self.scheduler.schedule(now=now)
            self.planned.append(list(step.requests))
            if index == self.abort_skipped_at:  # a sequence skipping this step is aborted (it holds no step)
                self.aborted = next(r for r in self.big if r.status is RequestStatus.RUNNING
                                    and r not in step.requests)
                self.scheduler.finish(self.aborted, "abort", now=now)
                assert self.aborted.slot is None and not self.aborted.blocks
            tokens = self.executor.execute(step.plan)
            self.scheduler.commit(step)
            for request in append_sampled(step, tokens):
                if len(request.output_token_ids) >= request.params.max_tokens and not request.is_finished:
                    self.scheduler.finish(request, "length", now=now)
            self.scheduler.check_integrity()
            self.states.check_integrity()
        raise AssertionError("the scheduler did not drain")


@pytest.fixture(scope="module")
def shared() -> _Loop:
    return _Loop(SHARE).run()


def _contested(loop: _Loop) -> list[int]:
    """Steps in which a small stream decoded (they outlive big's first tokens: 20 tokens each)."""
    return [i for i, planned in enumerate(loop.planned) if any(r.tenant == "small" for r in planned)]


def test_the_other_clients_streams_decode_every_step(shared):
    steps = _contested(shared)
    assert steps == list(range(1, 21)), steps  # admitted in the second step, then one token every step


def test_the_big_request_takes_at_most_its_share_while_others_run(shared):
    assert len(shared.planned[0]) == 64  # alone in the first step: all of it
    for index in _contested(shared):
        assert sum(r.parent_id == "big" for r in shared.planned[index]) <= SHARE
    assert shared.scheduler.stats.decode_turns_skipped > 0
    # alone once the streams' client left and its held slots lapsed (20 steps), big decodes all it has left
    alone = shared.planned[_contested(shared)[-1] + 21:]
    assert alone and max(len(planned) for planned in alone) > SHARE, [len(p) for p in shared.planned]


def test_without_the_share_the_big_request_decodes_all_64_beside_the_streams():
    """The failure the share fixes (main: every running sequence decodes in every step)."""
    loop = _Loop(None).run()
    assert all(sum(r.parent_id == "big" for r in loop.planned[i]) == 64 for i in range(1, 12))
    assert loop.scheduler.stats.decode_turns_skipped == 0


def test_arriving_beside_the_streams_the_big_request_is_admitted_its_share_at_a_time():
    """n=64 arrives while the other client's streams run: at most its share of sequences a step,
    admissions included (without the share: all 64 prompts in its first step)."""
    loop = _Loop(SHARE, first="small").run()
    steps = _contested(loop)
    assert steps == list(range(20)), steps
    for index in steps:
        assert sum(r.parent_id == "big" for r in loop.planned[index]) <= SHARE
    assert loop.scheduler.stats.decode_turns_skipped == 0  # admitted a share at a time, none has to skip
    for request in loop.big + loop.small:
        assert request.output_token_ids == reference(request.prompt_token_ids, request.params.max_tokens)
    assert sum(r.parent_id == "big" for r in _Loop(None, first="small").run().planned[1]) == 64


def test_no_sequence_waits_more_than_its_rounds(shared):
    bound = math.ceil(64 / SHARE) - 1
    for request in shared.big:
        ran = [i for i, planned in enumerate(shared.planned) if request in planned]
        assert max(b - a - 1 for a, b in zip(ran, ran[1:])) <= bound, (request.request_id, ran)


def test_outputs_equal_the_run_without_the_share(shared):
    unshared = _Loop(None).run()
    for ours, theirs in zip(shared.big + shared.small, unshared.big + unshared.small):
        assert ours.output_token_ids == theirs.output_token_ids == reference(
            ours.prompt_token_ids, ours.params.max_tokens)
    assert len(shared.planned) > len(unshared.planned)  # the turns cost the big request steps
    assert shared.blocks.num_used == 0 and shared.states.requests.num_used == 0


def test_aborting_a_skipped_sequence_releases_everything():
    loop = _Loop(SHARE, abort_skipped_at=5).run()
    assert loop.aborted is not None and loop.aborted.finish_reason == "abort"
    assert loop.blocks.num_used == 0 and loop.states.requests.num_used == 0
    for request in loop.big + loop.small:
        if request is not loop.aborted:
            assert request.output_token_ids == reference(request.prompt_token_ids, request.params.max_tokens)


def test_the_config_and_the_servers_default():
    parse = build_parser().parse_args
    cpu, cuda = parse(["serve", "--device", "cpu"]), parse(["serve", "--device", "cuda"])
    assert server_engine_kwargs(cpu)["max_decode_share"] == CPU_SERVE_DECODE_SHARE
    assert engine_kwargs(cpu)["max_decode_share"] is None  # forkpoint generate / bench, LLM: off
    assert server_engine_kwargs(cuda)["max_decode_share"] is None  # not measured on CUDA
    assert server_engine_kwargs(parse(["serve", "--device", "cpu", "--max-decode-share", "4"]))[
        "max_decode_share"] == 4


# ---------------------------------------------------------------------------------------------- the model
MARK = "<|mamba_checkpoint|>"


def _drive(engine, arrivals: list[tuple[int, str, str, SamplingParams]], abort: tuple[int, str] | None = None) -> dict:
    """Step `engine` until it is done, adding each (step, id, prompt, params) before that step and
    aborting `abort` (step, id) before its step; integrity checked after every step. Returns the
    finished outputs by id, one entry per sequence (`RequestOutput` with that one completion)."""
    outputs = {}
    for index in range(1000):
        for _, request_id, prompt, params in (a for a in arrivals if a[0] == index):
            engine.add_request(request_id, prompt, params)
        if abort is not None and abort[0] == index:
            engine.abort_request(abort[1])
            engine.check_integrity()
        if index > max(a[0] for a in arrivals) and not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            if out.finished:
                outputs.update((f"{out.request_id}/{c.index}", dataclasses.replace(out, outputs=[c]))
                               for c in out.outputs)
        engine.check_integrity()
    raise AssertionError("the engine did not drain")


def _same(ours: dict, theirs: dict, tol: float = 1e-5) -> None:
    """The same sequences with the same tokens, top logprobs within `tol`. On the CPU a row's float32
    logits depend on how many rows its step's matmul holds (the lm head's [rows, 256] x [256, 248k] on
    3 rows against 24: up to 3.4e-5 apart), so logprobs match to rounding, not bit for bit."""
    assert sorted(ours) == sorted(theirs)
    assert_same_outputs([ours[k] for k in sorted(ours)], [theirs[k] for k in sorted(theirs)], tol)


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(async_scheduling=True)], ids=["sync", "async"])
def test_real_model_outputs_are_unchanged(moe_model, engine_kwargs):
    """CPU float32: a seeded n=8 request with logprobs, joined after its first steps by two greedy
    streams (one reading a checkpoint the other writes), gives the same tokens and logprobs with a
    share of 2 as without."""
    anchor = token_words(30, 24)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=11, n=8, max_tokens=12, ignore_eos=True, logprobs=2)
    arrivals = [(0, "big", token_words(31, 6), seeded),
                (3, "writer", f"{anchor} {MARK} {token_words(32, 3)}", greedy),
                (4, "reader", f"{anchor} {MARK} {token_words(33, 5)}", greedy)]

    def run(share: int | None) -> tuple[dict, dict]:
        llm = LLM(str(moe_model[0]), num_kv_blocks=256, block_size=8, max_num_seqs=16, max_decode_share=share,
                  **engine_kwargs)
        scheduler, schedule_ahead = llm.engine.scheduler, llm.engine.scheduler.schedule_ahead

        def counted(*args, **kwargs):
            step = schedule_ahead(*args, **kwargs)
            ahead.append(step is not None)
            return step

        ahead = []
        scheduler.schedule_ahead = counted
        outputs = _drive(llm.engine, arrivals)
        assert_drained(llm)
        return outputs, dict(llm.metrics(), ran_ahead=sum(ahead))

    shared, metrics = run(share=2)
    assert metrics["decode_turns_skipped"] > 10 and metrics["checkpoint_hits"] > 0
    if engine_kwargs.get("async_scheduling"):
        assert metrics["ran_ahead"] > 0, metrics  # steps ran ahead before and after the turns
    unshared, off = run(share=None)
    assert off["decode_turns_skipped"] == 0
    _same(shared, unshared)


def test_real_model_abort_of_sequences_waiting_for_their_turn_releases_everything(moe_model):
    llm = LLM(str(moe_model[0]), num_kv_blocks=256, block_size=8, max_num_seqs=16, max_decode_share=2)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    arrivals = [(0, "big", token_words(34, 6), dataclasses.replace(params, n=8)),
                (2, "stream", token_words(35, 4), params)]
    outputs = _drive(llm.engine, arrivals, abort=(6, "big"))
    assert llm.metrics()["decode_turns_skipped"] > 0 and list(outputs) == ["stream/0"]
    assert_drained(llm)  # integrity, and no block or slot held once idle checkpoints are evicted


def test_speculative_decoding_under_the_share_keeps_greedy_outputs(tiny_model_factory, tmp_path_factory):
    """Verify steps under a share of 1: a sequence that skips keeps its drafts for its next turn; greedy
    outputs equal the plain engine's (no speculation, no share), integrity checked after every step."""
    source, _ = tiny_model_factory("qwen3_5_moe_text")
    directory = tmp_path_factory.mktemp("decode_share_mtp")
    add_mtp_weights(source, directory)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    arrivals = [(0, "wide", token_words(36, 5), dataclasses.replace(params, n=4)),
                (2, "a", token_words(37, 7), params), (2, "b", token_words(38, 4), params)]
    reference_outputs = _drive(LLM(str(directory)).engine, arrivals)
    llm = LLM(str(directory), speculative_config=SPEC, max_decode_share=1)
    _same(_drive(llm.engine, arrivals), reference_outputs)
    metrics = llm.metrics()
    assert metrics["decode_turns_skipped"] > 0 and metrics["spec_verifications"] > 0


@settings(max_examples=80, deadline=None, derandomize=True)  # the same examples each run
@given(
    prompts=st.lists(st.tuples(st.sampled_from(["", "alice", "bob"]), st.integers(1, 10), st.integers(1, 6)),
                     min_size=1, max_size=5),
    budget=st.integers(2, 40),
    share=st.integers(1, 4),
    spare_blocks=st.integers(0, 12),
)
def test_random_clients_under_a_share_keep_every_output(prompts, budget, share, spare_blocks):
    """Random clients (tenant, prompt length, n) under a share, a token budget and KV blocks short
    enough to preempt: every sequence ends with the fake model's greedy output and the pools drain."""
    longest = max(length for _, length, _ in prompts) + GREEDY.max_tokens
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=8, block_size=4, max_decode_share=share,
                          num_kv_blocks=-(-longest // 4) + spare_blocks, checkpoint_pool_size=1)
    blocks, states = BlockPool(config.num_kv_blocks, config.block_size), StatePool(8, 1)
    scheduler, executor = Scheduler(config, blocks, states, None, vocab_size=1000), FakeExecutor(config.block_size)
    sequences = [_request(f"p{p}#{i}", f"p{p}", i, [p, *range(length - 1)], tenant)
                 for p, (tenant, length, n) in enumerate(prompts) for i in range(n)]
    for request in sequences:
        scheduler.add(request)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step = scheduler.schedule()
        if step.empty:  # as the engine: nothing to run this time (a preempted sequence waits for memory)
            continue
        assert all(r.status is RequestStatus.RUNNING and r.slot is not None for r in step.requests)
        tokens = executor.execute(step.plan)
        scheduler.commit(step)
        for request in append_sampled(step, tokens):
            if len(request.output_token_ids) >= GREEDY.max_tokens:
                scheduler.finish(request, "length")
        scheduler.check_integrity()
        states.check_integrity()
    assert not scheduler.has_unfinished(), "the scheduler did not drain"
    for request in sequences:
        assert request.output_token_ids == reference(request.prompt_token_ids, GREEDY.max_tokens)
    assert blocks.num_used == 0 and states.requests.num_used == 0


def test_structured_outputs_under_the_share_are_unchanged():
    """The embedded model (its real tokenizer), a seeded n=6 request under a regex beside a stream
    joining it: a grammar's sequences that take turns give the outputs of the run without the share."""
    regex = StructuredOutputsParams(regex=r"[A-Z][a-z]{1,6}-[0-9]{2,3}")
    arrivals = [(0, "constrained", "Code:", SamplingParams(n=6, seed=3, max_tokens=12, structured_outputs=regex,
                                                           logprobs=1)),
                (2, "stream", "Hello there", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                            logprobs=1))]

    def run(share: int | None) -> tuple[dict, int]:
        llm = LLM(max_model_len=1024, num_kv_blocks=128, checkpoint_pool_size=4, max_decode_share=share)
        outputs = _drive(llm.engine, arrivals)
        llm.engine.check_integrity()
        return outputs, llm.metrics()["decode_turns_skipped"]

    shared, skipped = run(share=2)
    assert skipped > 0
    _same(shared, run(share=None)[0], tol=1e-4)  # the 248k vocabulary's rows: see `_same`
