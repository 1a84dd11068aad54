"""A step that runs out of memory is retried in smaller steps (engine/memory_retry.py): its step-mates
finish with the outputs of a fault-free run, only a request that runs out of memory alone in the
smallest step fails (with an error naming memory), and everything is released (integrity after every
step, pools drained at the end). The workloads are tests/engine/test_faults.py's (float32 CPU, tiny
model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from forkpoint import LLM
from forkpoint.engine.engine import LLMEngine, StepFailed
from forkpoint.engine.memory_retry import MemoryBackoff, OutOfMemory, is_out_of_memory
from forkpoint.step.plan import StepPlan
from tests.engine.test_faults import GREEDY, SCENARIOS, Arrival, Scenario, assert_drained, assert_outputs_equal, drive
from tests.tiny_models import token_words


class OutOfMemoryRunner:
    """Wraps `engine.runner.execute`: raises torch.OutOfMemoryError when `when(call, plan)` holds.
    `alone`: prompts it failed in a step of one sequence and one token (no smaller step exists)."""

    def __init__(self, engine: LLMEngine, when: Callable[[int, StepPlan], bool]) -> None:
        self._execute = engine.runner.execute
        self.when = when
        self.calls = 0
        self.raised = 0
        self.alone: set[str] = set()
        engine.runner.execute = self

    def __call__(self, plan: StepPlan, feed=None):
        call, self.calls = self.calls, self.calls + 1
        if self.when(call, plan):
            self.raised += 1
            if len({s.request_id for s in plan.segments}) == 1 and sum(s.end - s.start for s in plan.segments) == 1:
                self.alone.add(plan.segments[0].request_id.split("#")[0])
            raise torch.OutOfMemoryError(f"injected fault: out of memory at call {call}")
        return self._execute(plan) if feed is None else self._execute(plan, feed=feed)


def tokens_of(plan: StepPlan, request_id: str) -> int:
    return sum(s.end - s.start for s in plan.segments if s.request_id.split("#")[0] == request_id)


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"), True),
    (RuntimeError("injected fault"), False),
    (ValueError("can't allocate memory"), False),
])
def test_what_counts_as_out_of_memory(error, expected):
    assert is_out_of_memory(error) is expected


def test_the_cpu_allocators_own_failure_counts():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2 ** 60, dtype=torch.uint8)
    assert is_out_of_memory(caught.value)


def fresh_run(model_dir, scenario: Scenario) -> tuple[dict[str, list], int]:
    """A fault-free engine's outputs of `scenario` and its number of steps."""
    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    expected, failed = drive(llm.engine, scenario)
    assert not failed
    return expected, llm.metrics()["steps"]


@pytest.mark.parametrize("scenario, async_scheduling", [
    (SCENARIOS[1], False), (SCENARIOS[2], False), (SCENARIOS[3], False), (SCENARIOS[4], False), (SCENARIOS[2], True),
], ids=lambda value: value.name if isinstance(value, Scenario) else ("async" if value else "sync"))
def test_an_out_of_memory_step_at_any_point_fails_no_request(model_dir, scenario, async_scheduling):
    """Out of memory once, at each step k of the workload in turn: every request finishes with a
    fault-free engine's outputs, except a sequence that was decoding alone in that step (its prompt
    fails: no smaller step exists), and afterwards the caps are gone (the same workload takes the
    fault-free number of steps)."""
    expected, num_steps = fresh_run(model_dir, scenario)
    llm = LLM(str(model_dir), **dict(scenario.engine_kwargs, async_scheduling=async_scheduling))
    fault_at: list[int | None] = [None]
    runner = OutOfMemoryRunner(llm.engine, lambda call, plan: call == fault_at[0])
    for step in range(num_steps):
        runner.calls, fault_at[0], runner.alone = 0, step, set()
        finished, failed = drive(llm.engine, scenario)
        assert failed == runner.alone and finished.keys() == expected.keys() - failed, f"out of memory at step {step}"
        for request_id, outputs in finished.items():
            assert_outputs_equal(outputs, expected[request_id], f"{scenario.name}@{step}:{request_id}")
        assert_drained(llm)
        fault_at[0] = None
        steps_before = llm.metrics()["steps"]
        again, failed = drive(llm.engine, scenario)
        assert not failed and llm.metrics()["steps"] - steps_before == num_steps, "the caps outlived the fault"
        assert_drained(llm)
    metrics = llm.metrics()
    assert runner.raised == num_steps
    assert metrics["steps_retried_for_memory"] + metrics["requests_failed_for_memory"] == num_steps
    assert metrics["requests_failed"] == metrics["requests_failed_for_memory"]


def test_a_request_that_runs_out_of_memory_alone_fails_alone(model_dir):
    """"late" runs out of memory in every step it is in: the steps shrink until it is alone in a
    one-token step, then it fails with an error naming memory; "early" and "later", which shared
    its steps, finish with their fault-free outputs."""
    scenario = SCENARIOS[2]
    expected, _ = fresh_run(model_dir, scenario)
    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    OutOfMemoryRunner(llm.engine, lambda call, plan: tokens_of(plan, "late") > 0)
    failures: list[StepFailed] = []
    finished: dict[str, list] = {}
    for step in range(300):
        for arrival in scenario.arrivals:
            if arrival.step == step:
                llm.engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
        try:
            outputs = llm.engine.step()
        except StepFailed as failure:
            failures.append(failure)
            outputs = failure.outputs
        finished.update({o.request_id: [(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs if o.finished})
        llm.engine.check_integrity()
        if step > 3 and not llm.engine.has_unfinished_requests():
            break
    assert [f.request_ids for f in failures] == [["late"]]
    cause = failures[0].cause
    assert isinstance(cause, OutOfMemory) and "'late' ran out of memory" in str(cause)
    assert "shorter prompt" in str(cause)
    assert finished.keys() == {"early", "later"}
    for request_id, outputs in finished.items():
        assert_outputs_equal(outputs, expected[request_id], request_id)
    assert_drained(llm)
    metrics = llm.metrics()
    assert metrics["requests_failed_for_memory"] == 1 and metrics["steps_retried_for_memory"] >= 1


def test_a_request_too_big_for_one_step_runs_in_smaller_steps(model_dir):
    """A 40-token prompt that runs out of memory whenever a step computes more than 8 of its
    tokens: it runs in smaller chunks and finishes with the outputs of a fault-free run, as do the
    requests beside it."""
    scenario = Scenario("big_beside_small", (
        Arrival(0, "small", token_words(80, 5), dataclasses.replace(GREEDY, max_tokens=6)),
        Arrival(1, "big", token_words(81, 40)),
        Arrival(1, "other", token_words(82, 7)),
    ), dict(max_num_batched_tokens=128))
    expected, _ = fresh_run(model_dir, scenario)
    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    runner = OutOfMemoryRunner(llm.engine, lambda call, plan: tokens_of(plan, "big") > 8)
    finished, failed = drive(llm.engine, scenario)
    assert not failed and finished.keys() == expected.keys() and runner.raised >= 2
    for request_id, outputs in finished.items():
        assert_outputs_equal(outputs, expected[request_id], request_id)
    assert_drained(llm)


def test_any_other_fault_still_fails_its_step(model_dir):
    """Only an allocation failure is retried: a plain RuntimeError ends the step's requests."""
    llm = LLM(str(model_dir), max_num_batched_tokens=64)
    execute = llm.engine.runner.execute

    def raising(plan, feed=None):
        raise RuntimeError("injected fault: not memory")

    llm.engine.runner.execute = raising
    llm.engine.add_request("a", token_words(90, 4), GREEDY)
    with pytest.raises(StepFailed, match="not memory") as caught:
        llm.engine.step()
    assert caught.value.request_ids == ["a"] and llm.metrics()["steps_retried_for_memory"] == 0
    llm.engine.runner.execute = execute
    assert_drained(llm)


class _Sequence:
    """A stand-in for a live Request (hashed by identity, as Request is)."""

    is_finished = False
    made = 0

    def __init__(self) -> None:
        _Sequence.made += 1
        self.request_id = f"seq{_Sequence.made}"


def _step(*segments: tuple[_Sequence, int]) -> SimpleNamespace:
    """A stand-in for a ScheduledStep: (sequence, tokens) per segment."""
    return SimpleNamespace(plan=SimpleNamespace(segments=[SimpleNamespace(request_id=s.request_id, start=0, end=n)
                                                          for s, n in segments]),
                           requests=[sequence for sequence, _ in segments])


@pytest.mark.parametrize("floor", [1, 64])
def test_every_retry_lowers_a_cap_until_the_culprit_is_alone(floor):
    """Whatever the failing steps hold, each `shrink` lowers the per-sequence, the sequence or the
    token cap, or caps one more sequence, and a step that fits the caps and fails again ends with a
    culprit: the retries end."""
    a, b, c = _Sequence(), _Sequence(), _Sequence()
    cases = [
        _step((a, 100)),                    # one prefill chunk above the floor
        _step((a, 1), (a, 1)),              # one sequence cut in two one-token segments
        _step((a, 40), (b, 1), (c, 1)),     # a chunk at or below the floor with two decodes
        _step((a, 1), (b, 1)),              # decodes alone
        _step((a, 300), (b, 30), (c, 1)),   # two chunks and a decode
    ]
    for step in cases:
        backoff = MemoryBackoff(floor, max_tokens=8192, max_seqs=256)
        sizes = []
        while backoff.culprit([step]) is None:
            limits = backoff.shrink([step])
            sizes.append((limits.max_chunk, -len(limits.chunked), limits.max_seqs, limits.max_tokens))
            assert len(sizes) < 40, sizes
            kept = []  # the next step: the same sequences' segments, cut to the caps
            room_tokens, room_seqs, shares = limits.max_tokens, limits.max_seqs, {}
            for sequence, segment in zip(step.requests, step.plan.segments):
                cap = limits.max_chunk if sequence.request_id in limits.chunked else 10 ** 9
                size = min(segment.end, room_tokens, cap - shares.get(sequence, 0))
                if size > 0 and (sequence in shares or room_seqs):
                    room_seqs -= sequence not in shares
                    room_tokens -= size
                    shares[sequence] = shares.get(sequence, 0) + size
                    kept.append((sequence, size))
            step = _step(*kept)
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
        assert len(set(step.requests)) == 1 and sum(s.end for s in step.plan.segments) <= floor


def test_a_retry_cuts_the_largest_chunk_and_leaves_the_decodes_their_rows():
    """8 decodes beside a 64-token chunk fail: the next steps cap that sequence at 16 tokens, not the
    step at 36 (half of 72): the decodes' recomputes (27 tokens each) then fit one step. If that step
    fails too, the recomputes are capped as well."""
    decodes = [_Sequence() for _ in range(8)]
    chunk = _Sequence()
    backoff = MemoryBackoff(1, max_tokens=8192, max_seqs=256)
    limits = backoff.shrink([_step(*[(d, 1) for d in decodes], (chunk, 64))])
    assert (limits.max_chunk, limits.max_seqs, limits.max_tokens) == (16, 256, 8192)
    assert limits.chunked == {chunk.request_id}  # the decodes' recomputes are not cut
    limits = backoff.shrink([_step(*[(d, 27) for d in decodes], (chunk, 16))])  # failed again: 27 is the largest
    assert (limits.max_chunk, limits.max_seqs, limits.max_tokens) == (6, 256, 8192)
    assert limits.chunked == {s.request_id for s in [*decodes, chunk]}
    limits = MemoryBackoff(1, max_tokens=8192, max_seqs=256).shrink([_step(*[(d, 1) for d in decodes])])
    assert (limits.max_chunk, limits.max_seqs, limits.max_tokens) == (8192, 4, 8192)  # decodes alone: rows


def test_step_mates_recompute_in_one_step_after_a_chunk_runs_out_of_memory(model_dir):
    """Engine level: 6 streams decode beside a 48-token prompt whose first step with a chunk of more
    than 24 of its tokens runs out of memory (the retry takes at most 12 of its tokens a step). The
    streams' recomputes run whole in the next step, all six (with a step capped at half the failed
    step's tokens, as before, or every sequence capped, they took several), and every request
    finishes with a fault-free run's outputs."""
    streams = tuple(Arrival(0, f"s{i}", token_words(100 + i, 12), dataclasses.replace(GREEDY, max_tokens=10))
                    for i in range(6))
    scenario = Scenario("streams_beside_a_chunk", (*streams, Arrival(2, "big", token_words(99, 48))),
                        dict(max_num_batched_tokens=256))
    expected, _ = fresh_run(model_dir, scenario)
    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    plans: list[StepPlan] = []
    runner = OutOfMemoryRunner(llm.engine, lambda call, plan: plans.append(plan) or tokens_of(plan, "big") > 24)
    finished, failed = drive(llm.engine, scenario)
    assert not failed and finished.keys() == expected.keys() and runner.raised == 1
    for request_id, outputs in finished.items():
        assert_outputs_equal(outputs, expected[request_id], request_id)
    failed_at = next(i for i, plan in enumerate(plans) if tokens_of(plan, "big") > 24)
    retry = plans[failed_at + 1]
    for i in range(6):  # each stream recomputes its whole context (past the big one's 12-token cap) in one step
        failed_end = max(seg.end for seg in plans[failed_at].segments if seg.request_id.split("#")[0] == f"s{i}")
        assert tokens_of(retry, f"s{i}") == failed_end > 12, f"s{i}"
    assert 0 < tokens_of(retry, "big") <= 24
    assert_drained(llm)
