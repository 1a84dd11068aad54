"""A request's side of the checkpoint protocol, for the scheduler: the checkpoints it will write
(`claim`: registered, or adopted when orphaned), its wait on an unready one it will read (`wait_on`,
`stop_waiting`: the deferral), and the reservation a queued request holds on a ready one
(`reserve_for_queued`, `unreserve`). The life cycle's transitions are the registry's
(cache/checkpoints.py); this keeps `Request.checkpointing` and the scheduler's counters in step with
them. Without a registry (checkpoints off) nothing is claimed, waited on or reserved."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from forkpoint.cache.checkpoint_types import Checkpoint, CheckpointKind, CheckpointState
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.engine.request import Request
from forkpoint.engine.scheduler_stats import SchedulerStats

logger = logging.getLogger("forkpoint.checkpoints")


class CheckpointClaims:
    """registry: the checkpoint registry, or None; stats: the scheduler's counters (deferrals,
    promotions, waits); state_position: where a checkpoint at a position keeps its state
    (`Scheduler.state_position`)."""

    def __init__(self, registry: CheckpointRegistry | None, stats: SchedulerStats,
                 state_position: Callable[[int], int]) -> None:
        self.registry = registry
        self.stats = stats
        self.state_position = state_position

    def reserve_for_queued(self, waiting: Iterable[Request]) -> None:
        """Every queued request (not admitted this step: token budget, sequence limit or memory)
        reserves the longest READY device checkpoint of its prompt (unready ones are never evicted),
        so that the registrations before its admission cannot evict it (a burst of more requests
        than one step admits, sharing a prefix, would otherwise lose it to the newer automatic
        checkpoints of the requests admitted first). Called after each step's admissions and at
        each commit, before the turn-end registrations of the requests the step ended."""
        if self.registry is None or not len(self.registry):
            return
        for request in waiting:
            progress = request.checkpointing
            if progress.reserved is not None or progress.waiting_on is not None:
                continue
            _, ready = self.registry.lookup(request.hasher.prefix_hash, len(request.prompt_token_ids),
                                            self.readable_by(request), restore=False)
            if ready is not None:
                progress.reserved = ready
                self.registry.reserve(ready)

    def unreserve(self, request: Request) -> None:
        progress = request.checkpointing
        if progress.reserved is not None:
            self.registry.unreserve(progress.reserved)
            progress.reserved = None

    @staticmethod
    def readable_by(request: Request) -> Callable[[Checkpoint], bool] | None:
        """Prompt logprobs need a score for every prompt token: such a request reads only checkpoints
        that carry (or whose producer computes) the prefix's scores with at least its top-k."""
        k = request.params.prompt_logprobs
        if k is None:
            return None
        return lambda c: c.prompt_scores_k is not None and c.prompt_scores_k >= k

    @staticmethod
    def scores_k(request: Request, state_position: int) -> int | None:
        """The prompt-logprob top-k a checkpoint this request writes at `state_position` will carry
        (none when the position's last score is the sampling row, at the prompt's end)."""
        if state_position >= len(request.prompt_token_ids):
            return None
        return request.params.prompt_logprobs

    def wait_on(self, request: Request, checkpoint: Checkpoint, now: float) -> None:
        progress = request.checkpointing
        if progress.waiting_on is checkpoint:
            return
        if progress.waiting_on is not None:
            self.stop_waiting(request)  # switching checkpoints: the wait goes on, account it once at the end
        progress.waiting_on = checkpoint
        self.registry.add_waiter(checkpoint)
        if progress.deferred_since is None:
            progress.deferred_since = now
        if not progress.was_deferred:
            progress.was_deferred = True
            self.stats.requests_deferred += 1
            logger.debug("deferred: %s waits for the %d-token checkpoint of %s", request.request_id,
                         checkpoint.num_tokens, checkpoint.producer)

    def stop_waiting(self, request: Request, now: float | None = None) -> None:
        progress = request.checkpointing
        checkpoint = progress.waiting_on
        if checkpoint is not None:
            progress.waiting_on = None
            self.registry.drop_waiter(checkpoint)
        if progress.deferred_since is not None and now is not None:
            self.stats.deferral_wait_s_total += now - progress.deferred_since
            progress.deferred_since = None

    def claim(self, request: Request, start: int, now: float) -> None:
        """Register (or adopt, when orphaned) every checkpoint this request will pass."""
        if self.registry is None:
            return
        producing = request.checkpointing.producing
        wanted = dict(request.checkpointing.auto_positions)
        wanted.update(dict.fromkeys(request.checkpoint_positions, CheckpointKind.MARKER))  # markers win
        for position, kind in sorted(wanted.items()):
            state = self.state_position(position)
            if state <= start:
                continue
            key = request.hasher.prefix_hash(position)
            checkpoint = self.registry.get(key)
            if checkpoint is None:
                checkpoint = self.registry.register(key, position, request.request_id, now, kind, state,
                                                    self.scores_k(request, state), owner=request.tenant)
                if checkpoint is None:
                    logger.debug("no checkpoint slot free for %s at %d: a miss", request.request_id, position)
                    continue  # checkpoint pool full of pinned entries: a miss, never an error
                producing.append(checkpoint)
            elif checkpoint.state is CheckpointState.ORPHANED:
                self.promote(request, checkpoint)
        # orphans this request matched on its way (prefix of its prompt without a marker) are adopted too
        for checkpoint in self.registry.orphans_between(request.hasher.prefix_hash, start,
                                                        len(request.prompt_token_ids)):
            if checkpoint.state_tokens > start:  # it will pass the position the state is kept at
                self.promote(request, checkpoint)
        producing.sort(key=lambda c: c.state_tokens)

    def promote(self, request: Request, checkpoint: Checkpoint) -> None:
        self.registry.promote(checkpoint, request.request_id, self.scores_k(request, checkpoint.state_tokens))
        self.stats.producer_promotions += 1
        request.checkpointing.producing.append(checkpoint)
