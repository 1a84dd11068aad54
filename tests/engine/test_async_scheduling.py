"""Asynchronous scheduling (`async_scheduling=True`) against the synchronous engine.

The same workload, driven step by step on two engines built alike (float32 CPU, tiny model), must give
identical tokens and logprobs (within 1e-5) for greedy and seeded sampling with stop tokens, stop
strings, max_tokens, min_tokens, penalties, logit_bias, bad words (synchronous steps), n = 2,
checkpoints and aborts; every step
keeps the engine's integrity, steps do run ahead (fed from the device), and the pools drain. A fault
injected at any step, overlapped ones included, ends that step's requests and leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.config import EngineConfig
from forkpoint.engine.engine import LLMEngine, StepFailed
from tests.tiny_models import token_words

MARK = "<|mamba_checkpoint|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3, max_tokens=9, ignore_eos=True, logprobs=2)


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: str
    params: SamplingParams
    abort_at: int | None = None


class CountingRunner:
    """Wraps `engine.runner.execute`: counts the steps fed from the device; raises at call `fault_at`."""

    def __init__(self, engine: LLMEngine) -> None:
        self._execute = engine.runner.execute
        self.calls = 0
        self.fed = 0
        self.fault_at: int | None = None
        engine.runner.execute = self

    def __call__(self, plan, **kwargs):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fault_at:
            raise RuntimeError(f"injected fault at step {call}")
        self.fed += kwargs.get("feed") is not None
        return self._execute(plan, **kwargs)


def drive(engine: LLMEngine, arrivals: list[Arrival]) -> tuple[dict[str, list], set[str]]:
    """Run the arrivals step by step, aborting as asked; integrity after every step. Returns
    (finished outputs by id as (token ids, logprobs, finish reason, text) per completion, failed ids)."""
    finished: dict[str, list] = {}
    failed: set[str] = set()
    for step in range(400):
        for arrival in arrivals:
            if arrival.step == step:
                engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
            if arrival.abort_at == step:
                engine.abort_request(arrival.request_id)
                engine.check_integrity()
        try:
            outputs = engine.step()
        except StepFailed as failure:
            assert failure.request_ids and "injected fault" in str(failure.cause)
            failed.update(failure.request_ids)
            outputs = failure.outputs
        for output in outputs:
            if output.finished:
                finished[output.request_id] = [(c.token_ids, c.logprobs, c.finish_reason, c.text)
                                               for c in output.outputs]
        engine.check_integrity()
        if step >= max(a.step for a in arrivals) and not engine.has_unfinished_requests():
            return finished, failed
    raise AssertionError("the engine did not drain")


def assert_same(ours: dict[str, list], theirs: dict[str, list]) -> None:
    assert ours.keys() == theirs.keys()
    for request_id, completions in ours.items():
        for (tokens, logprobs, reason, text), (ref_tokens, ref_logprobs, ref_reason, ref_text) in zip(
                completions, theirs[request_id], strict=True):
            assert (tokens, reason, text) == (ref_tokens, ref_reason, ref_text), request_id
            if ref_logprobs is None:
                assert logprobs is None
                continue
            for a, b in zip(logprobs, ref_logprobs, strict=True):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a), request_id


def assert_drained(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and not engine.scheduler.in_flight
    metrics = llm.metrics()
    if engine.registry is not None:
        engine.registry.evict_all_idle()
        metrics = llm.metrics()
        assert metrics["checkpoint_slots_used"] == 0
    assert metrics["kv_blocks_used"] == 0 and metrics["state_slots_used"] == 0


@pytest.fixture(scope="module")
def arrivals(model_dir) -> list[Arrival]:
    """Decodes of different lengths; stops by token and by string taken from a greedy run, so they
    fall in the middle of overlapped decoding; arrivals and an abort mid-decode."""
    probe = LLM(str(model_dir), enable_checkpoints=False)
    prompts = [token_words(10 + i, 5 + 3 * i) for i in range(6)]
    greedy = [o.outputs[0] for o in probe.generate(prompts, dataclasses.replace(GREEDY, max_tokens=12),
                                                    use_tqdm=False)]
    stop_token = greedy[3].token_ids[5]  # not among its first five
    stop_text = probe.get_tokenizer().decode(greedy[2].token_ids[2:4])  # two words, no earlier match
    return [
        Arrival(0, "greedy", prompts[0], GREEDY),
        Arrival(0, "stop-token", prompts[3], dataclasses.replace(GREEDY, max_tokens=12, ignore_eos=False,
                                                                  stop_token_ids=[stop_token])),
        Arrival(0, "stop-string", prompts[2], dataclasses.replace(GREEDY, max_tokens=12, stop=[stop_text])),
        Arrival(0, "seeded-n2", prompts[1], dataclasses.replace(SEEDED, n=2, max_tokens=11)),
        Arrival(1, "penalties", prompts[4], dataclasses.replace(
            SEEDED, seed=5, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
            logit_bias={7: 2.0}, max_tokens=13)),
        Arrival(0, "greedy-penalties", prompts[1], dataclasses.replace(GREEDY, frequency_penalty=1.5, max_tokens=12)),
        Arrival(0, "min-tokens", prompts[4], dataclasses.replace(GREEDY, ignore_eos=False, max_tokens=12, min_tokens=6,
                                                                 stop_token_ids=[greedy[4].token_ids[1]])),
        Arrival(0, "aborted", prompts[5], dataclasses.replace(GREEDY, max_tokens=30), abort_at=7),
        Arrival(8, "bad-words", prompts[0], dataclasses.replace(  # its steps run synchronously
            GREEDY, max_tokens=5, bad_words=[probe.get_tokenizer().decode(greedy[0].token_ids[1:2])])),
        Arrival(9, "late", f"{token_words(40, 20)} {MARK} {token_words(41, 4)}", dataclasses.replace(
            GREEDY, max_tokens=6)),
        Arrival(10, "late-reader", f"{token_words(40, 20)} {MARK} {token_words(42, 6)}", dataclasses.replace(
            SEEDED, max_tokens=7, min_tokens=7, ignore_eos=False)),
    ]


@pytest.mark.parametrize("engine_kwargs", [dict(enable_checkpoints=False), dict(),
                                           dict(num_kv_blocks=40, block_size=4, max_num_seqs=4)],
                         ids=["plain", "checkpoints", "small_pools"])
def test_async_scheduling_gives_the_outputs_of_synchronous_steps(model_dir, arrivals, engine_kwargs):
    sync = LLM(str(model_dir), **engine_kwargs)
    expected, none_failed = drive(sync.engine, arrivals)
    assert not none_failed and "aborted" not in expected and len(expected) == len(arrivals) - 1
    for request_id in ("stop-token", "stop-string"):  # stopped before max_tokens, while decoding
        tokens, _, reason, _ = expected[request_id][0]
        assert reason == "stop" and 1 < len(tokens) < 12

    llm = LLM(str(model_dir), async_scheduling=True, **engine_kwargs)
    runner = CountingRunner(llm.engine)
    got, none_failed = drive(llm.engine, arrivals)
    assert not none_failed
    assert_same(got, expected)
    assert runner.fed > 5  # steps did run ahead of the step before
    assert_drained(llm)
    # the same workload again on the used engine (checkpoints and turn ends from the first round)
    again_sync, _ = drive(sync.engine, [dataclasses.replace(a, request_id=a.request_id + "'") for a in arrivals])
    again, _ = drive(llm.engine, [dataclasses.replace(a, request_id=a.request_id + "'") for a in arrivals])
    assert_same(again, again_sync)
    assert_drained(llm)


def test_a_fault_at_any_step_of_async_scheduling_leaves_nothing_behind(model_dir, arrivals):
    chosen = ("greedy", "stop-token", "seeded-n2", "penalties", "aborted")
    arrivals = [dataclasses.replace(a, params=dataclasses.replace(a.params, max_tokens=min(a.params.max_tokens, 8)),
                                    abort_at=a.abort_at and 4) for a in arrivals if a.request_id in chosen]
    fresh = LLM(str(model_dir), async_scheduling=True)
    expected, none_failed = drive(fresh.engine, arrivals)
    assert not none_failed
    num_steps = fresh.metrics()["steps"]

    llm = LLM(str(model_dir), async_scheduling=True)
    runner = CountingRunner(llm.engine)
    overlapped_faults = 0
    for fault_at in range(num_steps):
        runner.calls, runner.fault_at, runner.fed = 0, fault_at, 0
        finished, failed = drive(llm.engine, arrivals)
        assert failed, f"the fault at step {fault_at} ended no request"
        overlapped_faults += runner.fed > 0 and fault_at > 3
        ended = {a.request_id for a in arrivals if a.abort_at is None}
        assert failed.isdisjoint(finished) and ended <= failed | set(finished)
        assert_same(finished, {request_id: expected[request_id] for request_id in finished})
        assert_drained(llm)
    assert overlapped_faults > 3


def test_async_scheduling_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size=1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
