"""The ingress's engine worker over many replicas: `ClusterWorker` has the `add_many` / `abort` /
`metrics_snapshot` surface of `server.worker.EngineWorker`, so the server's `OpenAIServing` and
`Generation` run unchanged on top of it.

Each prompt is one streaming call of `EngineReplica.generate` through the deployment handle (the
handle's request router picks the replica). Faults, per prompt:

    replica dies / drains before any output was delivered  -> sent again (the router no longer
                                                             offers the dead replica), up to
                                                             `max_attempts` sends in all
    replica dies after outputs were delivered              -> the prompt's sink gets EngineFailure
    the engine rejects the prompt (ValueError)             -> add_many raises it; nothing is left
                                                             running on any replica
A dead replica's calls fail as soon as Ray notices the process is gone (its connection drops), so
no prompt waits on a dead replica; a hung one is killed by Serve's health check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import (
    NodeDiedError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from forkpoint.server.replicas.deployment import ReplicaSnapshot
from forkpoint.server.replicas.router import GENERATE_METHOD
from forkpoint.server.worker import (
    EngineFailure,
    NewRequest,
    OutputSink,
    ServerShuttingDown,
)

logger = logging.getLogger("forkpoint.distributed")

REPLICA_GONE = (RayActorError, WorkerCrashedError, NodeDiedError)


def _cause(exc: BaseException) -> BaseException:
    """The replica-side exception inside Ray's wrapper (RayTaskError carries it as `cause`)."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


def _replica_gone(exc: BaseException) -> bool:
    return isinstance(exc, REPLICA_GONE) or isinstance(_cause(exc), ServerShuttingDown)


class _Call:
    """One prompt's streaming call; `start` sends it until a replica accepts it, `pump` moves its
    outputs into the sink (sending it again when its replica dies before any output)."""

    def __init__(self, handle: DeploymentHandle, request: NewRequest, sink: OutputSink, max_attempts: int) -> None:
        self.request = request
        self._handle = handle
        self._sink = sink
        self._attempts_left = max_attempts
        self._response: DeploymentResponseGenerator | None = None
        self.delivered = False
        self.retries = 0

    async def start(self) -> None:
        """Send until a replica accepts (its first item). Raises the engine's ValueError (with the
        engine's message), or EngineFailure once every attempt found its replica gone."""
        while True:
            self._attempts_left -= 1
            self._response = self._handle.remote(self.request)
            try:
                await self._response.__anext__()
                return
            except Exception as exc:  # whatever the replica raised is sorted out below
                self._response = None
                cause = _cause(exc)
                if isinstance(cause, ValueError):
                    raise ValueError(str(cause)) from None  # the engine's error, unwrapped
                if not _replica_gone(exc) or self._attempts_left <= 0:
                    raise EngineFailure(f"no replica could take request {self.request.request_id}: "
                                        f"{type(cause).__name__}: {cause}") from None
                self.retries += 1
                logger.warning("replica gone before request %s started; sending it again", self.request.request_id)

    async def pump(self) -> None:
        while True:
            try:
                assert self._response is not None
                async for item in self._response:
                    if item:
                        self.delivered = True
                        self._sink.deliver_threadsafe(item)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # sorted out below: the prompt never hangs
                self._response = None
                cause = _cause(exc)
                if _replica_gone(exc) and not self.delivered and self._attempts_left > 0:
                    self.retries += 1
                    logger.warning("replica gone before request %s streamed; sending it again",
                                   self.request.request_id)
                    try:
                        await self.start()
                        continue
                    except Exception as again:  # ends the prompt with this error
                        cause = again
                self._sink.deliver_threadsafe(EngineFailure(
                    f"the replica serving request {self.request.request_id} failed: {type(cause).__name__}: {cause}"))
                return

    def cancel(self) -> None:
        if self._response is not None:
            self._response.cancel()


class ClusterWorker:
    """`EngineWorker`'s surface over the replicas behind `handle` (on the ingress's event loop).

    board: the `ReplicaBoard` actor the replicas publish to; `refresh()` reads it (the app's
    lifespan calls it every `poll_s`), `metrics_snapshot()` sums the replicas' engine metrics and
    `snapshots()` gives them one by one.
    """

    def __init__(self, handle: DeploymentHandle, board: Any, *, max_attempts: int = 3, poll_s: float = 0.5) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._handle = handle.options(stream=True, method_name=GENERATE_METHOD)
        self._board = board
        self._max_attempts = max_attempts
        self.poll_s = poll_s
        self._calls: dict[str, tuple[_Call, asyncio.Task]] = {}
        self._snapshots: list[ReplicaSnapshot] = []
        self._closed = False
        self.retries = 0

    async def add_many(self, requests: Sequence[NewRequest], sink: OutputSink) -> None:
        """Send every request (all or none): raises the first ValueError of the engine, or
        `ServerShuttingDown` / `EngineFailure`; nothing stays running then."""
        if self._closed:
            raise ServerShuttingDown("the server is shutting down")
        calls = [_Call(self._handle, request, sink, self._max_attempts) for request in requests]
        try:
            results = await asyncio.gather(*(call.start() for call in calls), return_exceptions=True)
        except BaseException:  # cancelled while sending: calls that landed must not run on
            for call in calls:
                call.cancel()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for call in calls:
                call.cancel()
            raise next((e for e in errors if isinstance(e, ValueError)), errors[0])
        for call in calls:
            self._calls[call.request.request_id] = (call, asyncio.ensure_future(self._run(call)))

    async def _run(self, call: _Call) -> None:
        try:
            await call.pump()
        finally:
            self.retries += call.retries
            self._calls.pop(call.request.request_id, None)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Cancel these prompts' calls (the replicas abort them); unknown ids are ignored."""
        for request_id in request_ids:
            entry = self._calls.pop(request_id, None)
            if entry is not None:
                call, task = entry
                call.cancel()
                task.cancel()

    def shutdown(self) -> None:
        """Refuse new requests and cancel the running ones."""
        self._closed = True
        self.abort(list(self._calls))

    # ---- metrics ------------------------------------------------------------------------------

    async def refresh(self) -> list[ReplicaSnapshot]:
        self._snapshots = await self._board.snapshots.remote()
        return self._snapshots

    def snapshots(self) -> list[ReplicaSnapshot]:
        """The replicas' latest snapshots as of the last `refresh()`."""
        return self._snapshots

    def metrics_snapshot(self) -> dict[str, float]:
        """The replicas' engine metrics summed (counters of replicas that died included)."""
        return aggregate_metrics(self._snapshots)

    def live_replicas(self, max_age_s: float) -> list[ReplicaSnapshot]:
        now = time.time()
        return [s for s in self._snapshots if now - s.published_at <= max_age_s]


def aggregate_metrics(snapshots: Sequence[ReplicaSnapshot]) -> dict[str, float]:
    """Sum of the replicas' `LLM.metrics()` (a key missing on a replica counts 0 there)."""
    total: dict[str, float] = {}
    for snapshot in snapshots:
        for key, value in snapshot.metrics.items():
            total[key] = total.get(key, 0) + value
    return total
