"""Property test of the scheduler and the checkpoint registry without a model: the same request
mixes as tests/engine/test_checkpoint_properties.py (arrival order, token budget, chunking, block
size, pool sizes, aborts, injected step faults, markers, automatic checkpoints), plus a host tier,
run by the scheduler against `FakeExecutor` (tests/engine/fake_executor.py), which applies each
step plan to symbols and checks every state row and KV slot a segment reads. Every completed
request equals the fake model's greedy run, every pool is consistent after each step and drained at
the end, and the executor's memory agrees with the registry's READY checkpoints and the host tier."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import EngineConfig
from forkpoint.engine.request import Request, RequestStatus
from forkpoint.engine.scheduler import Scheduler
from forkpoint.engine.step_planning import StepLimits
from forkpoint.sampling_params import SamplingParams
from forkpoint.step.plan import StepPlan
from tests.engine.fake_executor import FakeExecutor, reference
from tests.engine.test_checkpoint_properties import ANCHORS, request_strategy

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
VOCAB = 1000  # the fake model scores no prompt: any vocabulary size


def _prompt(spec: dict) -> tuple[list[int], list[int]]:
    """(token ids, marker positions) of a request spec, as the input processor makes them."""
    anchor = ANCHORS[spec["anchor"]]
    positions = [spec["inner_marker"]] if spec["inner_marker"] else []
    if spec["outer_marker"]:
        positions.append(len(anchor))
    return anchor + list(spec["suffix"]), positions


class _Driver:
    """The engine's loop around the scheduler (engine/engine.py), with `FakeExecutor` as the runner."""

    def __init__(self, config: EngineConfig, host_bytes: int) -> None:
        self.blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, config.checkpoint_pool_size)
        self.host = HostTier(host_bytes, 3, 1) if host_bytes else None  # a row: 3 bytes, a block: 1
        self.registry = CheckpointRegistry(self.states.checkpoints, self.blocks, self.host)
        self.scheduler = Scheduler(config, self.blocks, self.states, self.registry, vocab_size=VOCAB)
        self.executor = FakeExecutor(config.block_size)
        self.groups: dict[str, list[Request]] = {}
        self.finished: dict[str, list[Request]] = {}
        self.now = 0.0
        self.steps = 0
        self.limits: StepLimits | None = None  # after an "oom" fault: the caps of engine/memory_retry.py

    def add(self, request_id: str, spec: dict) -> None:
        tokens, positions = _prompt(spec)
        params = dataclasses.replace(PARAMS, n=spec["n"])
        if params.n > 1 and len(tokens) - 1 not in positions:
            positions.append(len(tokens) - 1)  # siblings share the prompt through one checkpoint
        hasher = PrefixHasher(tokens, self.blocks.block_size)
        sequences = [Request(f"{request_id}#{i}" if params.n > 1 else request_id, request_id, i, tokens,
                             tuple(sorted(positions)), params, self.now, hasher, None) for i in range(params.n)]
        self.groups[request_id] = sequences
        for sequence in sequences:
            self.scheduler.add(sequence, self.now)

    def abort(self, request_id: str) -> None:
        for sequence in self.groups.pop(request_id, []):
            if not sequence.is_finished:
                self.scheduler.finish(sequence, "abort", now=self.now)

    def step(self, fault_at: int | None, fault_in: str) -> None:
        """One engine step; the `fault_at`-th step with work fails in `fault_in`: "runner" (before
        the runner applied the plan's device writes), "forward" (after), or "oom" (after the whole
        forward wrote its state rows and KV, out of memory: its sequences are requeued and every
        later step is capped at a third of the token budget and one sequence)."""
        self.now += 0.01
        step = self.scheduler.schedule(self.now, self.limits)
        if step.empty:
            self._collect()
            return
        self.steps += 1
        if self.steps - 1 == fault_at and fault_in == "oom":
            self.executor.execute(step.plan)
            self.scheduler.requeue([step])
            budget = max(1, self.scheduler.config.max_num_batched_tokens // 3)
            self.limits = StepLimits(budget, 1, max_chunk=max(1, budget // 2))
            self._collect()
            return
        if self.steps - 1 == fault_at:
            if fault_in == "forward":
                self.executor.apply(step.plan)
            for request in self.scheduler.fail(step):
                self.abort(request.parent_id)
            self._collect()
            return
        tokens = self.executor.execute(step.plan)
        self.scheduler.commit(step)
        sampled = [s for s in step.plan.ordered() if s.samples]
        by_id = {r.request_id: r for r in step.requests}
        for segment, token in zip(sampled, tokens):
            request = by_id[segment.request_id]
            if request.is_finished:
                continue
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.params.max_tokens:
                self.scheduler.finish(request, "length", keep_turn_end=True, now=self.now)
        self._collect()

    def _collect(self) -> None:
        for request_id, sequences in list(self.groups.items()):
            if all(s.is_finished for s in sequences):
                self.finished[request_id] = self.groups.pop(request_id)

    def check_integrity(self) -> None:
        """engine.check_integrity's bookkeeping checks."""
        self.scheduler.check_integrity()
        self.states.check_integrity()
        holders = self.scheduler.running + [r for r, _, _ in self.scheduler.releasing]
        expected = Counter(b for r in holders for b in r.blocks) + self.registry.block_refs()
        self.blocks.check_integrity(dict(expected))
        slots = [r.slot for r in holders]
        assert None not in slots and len(set(slots)) == len(slots) == self.states.requests.num_used
        assert all(r.slot is None and not r.blocks for r in self.scheduler.waiting)
        assert all(r.status is RequestStatus.RUNNING for r in self.scheduler.running)
        if self.host is not None:
            self.host.check_integrity()

    def check_memory(self) -> None:
        """After the last plan's writes: each READY checkpoint's row and blocks hold its prefix, and
        the executor holds exactly the host tier's entries."""
        first, writes = self.registry.take_writes()
        self.executor.apply(StepPlan(writes=writes, first_write=first))
        for checkpoint in self.registry:
            if not checkpoint.ready:
                continue
            assert len(self.executor.rows[checkpoint.slot]) == checkpoint.state_tokens
            row = self.executor.rows[checkpoint.slot]
            for position in range(checkpoint.state_tokens):
                slot = self.executor._slot(checkpoint.blocks, position)
                assert self.executor.kv[slot] == (position, row[position])
        held = self.host.entry_ids() if self.host is not None else set()
        assert set(self.executor.host) == held


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples each run
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=7),
    budget=st.integers(6, 64),
    chunk_cap=st.one_of(st.none(), st.integers(4, 20)),
    block_size=st.sampled_from([4, 8, 16]),
    spare_blocks=st.integers(1, 30),
    checkpoint_slots=st.integers(1, 4),
    host_bytes=st.sampled_from([0, 0, 12, 40]),
    fault_at=st.one_of(st.none(), st.integers(0, 10)),
    fault_in=st.sampled_from(["runner", "forward", "oom"]),  # before the runner applied the writes, after, or OOM
    auto_min_tokens=st.sampled_from([4, 12, 10_000]),  # 10_000: automatic checkpoints never placed
)
def test_scheduler_plans_always_read_the_right_states(requests, budget, chunk_cap, block_size, spare_blocks,
                                                      checkpoint_slots, host_bytes, fault_at, fault_in,
                                                      auto_min_tokens):
    longest = max(len(ANCHORS[r["anchor"]]) + len(r["suffix"]) for r in requests) + PARAMS.max_tokens + 1
    config = EngineConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=chunk_cap,
                          block_size=block_size, num_kv_blocks=-(-longest // block_size) + spare_blocks,
                          checkpoint_pool_size=checkpoint_slots, max_num_seqs=4,
                          auto_checkpoint_min_tokens=auto_min_tokens, checkpoint_host_bytes=host_bytes)
    driver = _Driver(config, host_bytes)
    aborted = set()
    for step in range(400):
        for index, spec in enumerate(requests):
            if spec["arrival"] == step:
                driver.add(f"r{index}", spec)
            if spec["abort_at"] == step and f"r{index}" not in driver.finished:
                driver.abort(f"r{index}")
                aborted.add(f"r{index}")
        before = set(driver.groups)
        driver.step(fault_at, fault_in)
        aborted.update(before - set(driver.groups) - set(driver.finished))
        driver.check_integrity()
        if step > 12 and not driver.groups:
            break
    else:
        raise AssertionError("the scheduler did not drain")
    done = {rid: seqs for rid, seqs in driver.finished.items() if all(s.finish_reason == "length" for s in seqs)}
    for request_id, sequences in done.items():
        for sequence in sequences:
            assert sequence.output_token_ids == reference(sequence.prompt_token_ids, PARAMS.max_tokens), request_id
    assert set(done) | aborted >= {f"r{i}" for i in range(len(requests))}
    assert driver.states.requests.num_used == 0 and driver.registry.num_pending == 0
    assert driver.blocks.num_used == len({b for c in driver.registry for b in c.blocks})
    driver.check_memory()


def _three(inner_marker: int) -> list[dict]:
    spec = {"inner_marker": 0, "outer_marker": False, "suffix": [0], "arrival": 0, "abort_at": None, "n": 1}
    return [dict(spec, anchor=0), dict(spec, anchor=0), dict(spec, anchor=1, inner_marker=inner_marker)]


def test_a_request_running_alone_evicts_a_checkpoint_only_queued_requests_wait_on():
    """Found by the property test: the 18-token request, alone and short of one block, ended 'length' with
    no output while a READY checkpoint held two blocks for a queued request that waited on it."""
    test_scheduler_plans_always_read_the_right_states.hypothesis.inner_test(
        requests=_three(0), budget=6, chunk_cap=4, block_size=8, spare_blocks=1, checkpoint_slots=1, host_bytes=0,
        fault_at=None, fault_in="runner", auto_min_tokens=4)


def test_an_idle_engine_frees_what_only_queued_requests_wait_on():
    """Found by the property test: nothing running, the queue's head (restored from the host tier) short of
    a block held by a READY checkpoint that the request behind it waited on: every step was empty."""
    test_scheduler_plans_always_read_the_right_states.hypothesis.inner_test(
        requests=_three(5), budget=7, chunk_cap=4, block_size=8, spare_blocks=1, checkpoint_slots=2, host_bytes=12,
        fault_at=None, fault_in="runner", auto_min_tokens=4)
