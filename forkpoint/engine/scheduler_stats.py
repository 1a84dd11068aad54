"""The scheduler's counters (`Scheduler.metrics()` reports them with the queue lengths)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counts since the engine started: deferrals and their wait, promotions to producer, checkpoint hits,
    waits given up, preemptions, prompt tokens computed, failed and requeued steps, and the steps that
    sequences skipped under their client's decode share (engine/decode_share.py: one per sequence a step)."""

    requests_deferred: int = 0
    producer_promotions: int = 0
    checkpoint_hits: int = 0
    checkpoint_wait_timeouts: int = 0
    deferral_wait_s_total: float = 0.0
    preemptions: int = 0
    prompt_tokens_computed: int = 0
    failed_steps: int = 0
    requeued_steps: int = 0
    decode_turns_skipped: int = 0
