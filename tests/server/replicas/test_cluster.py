"""ClusterWorker's fault handling against a scripted stand-in for the deployment handle (no Ray):
sends again when the replica died before any output, fails the prompt once outputs were out,
passes the engine's ValueError through with nothing left running."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from forkpoint.outputs import CompletionOutput, RequestOutput
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.replicas.cluster import ClusterWorker, aggregate_metrics
from forkpoint.server.replicas.deployment import ReplicaSnapshot
from forkpoint.server.worker import EngineFailure, NewRequest, OutputSink


def output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None, None)
    return RequestOutput(request_id, None, [1, 2], [completion], finished=finished)


class ScriptedResponse:
    """A streaming response that yields `script` items in turn (an exception item is raised)."""

    def __init__(self, script: list) -> None:
        self._script = list(script)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.cancelled:
            raise asyncio.CancelledError
        if not self._script:
            raise StopAsyncIteration
        item = self._script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedHandle:
    """`handle.remote(request)` answers the next script of that request id."""

    def __init__(self, scripts: dict[str, list[list]]) -> None:
        self._scripts = scripts
        self.sent: list[str] = []
        self.responses: list[ScriptedResponse] = []

    def options(self, **_):
        return self

    def remote(self, request: NewRequest) -> ScriptedResponse:
        self.sent.append(request.request_id)
        response = ScriptedResponse(self._scripts[request.request_id].pop(0))
        self.responses.append(response)
        return response


def request(request_id: str) -> NewRequest:
    return NewRequest(request_id, {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))


async def collect(sink: OutputSink, count: int) -> list:
    items = []
    while len(items) < count:
        items.append(await asyncio.wait_for(sink.queue.get(), timeout=5))
    return items


def test_replica_dying_before_output_is_retried_elsewhere():
    async def main():
        done = [output("r", [5, 6], True)]
        handle = ScriptedHandle({"r": [[ActorDiedError()], [[], ActorDiedError()], [[], done]]})
        worker = ClusterWorker(handle, board=None)
        sink = OutputSink(asyncio.get_running_loop())
        await worker.add_many([request("r")], sink)  # died before accepting: sent again
        assert await collect(sink, 1) == [done]      # died after accepting, before output: sent again
        await asyncio.sleep(0.01)
        assert handle.sent == ["r", "r", "r"] and worker.retries == 2
    asyncio.run(main())


def test_replica_dying_after_output_fails_the_prompt():
    async def main():
        partial = [output("r", [5], False)]
        handle = ScriptedHandle({"r": [[[], partial, ActorDiedError()]]})
        worker = ClusterWorker(handle, board=None)
        sink = OutputSink(asyncio.get_running_loop())
        await worker.add_many([request("r")], sink)
        first, failure = await collect(sink, 2)
        assert first == partial
        assert isinstance(failure, EngineFailure) and "ActorDiedError" in str(failure)
        assert handle.sent == ["r"]
    asyncio.run(main())


def test_every_attempt_failing_ends_with_a_clear_error():
    async def main():
        handle = ScriptedHandle({"r": [[ActorDiedError()]] * 2})
        worker = ClusterWorker(handle, board=None, max_attempts=2)
        with pytest.raises(EngineFailure, match="no replica could take request r"):
            await worker.add_many([request("r")], OutputSink(asyncio.get_running_loop()))
    asyncio.run(main())


def test_engine_value_error_aborts_the_whole_batch():
    async def main():
        handle = ScriptedHandle({"ok": [[[], [output("ok", [1], True)]]],
                                 "bad": [[ValueError("prompt token id 999 at index 0 is out of range")]]})
        worker = ClusterWorker(handle, board=None)
        with pytest.raises(ValueError, match="out of range"):
            await worker.add_many([request("ok"), request("bad")], OutputSink(asyncio.get_running_loop()))
        assert handle.responses[0].cancelled  # the accepted prompt is cancelled on its replica
    asyncio.run(main())


def test_abort_cancels_the_call():
    async def main():
        handle = ScriptedHandle({"r": [[[]] + [[output("r", [1], False)]] * 1000]})
        worker = ClusterWorker(handle, board=None)
        await worker.add_many([request("r")], OutputSink(asyncio.get_running_loop()))
        worker.abort(["r"])
        await asyncio.sleep(0.01)
        assert handle.responses[0].cancelled
        worker.shutdown()
        with pytest.raises(Exception, match="shutting down"):
            await worker.add_many([request("r")], OutputSink(asyncio.get_running_loop()))
    asyncio.run(main())


def test_aggregate_metrics_sums_replicas():
    snaps = [ReplicaSnapshot("a", 1, 1, 0.0, {"prompt_tokens_computed": 5, "num_running": 1}, {}, 0),
             ReplicaSnapshot("b", 2, 1, 0.0, {"prompt_tokens_computed": 7}, {}, 0)]
    assert aggregate_metrics(snaps) == {"prompt_tokens_computed": 12, "num_running": 1}
