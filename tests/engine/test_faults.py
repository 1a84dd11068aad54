"""Fault injection: a step that raises (in the runner, or inside a layer of the model) at any point of
a workload ends the requests in that step with an error and leaves nothing behind.

For every scenario and every step k of its clean run: the runner raises at step k; the requests of
that step end (offline: `StepFailed` reaches the caller), the engine's integrity holds after every
step, other requests finish with the outputs of a fresh engine, the pools drain, and the same
workload afterwards gives exactly the outputs of a fresh engine (float32 CPU, tiny model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.engine.engine import LLMEngine, StepFailed
from tests.tiny_models import token_words

MARK = "<|mamba_checkpoint|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: str
    params: SamplingParams = GREEDY


@dataclass(frozen=True)
class Scenario:
    name: str
    arrivals: tuple[Arrival, ...]
    engine_kwargs: dict


ANCHOR = token_words(1, 21)
SCENARIOS = [
    Scenario("one_to_n_same_step", tuple(
        Arrival(0, f"r{i}", f"{ANCHOR} {MARK} {token_words(10 + i, 3 + i)}") for i in range(4)),
        dict(max_num_batched_tokens=256)),
    Scenario("deferred_consumers", tuple(
        Arrival(i // 2, f"r{i}", f"{ANCHOR} {MARK} {token_words(20 + i, 4)}") for i in range(4)),
        dict(max_num_batched_tokens=8)),  # the 21-token prefix takes three steps: consumers wait
    Scenario("decodes_beside_prefills", (
        Arrival(0, "early", token_words(30, 6), dataclasses.replace(GREEDY, max_tokens=6)),
        Arrival(2, "late", f"{ANCHOR} {MARK} {token_words(31, 5)}"),
        Arrival(3, "later", f"{ANCHOR} {token_words(32, 2)}"),
    ), dict(max_num_batched_tokens=64)),
    Scenario("preemption", tuple(
        Arrival(0, f"r{i}", f"{ANCHOR} {MARK} {token_words(40 + i, 6)}", dataclasses.replace(GREEDY, max_tokens=5))
        for i in range(3)), dict(num_kv_blocks=7, block_size=8, max_num_batched_tokens=64)),
    Scenario("n2_siblings", (
        Arrival(0, "pair", f"{ANCHOR} {token_words(50, 4)}", dataclasses.replace(GREEDY, n=2)),
        Arrival(1, "other", f"{ANCHOR} {MARK} {token_words(51, 3)}"),
    ), dict(max_num_batched_tokens=16)),
    Scenario("nested_markers", tuple(
        Arrival(i, f"r{i}", f"{token_words(2, 7)} {MARK} {token_words(3, 9)} {MARK} {token_words(60 + i, 3)}")
        for i in range(3)), dict(max_num_batched_tokens=12)),
]


class FaultyRunner:
    """Wraps `engine.runner.execute`: raises RuntimeError at call `fault_at` (None: never)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._execute = engine.runner.execute
        self.calls = 0
        self.fault_at: int | None = None
        engine.runner.execute = self

    def __call__(self, plan):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fault_at:
            raise RuntimeError(f"injected fault at step {call}")
        return self._execute(plan)


def drive(engine: LLMEngine, scenario: Scenario) -> tuple[dict[str, list], set[str]]:
    """Run the scenario's arrivals step by step. Returns (finished outputs by id, failed ids)."""
    finished: dict[str, list] = {}
    failed: set[str] = set()
    for step in range(300):
        for arrival in scenario.arrivals:
            if arrival.step == step:
                engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
        try:
            outputs = engine.step()
        except StepFailed as failure:
            assert failure.request_ids and "injected fault" in str(failure.cause)
            failed.update(failure.request_ids)
            outputs = failure.outputs
        for output in outputs:
            if output.finished:
                finished[output.request_id] = [(c.token_ids, c.logprobs) for c in output.outputs]
        engine.check_integrity()
        if step >= max(a.step for a in scenario.arrivals) and not engine.has_unfinished_requests():
            return finished, failed
    raise AssertionError(f"{scenario.name}: the engine did not drain")


def assert_drained(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    engine.registry.evict_all_idle()  # an idle engine can free every checkpoint
    metrics = llm.metrics()
    assert metrics["kv_blocks_used"] == 0 and metrics["state_slots_used"] == 0
    assert metrics["checkpoint_slots_used"] == 0 and len(engine.registry) == 0


def assert_outputs_equal(ours: list, theirs: list, label: str) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == ref_tokens, label
        for a, b in zip(logprobs, ref_logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a), label


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_a_fault_at_any_step_leaves_nothing_behind(model_dir, scenario):
    fresh = LLM(str(model_dir), **scenario.engine_kwargs)
    expected, none_failed = drive(fresh.engine, scenario)
    assert not none_failed and len(expected) == len(scenario.arrivals)
    num_steps = fresh.metrics()["steps"]

    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    runner = FaultyRunner(llm.engine)
    for fault_at in range(num_steps):
        runner.calls, runner.fault_at = 0, fault_at
        finished, failed = drive(llm.engine, scenario)
        assert failed, f"{scenario.name}: the fault at step {fault_at} ended no request"
        assert failed.isdisjoint(finished) and failed | set(finished) == {a.request_id for a in scenario.arrivals}
        for request_id, outputs in finished.items():  # the requests outside the failed step are unharmed
            assert_outputs_equal(outputs, expected[request_id], f"{scenario.name}@{fault_at}:{request_id}")
        assert_drained(llm)
        runner.fault_at = None
        again, none_failed = drive(llm.engine, scenario)
        assert not none_failed
        for request_id, outputs in again.items():
            assert_outputs_equal(outputs, expected[request_id], f"{scenario.name} after fault {fault_at}")
        assert_drained(llm)
    assert llm.metrics()["failed_steps"] == num_steps


def raise_in_layer(llm: LLM, layer_id: int, after_calls: int) -> Callable[[], None]:
    """Make the MLP of decoder layer `layer_id` raise at its call `after_calls`; returns the remover."""
    calls = []

    def hook(module, inputs):
        calls.append(1)
        if len(calls) - 1 == after_calls:
            raise RuntimeError("injected fault inside a layer")

    return llm.engine.runner.model.model.layers[layer_id].mlp.register_forward_pre_hook(hook).remove


@pytest.mark.parametrize("after_calls", [0, 1, 2])
def test_a_model_that_raises_inside_a_layer(model_dir, after_calls):
    """Layers before the failing one have written request and checkpoint state rows: all of it is
    discarded with the step, and ready checkpoints (never written by a step) stay valid."""
    scenario = SCENARIOS[1]
    fresh = LLM(str(model_dir), **scenario.engine_kwargs)
    expected, _ = drive(fresh.engine, scenario)
    llm = LLM(str(model_dir), **scenario.engine_kwargs)
    remove = raise_in_layer(llm, layer_id=2, after_calls=after_calls)  # layers 0, 1 have already run
    finished, failed = drive(llm.engine, scenario)
    remove()
    assert failed
    for request_id, outputs in finished.items():
        assert_outputs_equal(outputs, expected[request_id], request_id)
    llm.engine.check_integrity()
    again, none_failed = drive(llm.engine, scenario)  # ready checkpoints left behind are reused, exactly
    assert not none_failed and again.keys() == expected.keys()
    for request_id, outputs in again.items():
        assert_outputs_equal(outputs, expected[request_id], f"after the layer fault: {request_id}")
    assert_drained(llm)


def test_offline_generate_raises_and_the_engine_stays_usable(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=64)
    prompts = [f"{ANCHOR} {MARK} {token_words(70 + i, 3)}" for i in range(3)]
    expected = LLM(str(model_dir), max_num_batched_tokens=64).generate(prompts, GREEDY, use_tqdm=False)
    runner = FaultyRunner(llm.engine)
    runner.fault_at = 1  # the consumers' step (the prefix and the producer ran in step 0)
    with pytest.raises(StepFailed, match="injected fault"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_drained(llm)
    assert llm.metrics()["requests_failed"] >= 1
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


class FaultyMethod:
    """Wraps `owner.<name>` (an instance attribute from then on): raises RuntimeError at call `fault_at`
    (None: never), before the original runs."""

    def __init__(self, owner, name: str) -> None:
        self._original = getattr(owner, name)
        self.name = name
        self.calls = 0
        self.fault_at: int | None = None
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fault_at:
            raise RuntimeError(f"injected fault in {self.name} at call {call}")
        return self._original(*args, **kwargs)


@pytest.fixture(scope="module")
def decodes_beside_prefills(model_dir) -> dict[str, list]:
    """A fresh engine's outputs of SCENARIOS[2] (decodes beside prefills and a checkpoint)."""
    expected, _ = drive(LLM(str(model_dir), **SCENARIOS[2].engine_kwargs).engine, SCENARIOS[2])
    return expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("target", ["commit", "append_token"])
def test_a_fault_in_commit_or_output_work_does_not_wedge_the_engine(model_dir, decodes_beside_prefills, target,
                                                                     async_scheduling):
    """A raise in `scheduler.commit` or in the output work after it (`output_processor.append_token`)
    at its middle and last call: the step's prompts fail, the others finish as on a fresh engine,
    integrity holds, and the engine then serves the same workload with a fresh engine's outputs (no
    "a step is still in flight" for ever)."""
    scenario, expected = SCENARIOS[2], decodes_beside_prefills
    llm = LLM(str(model_dir), **dict(scenario.engine_kwargs, async_scheduling=async_scheduling))
    owner = llm.engine.scheduler if target == "commit" else llm.engine.output_processor
    fault = FaultyMethod(owner, target)
    drive(llm.engine, scenario)
    for fault_at in (fault.calls // 2, fault.calls - 1):
        fault.calls, fault.fault_at = 0, fault_at
        finished, failed = drive(llm.engine, scenario)
        assert failed, f"the fault at call {fault_at} of {target} ended no request"
        assert_survived(llm, scenario, expected, fault, finished, failed, f"{target}@{fault_at}")


def assert_survived(llm: LLM, scenario: Scenario, expected: dict[str, list], fault: FaultyMethod,
                    finished: dict[str, list], failed: set[str], label: str) -> None:
    """After a run of `scenario` with `fault` injected: its failed and finished requests split the arrivals,
    the finished ones equal a fresh engine's (`expected`), nothing is left held; then, the fault off, a clean
    run finishes every request with a fresh engine's outputs and leaves nothing held either."""
    assert failed.isdisjoint(finished) and failed | set(finished) == {a.request_id for a in scenario.arrivals}
    for request_id, outputs in finished.items():
        assert_outputs_equal(outputs, expected[request_id], f"{label}:{request_id}")
    assert_drained(llm)
    fault.fault_at = None
    again, none_failed = drive(llm.engine, scenario)
    assert not none_failed and again.keys() == expected.keys(), f"{label}: the clean run after the fault"
    for request_id, outputs in again.items():
        assert_outputs_equal(outputs, expected[request_id], f"{label}: the clean run after the fault")
    assert_drained(llm)


def drive_failing_all_on_raise(engine: LLMEngine, scenario: Scenario) -> tuple[dict[str, list], set[str]]:
    """`drive`, but a plain exception from `step` (a raise that ended no request: nothing was taken)
    is answered as the server's engine thread and the offline `LLM` answer it: every unfinished prompt is
    aborted and counts as failed."""
    real_step = engine.step
    aborted: set[str] = set()

    def step():
        try:
            return real_step()
        except StepFailed:
            raise
        except RuntimeError as error:
            assert "injected fault" in str(error)
            live = {a.request_id for a in scenario.arrivals if engine.sequences(a.request_id)}
            for request_id in live:
                engine.abort_request(request_id)
            aborted.update(live)
            return []

    engine.step = step
    try:
        finished, failed = drive(engine, scenario)
    finally:
        del engine.step
    return finished, failed | aborted


# the scheduler's own raise before it plans anything; one in the middle of planning (after earlier
# sequences took their blocks, slots and checkpoint pins); one in planning the step run ahead (async)
SCHEDULE_TARGETS = [(False, "schedule"), (True, "schedule"), (False, "_plan_chunk"), (True, "_plan_chunk"),
                    (False, "_try_admit"), (True, "schedule_ahead")]


@pytest.mark.parametrize("async_scheduling, target", SCHEDULE_TARGETS,
                         ids=[f"{'async' if a else 'sync'}-{t}" for a, t in SCHEDULE_TARGETS])
def test_a_fault_in_schedule_does_not_wedge_the_engine(model_dir, decodes_beside_prefills, target, async_scheduling):
    """A raise in `scheduler.schedule` (before it plans, or in the middle of planning a step) or in
    `schedule_ahead`, at the first calls of a clean run and a spread of the later ones: the requests it
    ends fail, the others finish as on a fresh engine, integrity holds after every step (no pin, slot or
    block of the half-planned step is left), and the engine then serves the same workload with a fresh
    engine's outputs."""
    scenario, expected = SCENARIOS[2], decodes_beside_prefills
    llm = LLM(str(model_dir), **dict(scenario.engine_kwargs, async_scheduling=async_scheduling))
    fault = FaultyMethod(llm.engine.scheduler, target)
    drive(llm.engine, scenario)
    assert fault.calls, f"the clean run never called {target}"
    # the first calls (admission, the first plans with pins) and a spread of the later ones: each position
    # costs two runs of the workload
    positions = sorted({*range(min(4, fault.calls)), *range(0, fault.calls, max(1, fault.calls // 4))})
    for fault_at in positions:
        fault.calls, fault.fault_at = 0, fault_at
        finished, failed = drive_failing_all_on_raise(llm.engine, scenario)
        assert fault.calls > fault_at, f"{target}: the fault at call {fault_at} was never reached"
        assert_survived(llm, scenario, expected, fault, finished, failed, f"{target}@{fault_at}")
