"""Continuous-batching scheduler with checkpoint producers and consumers.

Each `schedule()` returns one `StepPlan`: running requests first (decodes and prefill chunks, in
order), then waiting requests in arrival order under the token and sequence budgets. A waiting
request whose longest matching checkpoint is still being produced is *deferred*: it keeps its
place in the queue and later requests are scheduled past it. It wakes in the step in which the
checkpoint is ready, or in the same step when the producer's chunk reaches the checkpoint (then
its segment runs in a later phase of the same forward). When KV blocks run out, idle checkpoints
are evicted first, then the most recently admitted running request is preempted (recompute).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import Checkpoint, CheckpointRegistry
from forkpoint.cache.state_pool import ZERO_SLOT, StatePool
from forkpoint.config import EngineConfig
from forkpoint.engine.request import Request, RequestStatus

logger = logging.getLogger("forkpoint.checkpoints")


@dataclass(frozen=True)
class PlannedSegment:
    """Tokens [start, end) of `request` run from state row `initial_slot`; the final state goes to
    each row of `dest_slots`. phase -1 marks a decode (single token from and to the private slot)."""

    request: Request
    start: int
    end: int
    initial_slot: int
    dest_slots: tuple[int, ...]
    phase: int
    samples: bool


@dataclass(frozen=True)
class KVCopy:
    """Copy-on-write of a shared partial block: the first `num_tokens` slots of src into dst.

    A step's copies apply in list order, after the step's KV write: a later copy may read a block that
    an earlier one wrote (a same-step consumer of a producer that itself resumed inside that block)."""

    src_block: int
    dst_block: int
    num_tokens: int


@dataclass
class StepPlan:
    segments: list[PlannedSegment] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)
    written: list[tuple[Checkpoint, Request]] = field(default_factory=list)
    consumed: list[Checkpoint] = field(default_factory=list)  # pinned for this step
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (cannot ever fit)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.segments


@dataclass
class SchedulerStats:
    requests_deferred: int = 0
    producer_promotions: int = 0
    checkpoint_hits: int = 0
    checkpoint_wait_timeouts: int = 0
    deferral_wait_s_total: float = 0.0
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_pool: BlockPool, state_pool: StatePool,
                 registry: CheckpointRegistry | None) -> None:
        self.config = config
        self.blocks = block_pool
        self.states = state_pool
        self.registry = registry
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.block_size = block_pool.block_size
        self.chunk_cap = config.long_prefill_token_threshold or config.max_num_batched_tokens

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Leave the engine: free the slot and blocks, hand unwritten checkpoints on."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.states.requests.free(request.slot)
            request.slot = None
        if request.blocks:
            self.blocks.release(request.blocks)
            request.blocks = []
        for checkpoint in request.producing:
            self.registry.orphan(checkpoint)
        request.producing = []
        if request.waiting_on is not None:
            self._stop_waiting(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    # ------------------------------------------------------------------ scheduling
    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.monotonic() if now is None else now
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        written_phase: dict[int, int] = {}  # id(checkpoint) -> phase of the segment writing it
        preempted = False

        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            count = min(request.num_tokens - request.num_computed_tokens, budget, self.chunk_cap)
            if not self._grow_blocks(request, request.num_computed_tokens + count):
                if request.status is RequestStatus.FINISHED:
                    plan.finished.append(request)
                preempted = True
                continue
            budget -= count
            self._plan_chunk(plan, request, request.num_computed_tokens, count, None, written_phase)

        if not preempted:
            for request in list(self.waiting):
                if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                admitted = self._try_admit(plan, request, budget, now, written_phase)
                if admitted is None:
                    break  # out of memory: keep FCFS order
                budget -= admitted

        for segment in plan.segments:
            plan.num_tokens += segment.end - segment.start
        return plan

    def _grow_blocks(self, request: Request, num_tokens: int) -> bool:
        """Give a running request blocks for `num_tokens` tokens, evicting idle checkpoints and then
        preempting later requests. False when `request` itself had to be preempted."""
        need = -(-num_tokens // self.block_size) - len(request.blocks)
        while need > self.blocks.num_free:
            if self.registry is not None and self.registry.evict_one():
                continue
            if self.running == [request]:
                # alone with every evictable block freed: recomputing could never fit, so stop here
                self.finish(request, "length")
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        if need > 0:
            request.blocks.extend(self.blocks.allocate(need))
        return True

    def _lookup(self, request: Request) -> tuple[Checkpoint | None, Checkpoint | None]:
        """(longest registered checkpoint matching the prompt, longest *ready* one)."""
        if self.registry is None:
            return None, None
        prompt_len = len(request.prompt_token_ids)
        longest = ready = None
        for length in sorted(self.registry.lengths, reverse=True):
            if length >= prompt_len:
                continue
            checkpoint = self.registry.get(request.hasher.prefix_hash(length))
            if checkpoint is None:
                continue
            longest = longest or checkpoint
            if checkpoint.ready:
                ready = checkpoint
                break
        return longest, ready

    def _try_admit(self, plan: StepPlan, request: Request, budget: int, now: float,
                   written_phase: dict[int, int]) -> int | None:
        """Admit `request` into this step. Returns tokens scheduled, 0 when deferred, None when out of memory."""
        longest, ready = self._lookup(request)
        source = ready
        if longest is not None and not longest.ready:
            if longest.producer is None:
                source = ready  # orphan: this request is promoted to produce it (below)
            elif id(longest) in written_phase:
                source = longest  # same-step pairing: the producer's phase writes it before we read
            elif not request.gave_up_waiting:
                if now - (request.deferred_since or now) > self.config.checkpoint_wait_s:
                    request.gave_up_waiting = True
                    self.stats.checkpoint_wait_timeouts += 1
                    logger.debug("wait bound: %s computes the %d-token prefix itself", request.request_id,
                                 longest.num_tokens)
                    self._stop_waiting(request, now)
                else:
                    self._wait_on(request, longest, now)
                    return 0

        if self.states.requests.num_free == 0:
            return None
        start = source.num_tokens if source is not None else 0
        count = min(request.num_tokens - start, budget, self.chunk_cap)
        shared = [] if source is None else (source.blocks if source.ready else source.producer_blocks)
        full = start // self.block_size
        own_needed = -(-(start + count) // self.block_size) - full
        if source is not None:
            source.pins += 1  # protects it from the evictions below
        while own_needed > self.blocks.num_free:
            if self.registry is None or not self.registry.evict_one():
                if source is not None:
                    source.pins -= 1
                return None

        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.slot = self.states.requests.allocate()
        request.blocks = list(shared[:full])
        self.blocks.incref(request.blocks)
        request.blocks.extend(self.blocks.allocate(own_needed))
        request.num_computed_tokens = start
        if source is not None:
            request.num_cached_tokens = start
            self.registry.touch(source)
            plan.consumed.append(source)
            self.stats.checkpoint_hits += 1
            if start % self.block_size:
                plan.kv_copies.append(KVCopy(shared[full], request.blocks[full], start % self.block_size))
        self._claim_checkpoints(request, start, now)
        if request.waiting_on is not None:
            self._stop_waiting(request, now)
        self._plan_chunk(plan, request, start, count, source, written_phase)
        return count

    def _wait_on(self, request: Request, checkpoint: Checkpoint, now: float) -> None:
        if request.waiting_on is checkpoint:
            return
        if request.waiting_on is not None:
            self._stop_waiting(request)  # switching checkpoints: the wait goes on, account it once at the end
        request.waiting_on = checkpoint
        checkpoint.waiters += 1
        if request.deferred_since is None:
            request.deferred_since = now
        if not request.was_deferred:
            request.was_deferred = True
            self.stats.requests_deferred += 1
            logger.debug("deferred: %s waits for the %d-token checkpoint of %s", request.request_id,
                         checkpoint.num_tokens, checkpoint.producer)

    def _stop_waiting(self, request: Request, now: float | None = None) -> None:
        checkpoint = request.waiting_on
        if checkpoint is not None:
            request.waiting_on = None
            checkpoint.waiters -= 1
            if not checkpoint.ready and checkpoint.producer is None and checkpoint.waiters == 0:
                self.registry.remove(checkpoint)
        if request.deferred_since is not None and now is not None:
            self.stats.deferral_wait_s_total += now - request.deferred_since
            request.deferred_since = None

    def _claim_checkpoints(self, request: Request, start: int, now: float) -> None:
        """Register (or adopt, when orphaned) every checkpoint this request will pass."""
        if self.registry is None:
            return
        for position in request.checkpoint_positions:
            if position <= start:
                continue
            key = request.hasher.prefix_hash(position)
            checkpoint = self.registry.get(key)
            if checkpoint is None:
                checkpoint = self.registry.register(key, position, request.request_id, now)
                if checkpoint is None:
                    logger.debug("no checkpoint slot free for %s at %d: a miss", request.request_id, position)
                    continue  # checkpoint pool full of pinned entries: a miss, never an error
                logger.debug("registered: %d-token checkpoint, producer %s", position, request.request_id)
            elif checkpoint.ready or checkpoint.producer is not None:
                continue
            else:
                self._promote(request, checkpoint)
                continue
            request.producing.append(checkpoint)
        # orphans this request matched on its way (prefix of its prompt without a marker) are adopted too
        for checkpoint in self._orphans_on_path(request, start):
            self._promote(request, checkpoint)
        request.producing.sort(key=lambda c: c.num_tokens)

    def _promote(self, request: Request, checkpoint: Checkpoint) -> None:
        checkpoint.producer = request.request_id
        self.stats.producer_promotions += 1
        request.producing.append(checkpoint)
        logger.debug("promoted: %s now produces the %d-token checkpoint", request.request_id, checkpoint.num_tokens)

    def _orphans_on_path(self, request: Request, start: int) -> list[Checkpoint]:
        prompt_len = len(request.prompt_token_ids)
        found = []
        for length in self.registry.lengths:
            if start < length <= prompt_len:
                checkpoint = self.registry.get(request.hasher.prefix_hash(length))
                if checkpoint is not None and not checkpoint.ready and checkpoint.producer is None:
                    found.append(checkpoint)
        return found

    def _plan_chunk(self, plan: StepPlan, request: Request, start: int, count: int,
                    source: Checkpoint | None, written_phase: dict[int, int]) -> None:
        """Split tokens [start, start+count) at this request's checkpoints into segments."""
        end = start + count
        if source is not None:
            initial, phase = source.slot, written_phase.get(id(source), -1) + 1
        else:
            initial, phase = (ZERO_SLOT if start == 0 else request.slot), 0
        cuts = [c for c in request.producing if start < c.num_tokens <= end]
        lo = start
        for checkpoint in cuts:
            hi = checkpoint.num_tokens
            dests = (checkpoint.slot, request.slot) if hi == end else (checkpoint.slot,)
            plan.segments.append(PlannedSegment(request, lo, hi, initial, dests, phase, hi == request.num_tokens))
            written_phase[id(checkpoint)] = phase
            checkpoint.producer_blocks = request.blocks
            plan.written.append((checkpoint, request))
            lo, initial, phase = hi, checkpoint.slot, phase + 1
        if lo < end:
            is_decode = end - lo == 1 and initial == request.slot and phase == 0 and lo > 0
            plan.segments.append(PlannedSegment(request, lo, end, initial, (request.slot,),
                                                -1 if is_decode else phase, end == request.num_tokens))
