"""`forkpoint serve` with a per-step trace, to see what the step loop did during a bystander's largest gap.

Runs the server CLI in this process after wrapping the scheduler: every non-empty step appends one
JSON line to TRACE (the path in $FORKPOINT_STEP_TRACE): when it was planned and settled
(time.perf_counter(), the clock bench/hostile.py's bystander uses; both processes on one machine),
how it ended (commit, requeue after out-of-memory, fail), its decode segments and its prefill
segments (request id, start, end); and one line per sequence the scheduler takes in (`added`: its id,
its tenant, when). No engine code changes; the wrappers cost microseconds per step.
With FORKPOINT_STEP_TRACE_COMPACT=1 a step line holds counts instead of ids (decodes; prefill segments
and tokens; the plan's device writes by type: Spill, Restore, StateCopy, ...),
for runs of hundreds of sequences (bench/agent_sessions.py --step-trace).

Usage (then run bench/hostile.py --url ... --server-pid ... against it, and read both files together):
    FORKPOINT_STEP_TRACE=/tmp/steps.jsonl python bench/step_trace.py serve --port 8011 --log-level warning
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from forkpoint.engine.scheduler import Scheduler  # noqa: E402
from forkpoint.server.cli import main  # noqa: E402
from forkpoint.step.plan import SegmentKind  # noqa: E402


def install(path: str) -> None:
    """Wrap Scheduler.add / schedule / schedule_ahead / commit / requeue / fail to log each sequence
    taken in and each step to `path`."""
    sink = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    planned: dict[int, dict] = {}
    compact = os.environ.get("FORKPOINT_STEP_TRACE_COMPACT", "0") == "1"

    def record(step, ended: str) -> None:
        entry = planned.pop(id(step), None)
        if entry is not None:
            entry.update(end=time.perf_counter(), outcome=ended)
            sink.write(json.dumps(entry) + "\n")

    def on_plan(step) -> None:
        if step.empty:
            return
        segments = list(zip(step.plan.segments, step.requests))
        if compact:
            prefills = [s for s, _ in segments if s.kind is not SegmentKind.DECODE]
            planned[id(step)] = {
                "start": time.perf_counter(),
                "decodes": len(segments) - len(prefills), "prefill_segments": len(prefills),
                "prefill_tokens": sum(s.end - s.start for s in prefills),
                "writes": dict(Counter(type(w).__name__ for w in step.plan.writes)),
                "kv_copies": len(step.plan.kv_copies), "running": None, "waiting": None}
            return
        planned[id(step)] = {
            "start": time.perf_counter(),
            "decodes": sum(1 for s, _ in segments if s.kind is SegmentKind.DECODE),
            "decoders": sorted({r.parent_id for s, r in segments if s.kind is SegmentKind.DECODE}),
            "prefills": [[r.request_id, s.start, s.end] for s, r in segments if s.kind is not SegmentKind.DECODE],
            "tenants": sorted({r.tenant for s, r in segments if s.kind is not SegmentKind.DECODE}),
            "running": None, "waiting": None}

    add = Scheduler.add

    def traced_add(self, request, *args, **kwargs):
        add(self, request, *args, **kwargs)
        sink.write(json.dumps({"added": request.request_id, "tenant": request.tenant, "at": time.perf_counter()})
                   + "\n")

    Scheduler.add = traced_add
    schedule, ahead = Scheduler.schedule, Scheduler.schedule_ahead
    commit, requeue, fail = Scheduler.commit, Scheduler.requeue, Scheduler.fail

    def traced_schedule(self, *args, **kwargs):
        step = schedule(self, *args, **kwargs)
        on_plan(step)
        if id(step) in planned:
            planned[id(step)].update(running=len(self.running), waiting=len(self.waiting),
                                     limits=None if kwargs.get("limits") is None else str(kwargs["limits"]))
        return step

    def traced_ahead(self, *args, **kwargs):
        step = ahead(self, *args, **kwargs)
        if step is not None:
            on_plan(step)
        return step

    def traced_commit(self, step):
        commit(self, step)
        record(step, "commit")

    def traced_requeue(self, steps):
        requeued = requeue(self, steps)
        for step in steps:
            record(step, "requeue")
        return requeued

    def traced_fail(self, step):
        ended = fail(self, step)
        record(step, "fail")
        return ended

    Scheduler.schedule, Scheduler.schedule_ahead = traced_schedule, traced_ahead
    Scheduler.commit, Scheduler.requeue, Scheduler.fail = traced_commit, traced_requeue, traced_fail


if __name__ == "__main__":
    install(os.environ["FORKPOINT_STEP_TRACE"])
    sys.exit(main(sys.argv[1:]))
