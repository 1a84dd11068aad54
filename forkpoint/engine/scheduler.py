"""Continuous-batching scheduler with checkpoint producers and consumers.

One step is `schedule()` -> the runner executes `step.plan` -> `commit(step)` (or `fail(step)`
when anything between raised, or `requeue(steps)` when it raised for lack of memory and the engine
retries it smaller: engine/memory_retry.py). Every pin, slot and block a step takes is released by
exactly one of the three. Steps are committed or failed in the order they were scheduled; `schedule()` needs no step
in flight, while `schedule_ahead()` (asynchronous scheduling) plans the next decode step while one
decode step is still in flight: each of its sequences then decodes the token that step samples
(fed to the runner on the device). A sequence that ends while a step in flight still computes for
it (it stopped, or was aborted) leaves the running list at once but keeps its slot and blocks
(`releasing`) until the last such step is committed or failed.

`schedule()` plans running requests first (decodes and prefill chunks, in order; round robin by client
when the token budget cannot hold them all: engine/fair_order.py; in a step that decodes, prefill
within its own budget, engine/prefill_budget.py; while other clients have work, a client's decodes beyond
its share skip the step in turn, and a client with its share of the step admits nothing more into it,
engine/decode_share.py), then waiting
requests in arrival order under the token and sequence budgets (by client when they cannot all be
admitted: a client with fewer running sequences goes first). A waiting request whose longest
matching checkpoint is still being produced is *deferred*: it keeps its place in the queue and later
requests are scheduled past it. It wakes in the step in which the checkpoint is ready, or in the same
step when the producer's chunk reaches the checkpoint (then its segment runs in a later phase of the
same forward). When KV blocks run out, idle checkpoints are evicted first, then the most recently
admitted running request is preempted (recompute).

Checkpoint life cycle transitions are the registry's (cache/checkpoints.py); this class decides
when to ask for them, and engine/checkpoint_claims.py keeps each request's side
(`Request.checkpointing`: claims, waits, reservations). A step's value objects and its scratch
planning state are in engine/step_planning.py.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import CacheMissReason, Checkpoint, CheckpointRegistry, CheckpointState
from forkpoint.cache.state_pool import ZERO_SLOT, StatePool
from forkpoint.config import SCAN_CHUNK_TOKENS, EngineConfig
from forkpoint.engine.auto_checkpoints import AutoCheckpointPlanner, Placement
from forkpoint.engine.checkpoint_claims import CheckpointClaims
from forkpoint.engine.decode_share import DecodeTurns, StepShares
from forkpoint.engine.fair_order import admission_order, client_of, step_order
from forkpoint.engine.held_slots import HeldSlots
from forkpoint.engine.prefill_budget import (
    DECODE_GRACE_S,
    SHORT_SEQUENCE_TOKENS,
    context_cost,
    context_tokens,
    is_capped_prefill,
    is_prefill,
    prefill_room,
    score_rows_with_decodes,
    short_cost,
    short_repeat_room,
    short_room,
    short_whole,
)
from forkpoint.engine.request import Request, RequestStatus
from forkpoint.engine.scheduler_stats import SchedulerStats
from forkpoint.engine.speculative import Speculation
from forkpoint.engine.step_planning import ScheduledStep, StepLimits, StepPlanning
from forkpoint.step.plan import KVCopy, Segment, SegmentKind, StepPlan

logger = logging.getLogger("forkpoint.checkpoints")


class SchedulingFailed(RuntimeError):
    """Planning a step raised (`cause`); `ended`: the sequences it had taken, ended with reason "error"
    and released; `finished`: those that ended while it was planned. Nothing of the step is left."""

    def __init__(self, cause: Exception, ended: list[Request], finished: list[Request]) -> None:
        super().__init__(f"scheduling failed ({type(cause).__name__}: {cause}); ended {len(ended)} sequence(s)")
        self.cause = cause
        self.ended = ended
        self.finished = finished


class Scheduler:
    """`attention_parity`: C, the context length at which a prefill token's attention costs what its
    matrix products do (engine/attention_parity.py): a long prefill's chunk in a step that decodes
    shrinks by 1 + position / C (engine/prefill_budget.py); None: chunks the same at every position."""

    def __init__(self, config: EngineConfig, block_pool: BlockPool, state_pool: StatePool,
                 registry: CheckpointRegistry | None, *, vocab_size: int, attention_parity: int | None = None) -> None:
        self.config = config
        self.attention_parity = attention_parity
        # prompt-logit rows ([rows, vocab] float32 logits) per step, all scored requests together
        self.score_rows = config.prompt_score_rows(vocab_size)
        self.blocks = block_pool
        self.states = state_pool
        self.registry = registry
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.claims = CheckpointClaims(registry, self.stats, self.state_position)
        self.block_size = block_pool.block_size
        self.chunk_cap = config.long_prefill_token_threshold or config.max_num_batched_tokens
        self.prefill_with_decodes = config.prefill_tokens_with_decodes()
        self.last_decode_at: float | None = None  # when the last step with a decode in it was planned
        self.in_flight: list[ScheduledStep] = []  # scheduled, not yet committed or failed; oldest first
        self.num_steps = 0  # non-empty steps scheduled so far (a request's queued_steps counts them)
        # ended sequences whose slot and blocks a step in flight still computes on, with whether their
        # turn-end checkpoint is kept (the sequence ended normally) and when they ended
        self.releasing: list[tuple[Request, bool, float]] = []
        self.auto = (AutoCheckpointPlanner(registry, self.block_size, config.auto_checkpoint_min_tokens,
                                           self.state_position)
                     if registry is not None and config.auto_checkpoints else None)
        self._live: dict[str, Request] = {}
        self._client_live: Counter[str] = Counter()  # live sequences (waiting or running) per client
        # clients admitted since they last had no live sequence: they take only their own held slots
        self._present: set[str] = set()
        # freed slots held a moment for the client whose sequence freed them; once it left, also for any
        # client that runs nothing (engine/held_slots.py)
        self.held_slots = HeldSlots(DECODE_GRACE_S)
        # one client's share of a step's decodes while others have work (engine/decode_share.py; None: off)
        self.decode_turns = DecodeTurns(config.max_decode_share) if config.max_decode_share is not None else None
        # speculative decoding: verify plans and their state rows (None: off)
        self.speculation = (Speculation(config.speculative_config, state_pool)
                            if config.speculative_config is not None else None)

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request, now: float | None = None) -> None:
        """Queue a new sequence; the first sequence of a prompt gets its automatic checkpoints."""
        if self.auto is not None and request.index == 0:
            now = time.monotonic() if now is None else now
            for placement in self.auto.placements(request, self._live):
                self._place(placement, now)
        self._live[request.request_id] = request
        self._client_live[client_of(request)] += 1
        request.arrival_step = self.num_steps
        self.waiting.append(request)
        if self.registry is not None:
            self.registry.read_ahead(request.hasher.prefix_hash, len(request.prompt_token_ids))

    def _place(self, placement: Placement, now: float) -> None:
        producer, position = placement.producer, placement.position
        if position in producer.checkpoint_positions:
            return  # a marker stands there already
        if producer.status is RequestStatus.RUNNING:  # registered now: its next chunks cut there
            state = self.state_position(position)
            if state <= producer.num_computed_tokens:
                return
            checkpoint = self.registry.register(producer.hasher.prefix_hash(position), position,
                                                producer.request_id, now, placement.kind, state,
                                                self.claims.scores_k(producer, state), owner=producer.tenant)
            if checkpoint is None:
                return
            producer.checkpointing.producing.append(checkpoint)
            producer.checkpointing.producing.sort(key=lambda c: c.state_tokens)
        producer.checkpointing.auto_positions[position] = placement.kind  # (re-)claimed at each admission

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, *, keep_turn_end: bool = False, now: float | None = None) -> None:
        """Leave the engine: free the slot and blocks, hand unwritten checkpoints on. With
        `keep_turn_end` (a sequence that ended normally), automatic checkpoints keep its state first.
        While a step in flight computes for it, the slot and blocks are freed (and the turn end kept)
        only once the last such step is committed (failed: nothing is kept)."""
        now = time.monotonic() if now is None else now
        if self._live.pop(request.request_id, None) is not None:
            client = client_of(request)
            self._client_live[client] -= 1
            if request.status is RequestStatus.RUNNING:  # its slot is held a moment for its client
                self.held_slots.hold(now, client)
            if not self._client_live[client]:  # the client left: others that run nothing may take its holds
                del self._client_live[client]
                self._present.discard(client)
                self.held_slots.release(client)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if any(request in step.requests for step in self.in_flight):
            self.releasing.append((request, keep_turn_end, now))
            return
        self._leave(request, keep_turn_end, now)

    def _leave(self, request: Request, keep_turn_end: bool, now: float) -> None:
        if keep_turn_end and self.auto is not None:
            self.auto.keep_turn_end(request, now)
        self._release(request)

    def _release(self, request: Request) -> None:
        if self.speculation is not None:  # first: it tells the verification's rows from the request's own
            self.speculation.release(request)
        if request.slot is not None:
            self.states.requests.free(request.slot)
            request.slot = None
        if request.blocks:
            self.blocks.release(request.blocks)
            request.blocks = []
        progress = request.checkpointing
        for checkpoint in progress.producing:
            self.registry.producer_left(checkpoint)
        progress.producing = []
        progress.read_from = None
        if progress.waiting_on is not None:
            self.claims.stop_waiting(request)
        self.claims.unreserve(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float | None = None, limits: StepLimits | None = None) -> ScheduledStep:
        """The next step under the token and sequence budgets (and `limits`, when given). A raise while
        planning it ends the sequences the half-planned step took (`SchedulingFailed`)."""
        if self.in_flight:
            raise RuntimeError("a step is still in flight: commit or fail it before scheduling the next")
        now = time.monotonic() if now is None else now
        planning = (StepPlanning() if limits is None
                    else StepPlanning(seq_room=limits.max_seqs, chunk_cap=min(self.chunk_cap, limits.max_chunk),
                                      chunked=limits.chunked))
        running = set(map(id, self.running))
        try:
            return self._plan(planning, now, limits)
        except Exception as error:
            raise self._abandon(planning, running, error) from error

    def _abandon(self, planning: StepPlanning, running: set[int], error: Exception) -> SchedulingFailed:
        """Planning raised: release the half-planned step's pins and end, with reason "error", the
        sequences it planned or admitted (`running`: ids of those running before; an admitted one may
        start from a checkpoint whose state never reached its slot). Their slots, blocks and unwritten
        checkpoints go back as in `fail`."""
        for checkpoint in planning.consumed:
            self.registry.unpin(checkpoint)
        ended = [r for r in dict.fromkeys(planning.requests + [r for r in self.running if id(r) not in running])
                 if not r.is_finished]
        for request in ended:
            self.finish(request, "error")
        return SchedulingFailed(error, ended, list(planning.finished))

    def _plan(self, planning: StepPlanning, now: float, limits: StepLimits | None) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        if limits is not None:
            budget = min(budget, limits.max_tokens)
        chunk_cap = planning.chunk_cap or self.chunk_cap
        shares = self._shares(now)  # the running sequences that are not skipping this step
        self.stats.decode_turns_skipped += len(self.running) - len(shares.taking)
        order = step_order(shares.taking, budget, chunk_cap, planning.seq_room)  # per-client round robin when short
        recently = self.last_decode_at is not None and now - self.last_decode_at < DECODE_GRACE_S
        prefill = None if self.prefill_with_decodes is None else prefill_room(
            order, self.waiting, self.prefill_with_decodes, chunk_cap, self._admission_room(planning),
            SCAN_CHUNK_TOKENS if self.config.checkpoint_exact else None, recently_decoded=recently)
        if prefill is not None:  # sequences decode in this step: its prefill stays small (engine/prefill_budget.py)
            planning.prefill_left, planning.prefill_held = prefill.total, prefill.held
            planning.short_left, planning.short_whole = short_room(prefill.total), short_whole(prefill.total)
            planning.repeat_room = short_repeat_room(prefill.total)
            planning.score_cap = min(self.score_rows, score_rows_with_decodes(
                prefill.total, SCAN_CHUNK_TOKENS if self.config.checkpoint_exact else None))
        preempted = False

        for request in order:
            if request.status is not RequestStatus.RUNNING or budget == 0 or planning.seqs_full:
                continue
            verifying = self.speculation is not None and self.speculation.wants_verify(request)
            if verifying and (len(request.draft_token_ids) >= budget or -(-self.speculation.blocks_needed(request)
                                                                           // self.block_size) - len(request.blocks)
                              > self.blocks.num_free):
                # no room for them in this step's tokens or in the free blocks (drafts never evict or
                # preempt anything): decode plainly
                request.draft_token_ids, verifying = (), False
            start = request.num_computed_tokens
            count = 1 + len(request.draft_token_ids) if verifying else self._chunk(planning, request, start, budget)
            capped = not verifying and self._capped(request, start)
            if capped:
                planning.release_held_prefill()  # only the first running prefill leaves room for the others
            if count == 0:
                continue
            needed = self.speculation.blocks_needed(request) if verifying else start + count
            if not self._grow_blocks(request, needed, planning.requests):
                if request.status is RequestStatus.FINISHED:
                    planning.finished.append(request)
                preempted = True
                continue
            verify = self.speculation.plan(request) if verifying else None
            if verify is not None:
                self.last_decode_at = now
                segments, spec = verify
                planning.segments.extend(segments)
                planning.requests.extend([request] * len(segments))
                planning.verifies.append(spec)
            else:
                count = 1 if verifying else count
                if verifying or not is_prefill(request, start):
                    self.last_decode_at = now
                elif capped:
                    planning.take_prefill(context_cost(count, start, self.attention_parity))
                else:
                    planning.take_short(count, client_of(request))
                self._plan_chunk(planning, request, start, count, None)
            budget -= count
            planning.take_seq()

        planning.release_held_prefill()
        if not preempted:
            room = self._admission_room(planning)
            # in a step that decodes, prefills fit the short room and the prefill room, not the step's
            # tokens: a burst that does not fit them is ordered by client (engine/fair_order.py)
            fit, seq_tokens = ((budget, 0) if planning.short_left is None else
                               (min(budget, planning.short_left + planning.prefill_cap()), SHORT_SEQUENCE_TOKENS))
            # the step's sequences per client, for the decode share's cap on admissions (read only when some wait)
            in_step = Counter(client_of(r) for r in dict.fromkeys(planning.requests)) if self.waiting else Counter()
            self.held_slots.trim(self.config.max_num_seqs - len(self.running), now)
            for request in admission_order(self.waiting, self.running, fit, room,
                                           planning.chunk_cap or self.chunk_cap, seq_tokens):
                if budget == 0 or len(self.running) >= self.config.max_num_seqs or planning.seqs_full:
                    break
                client = client_of(request)
                if not shares.admits(client, in_step[client]):
                    continue  # its client has its share of this step (engine/decode_share.py)
                present = client in self._present
                if self.config.max_num_seqs - len(self.running) <= self.held_slots.barred(client, present, now):
                    continue  # the slots left are held for other clients (engine/held_slots.py)
                admitted = self._try_admit(planning, request, budget, now)
                if planning.short_full:
                    break  # short prefills fill this step: the rest wait for the next, in order
                while admitted is None and not self.running and self._evict_waited_on():
                    # nothing runs to free memory later: blocks only queued requests wait on go first
                    admitted = self._try_admit(planning, request, budget, now)
                if admitted is None:
                    break  # out of memory: keep FCFS order
                budget -= admitted
                if admitted:
                    planning.take_seq()
                    in_step[client] += 1
                if request.status is RequestStatus.RUNNING:
                    self.held_slots.take(client, present, now)
                    self._present.add(client)
        self.claims.reserve_for_queued(self.waiting)
        if self.decode_turns is not None:
            self.decode_turns.record(planning.requests, self.running, self.num_steps)
        return self._scheduled(planning)

    def _shares(self, now: float) -> StepShares:
        """The next step's shares: every running sequence takes part and no admission is capped, unless a
        client is over its share of the step while other clients have work (its other decodes skip it in
        turn, and it admits nothing more into it: engine/decode_share.py)."""
        if self.decode_turns is None:
            return StepShares(list(self.running), Counter(), None)
        return self.decode_turns.pick(self.running, self._client_live, self.held_slots.left(now) > 0)

    def _admission_room(self, planning: StepPlanning) -> int:
        """How many waiting sequences this step can admit, under max_num_seqs and its StepLimits."""
        room = self.config.max_num_seqs - len(self.running)
        return room if planning.seq_room is None else min(room, planning.seq_room)

    def _scheduled(self, planning: StepPlanning) -> ScheduledStep:
        """The step, in flight unless empty; its plan takes the device writes recorded since the last one."""
        first, writes = self.registry.take_writes() if self.registry is not None and planning.segments else (0, ())
        step = ScheduledStep(StepPlan(tuple(planning.segments), tuple(planning.kv_copies), writes=writes,
                                      first_write=first, verifies=tuple(planning.verifies)),
                             planning.requests, planning.written, planning.consumed, planning.finished,
                             self.num_steps)
        if not step.empty:
            self.in_flight.append(step)
            self.num_steps += 1
        return step

    def schedule_ahead(self, leave_out: Callable[[Request], bool]) -> ScheduledStep | None:
        """The next decode step, planned while the one decode step in flight runs: every running
        sequence decodes one token, the one that step samples for it (`Segment.fed_row`: its row
        there). `leave_out(request)`: sequences certain to end with the step in flight (no step
        follows for them). None, and nothing changed, unless this is steady decoding: exactly one
        step in flight, a pure decode step (no checkpoint written or read, no copy-on-write) with
        every running sequence in it; no waiting request while fewer than max_num_seqs run; no
        sequence that produces a checkpoint; no client over its decode share (engine/decode_share.py:
        the turns are taken in a normal step); and a free KV block for every sequence that needs one
        (no eviction, no preemption: those wait for a normal `schedule()`)."""
        if len(self.in_flight) != 1:
            return None
        previous = self.in_flight[0]
        plan = previous.plan
        if (previous.written or previous.consumed or previous.finished or plan.kv_copies
                or any(s.kind is not SegmentKind.DECODE or not s.samples for s in plan.segments)):
            return None
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        # the sampled rows: all decodes, so the packed order (`plan.ordered()`) is the plan's own
        rows = {segment.request_id: row for row, segment in enumerate(plan.segments)}
        ends = {request.request_id: segment.end for segment, request in zip(plan.segments, previous.requests)}
        if any(r.request_id not in ends or r.checkpointing.producing for r in self.running):
            return None
        if len(self._shares(time.monotonic()).taking) < len(self.running):
            return None  # some sequences take turns under the decode share: a normal step picks them
        decoding = [r for r in self.running if not leave_out(r)]
        if not decoding:
            return None
        growth = [-(-(ends[r.request_id] + 1) // self.block_size) - len(r.blocks) for r in decoding]
        if sum(growth) > self.blocks.num_free:
            return None
        planning = StepPlanning()
        for request, need in zip(decoding, growth):
            if need > 0:
                request.blocks.extend(self.blocks.allocate(need))
            start = ends[request.request_id]
            planning.segments.append(Segment(
                request_id=request.request_id, start=start, end=start + 1, token_ids=(),
                block_table=request.blocks, initial_slot=request.slot, dest_slots=(request.slot,),
                kind=SegmentKind.DECODE, phase=0, samples=True, multimodal=request.multimodal,
                fed_row=rows[request.request_id]))
            planning.requests.append(request)
        self.last_decode_at = time.monotonic()
        if self.decode_turns is not None:
            self.decode_turns.record(planning.requests, self.running, self.num_steps)
        return self._scheduled(planning)

    def commit(self, step: ScheduledStep) -> None:
        """The forward ran: advance the requests (a sequence's first sampling step is its
        first_token_step), mark written checkpoints ready, release the pins and the ended sequences no
        step in flight computes for any more."""
        self._settle(step)
        for segment, request in zip(step.plan.segments, step.requests):
            if self.speculation is not None and self.speculation.verifying(request):
                continue  # the engine settles it by the tokens it keeps (engine/speculative.py)
            prompt_len = len(request.prompt_token_ids)
            self.stats.prompt_tokens_computed += max(0, min(segment.end, prompt_len) - segment.start)
            request.num_computed_tokens = max(request.num_computed_tokens, segment.end)
            if segment.samples and request.first_token_step is None:
                request.first_token_step = step.index
        for checkpoint, producer in step.written:
            self.registry.mark_ready(checkpoint, producer.blocks[: -(-checkpoint.state_tokens // self.block_size)])
            producer.checkpointing.producing.remove(checkpoint)
        for checkpoint in step.consumed:
            self.registry.unpin(checkpoint)
        # before the turn-end registrations of the requests this step ended
        self.claims.reserve_for_queued(self.waiting)
        self._release_ended(step, computed=True)

    def fail(self, step: ScheduledStep) -> list[Request]:
        """Something between schedule and commit raised: release the step's pins and end every
        request in it with reason "error" (their slots, blocks and unwritten checkpoints go back;
        waiters of those checkpoints are promoted when next scheduled). Returns the ended requests."""
        self._unwind(step)
        self.stats.failed_steps += 1
        self._release_ended(step, computed=False)
        ended = []
        for request in dict.fromkeys(step.requests):  # a request may own several segments
            if not request.is_finished:
                self.finish(request, "error")
                ended.append(request)
        return ended

    def requeue(self, steps: list[ScheduledStep]) -> list[Request]:
        """`steps` (every step in flight, oldest first) raised for lack of memory and are retried:
        release them as `fail` does, but put their unfinished sequences back at the front of the
        queue, in step order, as preemptions: each recomputes from its longest checkpoint, since
        the failed forward may have written its state rows. Returns the requeued sequences."""
        if len(steps) != len(self.in_flight):
            raise RuntimeError("requeue takes every step in flight: a later step would compute for a requeued sequence")
        for step in steps:
            self._unwind(step)
            self.stats.requeued_steps += 1
        for step in steps:
            self._release_ended(step, computed=False)
        requeued = [r for r in dict.fromkeys(r for step in steps for r in step.requests) if not r.is_finished]
        for request in reversed(requeued):  # appendleft: the first of the step ends up first in the queue
            self._preempt(request)
        return requeued

    def _unwind(self, step: ScheduledStep) -> None:
        """Settle a step that did not run to its end: its device writes go to the next plan again
        (the runner may not have applied them) and its readers' pins are released."""
        self._settle(step)
        if step.plan.writes:
            self.registry.give_back_writes(step.plan.first_write, step.plan.writes)
        for checkpoint in step.consumed:
            self.registry.unpin(checkpoint)

    def _settle(self, step: ScheduledStep) -> None:
        if not self.in_flight or self.in_flight[0] is not step:
            raise RuntimeError("this step is not the oldest one in flight")
        self.in_flight.pop(0)

    def _release_ended(self, step: ScheduledStep, computed: bool) -> None:
        """Free the ended sequences that no step in flight computes for any more (`step`, just
        settled, was the last that did); their turn-end checkpoints only if `step` computed (its
        state is in their slots)."""
        if not self.releasing:
            return
        held = {id(r) for later in self.in_flight for r in later.requests}
        kept = []
        for request, keep_turn_end, now in self.releasing:
            if id(request) in held:
                kept.append((request, keep_turn_end, now))
            else:
                self._leave(request, keep_turn_end and computed, now)
        self.releasing = kept

    def state_position(self, position: int) -> int:
        """Where a checkpoint at `position` keeps its state: the position itself, or with
        checkpoint_exact the scan-chunk boundary at or before it (0: the checkpoint is useless)."""
        return position - position % SCAN_CHUNK_TOKENS if self.config.checkpoint_exact else position

    def _capped(self, request: Request, start: int, admitting: bool = False) -> bool:
        """Whether `request`'s tokens from `start` count against the prefill budget of a step that
        decodes (engine/prefill_budget.py: long prefills only). `admitting`: `start` is where its
        admission begins computing (a running request's is its `num_cached_tokens`)."""
        origin = start if admitting else request.num_cached_tokens
        return (self.prefill_with_decodes is not None
                and is_capped_prefill(request, start, self.prefill_with_decodes, origin))

    def _chunk(self, planning: StepPlanning, request: Request, start: int, budget: int,
               admitting: bool = False) -> int:
        """Tokens of `request` to compute from `start` this step. With checkpoint_exact, a chunk
        that does not finish the sequence ends at a scan-chunk boundary (0 when none fits), so chunked
        prefill runs the recurrent scans over the same chunks as one pass. A request scoring its prompt
        gets at most the step's prompt-logit rows left (`score_rows`): its logits stay O(chunk x vocab).
        In a step that decodes, a long prefill takes at most the step's prefill room left
        (`StepPlanning.prefill_cap`) over its context factor (engine/prefill_budget.py `context_tokens`),
        and scored rows at most `score_rows_with_decodes` (`StepPlanning.score_cap`)."""
        num_tokens = request.num_tokens
        capped = planning.chunked is None or request.request_id in planning.chunked
        count = min(num_tokens - start, budget, (planning.chunk_cap if capped else None) or self.chunk_cap)
        prefill_cap = planning.prefill_cap()
        if prefill_cap is not None and self._capped(request, start, admitting):
            count = min(count, context_tokens(prefill_cap, start, self.attention_parity,
                                              SCAN_CHUNK_TOKENS if self.config.checkpoint_exact else None))
        elif planning.short_left is not None and is_prefill(request, start):
            # a short prefill: the step's short room (and its client's repeat room)
            count = min(count, planning.short_cap(client_of(request)) - SHORT_SEQUENCE_TOKENS)
        if request.params.prompt_logprobs is not None:
            rows_left = (planning.score_cap or self.score_rows) - planning.score_rows
            if len(request.prompt_token_ids) - 1 - start > rows_left:
                count = min(count, rows_left)
        if self.config.checkpoint_exact and start + count < num_tokens:
            count -= (start + count) % SCAN_CHUNK_TOKENS
        return max(count, 0)

    # ------------------------------------------------------------------ memory
    def _grow_blocks(self, request: Request, num_tokens: int, planned: list[Request]) -> bool:
        """Give a running request blocks for `num_tokens` tokens, evicting idle checkpoints and then
        preempting the most recently admitted request not `planned` in this step (at worst `request`
        itself). False when `request` itself had to be preempted."""
        need = -(-num_tokens // self.block_size) - len(request.blocks)
        while need > self.blocks.num_free:
            if self.registry is not None and self._evict_for_memory():
                continue
            if self.running == [request]:
                if self._evict_waited_on():
                    continue
                # alone with every evictable block freed: recomputing could never fit, so stop here
                self.finish(request, "length")
                return False
            victim = next(r for r in reversed(self.running) if r not in planned)  # `request` is not planned yet
            self._preempt(victim)
            if victim is request:
                return False
        if need > 0:
            request.blocks.extend(self.blocks.allocate(need))
        return True

    # ------------------------------------------------------------------ admission
    def _try_admit(self, planning: StepPlanning, request: Request, budget: int, now: float) -> int | None:
        """Admit `request` into this step. Returns tokens scheduled, 0 when deferred, None when out of memory.
        Its reservation, if any, is given up (it looks up its checkpoint afresh)."""
        progress = request.checkpointing
        self.claims.unreserve(request)
        longest = ready = None
        if self.registry is not None:
            longest, ready = self.registry.lookup(request.hasher.prefix_hash, len(request.prompt_token_ids),
                                                  self.claims.readable_by(request))
        source = ready
        if longest is not None and not longest.ready:
            if longest.state is CheckpointState.ORPHANED:
                source = ready  # this request is promoted to produce it (below)
            elif id(longest) in planning.written_phase:
                source = longest  # same-step pairing: the producer's phase writes it before we read
            elif not progress.gave_up_waiting:
                if now - (progress.deferred_since or now) > self.config.checkpoint_wait_s:
                    progress.gave_up_waiting = True
                    self.stats.checkpoint_wait_timeouts += 1
                    logger.debug("wait bound: %s computes the %d-token prefix itself", request.request_id,
                                 longest.num_tokens)
                    self.claims.stop_waiting(request, now)
                else:
                    self.claims.wait_on(request, longest, now)
                    return 0

        if self.states.requests.num_free == 0:
            return None
        start = source.state_tokens if source is not None else 0
        if planning.short_left is not None and not self._capped(request, start, admitting=True):
            cost = short_cost(request.num_tokens - start)
            if cost > planning.short_cap():
                planning.short_full = True  # a short prefill runs whole: it waits for a step with room
                return 0
            if cost > planning.short_cap(client_of(request)):
                return 0  # its client's short prefills fill its repeat room: the next step; other clients go on
        count = self._chunk(planning, request, start, budget, admitting=True)
        if count == 0:
            return None  # exact mode: no scan-chunk boundary within the budget left
        shared = [] if source is None else (source.blocks if source.ready else source.producer_blocks)
        full = start // self.block_size
        own_needed = -(-(start + count) // self.block_size) - full
        if source is not None:
            self.registry.pin(source, start)  # protects it from the evictions below
            planning.consumed.append(source)
        while own_needed > self.blocks.num_free:
            if self.registry is None or not self._evict_for_memory():
                if source is not None:
                    planning.consumed.pop()
                    self.registry.unpin(source)
                return None

        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.slot = self.states.requests.allocate()
        request.blocks = list(shared[:full])
        self.blocks.incref(request.blocks)
        request.blocks.extend(self.blocks.allocate(own_needed))
        request.num_computed_tokens = start
        progress.read_from = source
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.first_scheduled_step = self.num_steps
        if source is not None:
            request.num_cached_tokens = start
            self.stats.checkpoint_hits += 1
            if start % self.block_size:
                planning.kv_copies.append(KVCopy(shared[full], request.blocks[full], start % self.block_size))
        request.cache_miss_reason = (
            self.auto.miss_reason(request, start) if self.auto is not None else CacheMissReason.DISABLED
            if self.registry is None else self.registry.tier_miss(request.hasher.prefix_hash, start,
                                                                  len(request.prompt_token_ids)))
        self.claims.claim(request, start, now)
        if progress.waiting_on is not None:
            self.claims.stop_waiting(request, now)
        if self._capped(request, start, admitting=True):  # a long prefill's chunk counts against the budget
            planning.take_prefill(context_cost(count, start, self.attention_parity))
        else:
            planning.take_short(count, client_of(request))
        self._plan_chunk(planning, request, start, count, source)
        return count

    def _evict_for_memory(self) -> bool:
        """Free one checkpoint's blocks for a running or admitted request: an idle one, else (memory
        comes first) after every queued request has given up its reservation."""
        if self.registry.evict_one():
            return True
        reserving = [r for r in self.waiting if r.checkpointing.reserved is not None]
        for request in reserving:
            self.claims.unreserve(request)
        return bool(reserving) and self.registry.evict_one()

    def _evict_waited_on(self) -> bool:
        """Last resort when nothing else frees memory (a request running alone, or none running): evict a
        READY checkpoint that only queued requests wait on (they look it up afresh when admitted and
        compute the prefix themselves: a miss, not a request ended without output or a stalled queue)."""
        ready_waits = [r for r in self.waiting
                       if r.checkpointing.waiting_on is not None and r.checkpointing.waiting_on.ready]
        for request in ready_waits:
            self.claims.stop_waiting(request)
        return bool(ready_waits) and self.registry.evict_one()

    # ------------------------------------------------------------------ segments
    def _plan_chunk(self, planning: StepPlanning, request: Request, start: int, count: int,
                    source: Checkpoint | None) -> None:
        """Split tokens [start, start+count) at this request's checkpoints into segments."""
        end = start + count
        if source is not None:
            initial, phase = source.slot, planning.written_phase.get(id(source), -1) + 1
        else:
            initial, phase = (ZERO_SLOT if start == 0 else request.slot), 0
        cuts = [c for c in request.checkpointing.producing if start < c.state_tokens <= end]
        lo = start
        for checkpoint in cuts:
            hi = checkpoint.state_tokens
            dests = (checkpoint.slot, request.slot) if hi == end else (checkpoint.slot,)
            planning.add_segment(request, lo, hi, initial, dests, SegmentKind.PREFILL, phase)
            planning.written_phase[id(checkpoint)] = phase
            self.registry.writing(checkpoint, request.blocks)
            planning.written.append((checkpoint, request))
            lo, initial, phase = hi, checkpoint.slot, phase + 1
        if lo < end:
            is_decode = end - lo == 1 and initial == request.slot and phase == 0 and lo > 0
            planning.add_segment(request, lo, end, initial, (request.slot,),
                              SegmentKind.DECODE if is_decode else SegmentKind.PREFILL, phase)

    # ------------------------------------------------------------------ metrics and integrity
    def metrics(self) -> dict[str, int | float]:
        """The scheduler's counters (`stats`) and queue lengths."""
        return dict(asdict(self.stats), num_waiting=len(self.waiting), num_running=len(self.running))

    def check_integrity(self) -> None:
        """Requests against the registry: pins, waiters and producers each match a live request."""
        held = {id(r) for step in self.in_flight for r in step.requests}
        if any(r.slot is None for step in self.in_flight for r in step.requests):
            raise AssertionError("a step in flight computes for a sequence whose state slot was freed")
        if any(id(request) not in held or not request.is_finished for request, _, _ in self.releasing):
            raise AssertionError("an ended sequence keeps its slot and blocks with no step in flight computing for it")
        if Counter(client_of(r) for r in self._live.values()) != self._client_live or not self._present <= set(
                self._client_live):
            raise AssertionError("the per-client counts of live sequences (held slots) do not match the live sequences")
        if self.registry is None:
            return
        readers: Counter[bytes] = Counter()
        for step in self.in_flight:
            readers.update(c.key for c in step.consumed)
        waiters: Counter[bytes] = Counter()
        reserved: Counter[bytes] = Counter()
        producers: dict[bytes, str] = {}
        for request in list(self.waiting) + self.running:
            progress = request.checkpointing
            if progress.waiting_on is not None:
                waiters[progress.waiting_on.key] += 1
            if progress.reserved is not None:
                if request.status is not RequestStatus.WAITING:
                    raise AssertionError(f"{request.request_id} holds a reservation while {request.status.value}")
                reserved[progress.reserved.key] += 1
            for checkpoint in progress.producing:
                if checkpoint.key in producers:
                    raise AssertionError(f"two producers of the {checkpoint.num_tokens}-token checkpoint")
                producers[checkpoint.key] = request.request_id
        self.registry.check_integrity(readers=readers, waiters=waiters, producers=producers, reserved=reserved)
