"""What the scheduler's sequences hold, checked against the pools (`LLMEngine.check_integrity`; the
checkpoint side is `Scheduler.check_integrity`)."""

from __future__ import annotations

from collections import Counter

from forkpoint.engine.request import RequestStatus
from forkpoint.engine.scheduler import Scheduler


def check_holdings(scheduler: Scheduler) -> None:
    """Every KV block reference and state slot has one holder (a running or releasing sequence, or a
    checkpoint); waiting sequences hold nothing. Raises AssertionError."""
    scheduler.states.check_integrity()
    holders = scheduler.running + [r for r, _, _ in scheduler.releasing]
    expected: Counter[int] = Counter()
    for request in holders:
        expected.update(request.blocks)
        if request.slot is None:
            raise AssertionError(f"running request {request.request_id} has no state slot")
    registry = scheduler.registry
    if registry is not None:
        if registry.host is not None:
            registry.host.check_integrity()
        if registry.disk is not None:
            registry.disk.check_integrity()
        expected.update(registry.block_refs())
    scheduler.blocks.check_integrity(dict(expected))
    slots = [r.slot for r in holders]
    if scheduler.speculation is not None:  # rows of verifications not yet settled
        slots += scheduler.speculation.held_slots()
    if scheduler.states.requests.num_used != len(slots) or len(set(slots)) != len(slots):
        raise AssertionError("request state slots leaked or shared")
    for request in scheduler.waiting:
        if request.slot is not None or request.blocks:
            raise AssertionError(f"waiting request {request.request_id} holds resources")
    if any(r.status is not RequestStatus.RUNNING for r in scheduler.running):
        raise AssertionError("non-running request in the running list")
