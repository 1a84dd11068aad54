"""The engine thread against a scripted engine: a step that fails because the runner is unusable
ends the thread and every request; any other failed step ends only the requests in it."""

from __future__ import annotations

import asyncio

import pytest

from forkpoint.engine.engine import StepFailed
from forkpoint.runner.errors import RunnerUnusable
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.worker import EngineFailure, EngineWorker, NewRequest, OutputSink


class ScriptedEngine:
    """Holds the added request ids; every step raises `StepFailed(cause, [first id])`."""

    def __init__(self, cause: Exception) -> None:
        self.cause = cause
        self.requests: list[str] = []

    def metrics(self) -> dict[str, float]:
        return {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt, params, *, stream: bool = True, deltas: bool = False,
                    report_first_token: bool = False, tenant: str = "") -> None:
        self.requests.append(request_id)

    def abort_request(self, request_id) -> None:
        if request_id in self.requests:  # unknown or ended ids are ignored, as LLMEngine does
            self.requests.remove(request_id)

    def step(self):
        failed = self.requests.pop(0)
        raise StepFailed(self.cause, [failed], [])


async def _run(cause: Exception) -> tuple[EngineWorker, BaseException]:
    worker = EngineWorker(ScriptedEngine(cause))
    worker.start()
    sink = OutputSink(asyncio.get_running_loop())
    requests = [NewRequest(f"r{i}", {"prompt_token_ids": [1, 2]}, SamplingParams()) for i in range(2)]
    await worker.add_many(requests, sink)
    delivered = await asyncio.wait_for(sink.queue.get(), 5)
    worker.shutdown(timeout_s=0.0)
    return worker, delivered


@pytest.mark.parametrize("cause, ends_thread", [(RunnerUnusable("rank 1 died"), True),
                                                (RuntimeError("one step"), False)])
def test_an_unusable_runner_ends_the_engine_thread_other_failures_only_their_step(cause, ends_thread):
    worker, delivered = asyncio.run(_run(cause))
    assert isinstance(delivered, EngineFailure)
    message = str(delivered)
    assert str(cause) in message
    # a fatal failure ends the thread before shutdown; "the engine failed:" names it as final
    assert message.startswith("the engine failed:") == ends_thread
    assert ("while generating" in message) != ends_thread
    assert worker._fatal is (cause if ends_thread else None)
