"""Engine replicas as Ray Serve deployments, and the board where they publish their metrics.

    ingress (ClusterWorker)                       replica i (EngineReplica, own process, own GPU)
    -----------------------                       ------------------------------------------------
    handle.generate.remote(NewRequest) --router--> generate(): EngineWorker.add_many -> yield []  (ack)
                                   <-- stream ---  yield [RequestOutput]  (one item per engine step)
    board.snapshots.remote()  <------------------  board.publish(ReplicaSnapshot)  after each request
                                                   and each routing-stats period
    router (in the ingress process) <-controller-  record_routing_stats(): ready checkpoint keys, load

One replica is one `LLM` driven by the server's `EngineWorker` (the same engine thread as the
single-process server). `deploy_replicas` starts N of them behind the checkpoint-affine router
(or the round-robin baseline).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from forkpoint.llm import LLM
from forkpoint.outputs import RequestOutput
from forkpoint.server.replicas.router import (
    STATS_KEYS,
    CheckpointAffineRouter,
    Decision,
    RoundRobinRouter,
)
from forkpoint.server.worker import EngineWorker, NewRequest, OutputSink

DEPLOYMENT_NAME = "EngineReplica"
ROUTERS = {"affine": CheckpointAffineRouter, "round_robin": RoundRobinRouter}


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to know about the engines (the same for every replica)."""

    model_path: str
    max_model_len: int
    block_size: int
    checkpoint_token: str
    checkpoint_token_id: int | None
    max_checkpoints_per_request: int
    default_max_tokens: int | None  # the model's generation_config.json max_new_tokens
    turn_boundaries: bool = False  # automatic checkpoints on: chat prompts carry their turn boundaries


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica's state as it last published it.

    replica: Serve's unique replica id; pid: its process; seq: publication number (increasing per
    replica); published_at: `time.time()` on the replica; metrics: `LLM.metrics()` as of the
    engine's last step; routes: requests received per routing decision (`Decision` values);
    checkpoint_keys: how many ready checkpoints it holds.
    """

    replica: str
    pid: int
    seq: int
    published_at: float
    metrics: dict[str, float]
    routes: dict[str, int]
    checkpoint_keys: int


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """The latest `ReplicaSnapshot` of every replica that ever published (dead ones stay: their
    counters still count in the cluster's totals)."""

    def __init__(self) -> None:
        self._latest: dict[str, ReplicaSnapshot] = {}

    def publish(self, snapshot: ReplicaSnapshot) -> None:
        current = self._latest.get(snapshot.replica)
        if current is None or snapshot.seq > current.seq:
            self._latest[snapshot.replica] = snapshot

    def snapshots(self) -> list[ReplicaSnapshot]:
        return sorted(self._latest.values(), key=lambda s: s.replica)


@dataclass(frozen=True)
class ReplicaOptions:
    """How to run the replicas.

    num_replicas: engines (`--data-parallel-size`). router: "affine" or "round_robin".
    num_cpus / num_gpus: Ray resources of each replica; on CPU each replica's torch uses
    `num_cpus` threads (Ray sets OMP_NUM_THREADS to them unless the environment sets it), on GPU
    each replica gets its own device (`num_gpus=1`); None: 1 when the engine's device is cuda, or
    auto on a cluster with GPUs (`ReplicaCluster` resolves it).
    max_ongoing_requests: prompts in flight per replica before Serve holds new ones back (the
    engine's own queue does the batching, so this is large). stats_period_s: how often replicas
    report their checkpoint keys and publish metrics. balance_abs_threshold,
    balance_rel_threshold, pin_ttl_s: see `router.CheckpointAffinityPolicy`.
    """

    num_replicas: int
    router: str = "affine"
    num_cpus: float = 1
    num_gpus: float | None = None
    max_ongoing_requests: int = 4096
    stats_period_s: float = 0.5
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    pin_ttl_s: float = 60.0
    app_name: str = "forkpoint"
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 10.0
    extra_actor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {self.router!r}")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be > 0, got {self.stats_period_s}")


class EngineReplica:
    """One engine in a Serve replica. `engine_kwargs` are `LLM`'s keyword arguments."""

    def __init__(self, engine_kwargs: dict[str, Any], board: Any) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._llm = LLM(**engine_kwargs)
        self._worker = EngineWorker(self._llm.engine)
        self._worker.start()
        self._board = board
        self._routes: Counter[str] = Counter({d.value: 0 for d in Decision})
        self._seq = 0
        self._num_keys = 0
        engine = self._llm.engine
        self._info = ReplicaInfo(str(engine.model_path), engine.max_model_len, engine.config.block_size,
                                 engine.config.checkpoint_token, self._llm.checkpoint_token_id,
                                 engine.config.max_checkpoints_per_request,
                                 engine.generation_defaults.max_new_tokens,
                                 engine.config.enable_checkpoints and engine.config.auto_checkpoints)
        self._publish()

    def info(self) -> ReplicaInfo:
        return self._info

    async def generate(self, request: NewRequest, route: str = "direct") -> AsyncIterator[list[RequestOutput]]:
        """Run one prompt: first yield `[]` once the engine accepted it (a ValueError naming the
        problem otherwise), then its outputs, one list per engine step that reports it, until it finishes
        (a streamed request's are deltas until the finished one; one that does not stream gets its first
        token's and its finished output: `NewRequest.stream`).
        Cancelling the call aborts the prompt. `route` is the router's decision, counted here."""
        self._routes[route] += 1
        finished = False
        try:  # every way out publishes the route counted (and aborts what did not finish; unknown ids are ignored)
            spec = request.params.structured_outputs
            if spec is not None:  # compiled here, not on the engine thread, as one server does (grammar_threads.py)
                await asyncio.to_thread(self._llm.engine.grammars.ensure_compiled, spec)
            sink = OutputSink(asyncio.get_running_loop())
            await self._worker.add_many([request], sink)
            yield []
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = any(output.finished for output in item)
                yield item
        finally:
            if not finished:
                self._worker.abort([request.request_id])
            self._publish()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this every `stats_period_s`: the router reads the keys, the board the metrics."""
        keys = await asyncio.wrap_future(self._worker.call(lambda _engine: self._llm.checkpoint_keys()))
        self._num_keys = len(keys)
        self._publish()
        metrics = self._worker.metrics_snapshot()
        return {STATS_KEYS: sorted(k.hex() for k in keys),
                "load": metrics.get("num_waiting", 0) + metrics.get("num_running", 0)}

    def check_health(self) -> None:
        if not self._worker.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def _publish(self) -> None:
        self._seq += 1
        self._board.publish.remote(ReplicaSnapshot(
            self.replica_id, os.getpid(), self._seq, time.time(), dict(self._worker.metrics_snapshot()),
            dict(self._routes), self._num_keys))

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.shutdown(timeout_s=0.0)


def deploy_replicas(engine_kwargs: dict[str, Any], options: ReplicaOptions, board: Any) -> DeploymentHandle:
    """Start `options.num_replicas` engines as the Serve application `options.app_name` (Ray and
    Serve must be running) and return the handle whose calls the chosen router routes. Blocks until
    every replica has loaded its model."""
    router_kwargs: dict[str, Any] = {}
    if options.router == "affine":
        router_kwargs = {"block_size": engine_kwargs.get("block_size", 16),
                         "balance_abs_threshold": options.balance_abs_threshold,
                         "balance_rel_threshold": options.balance_rel_threshold, "pin_ttl_s": options.pin_ttl_s}
    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus,
                                     **options.extra_actor_options}
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=options.num_replicas,
        max_ongoing_requests=options.max_ongoing_requests, ray_actor_options=actor_options,
        health_check_period_s=options.health_check_period_s, health_check_timeout_s=options.health_check_timeout_s,
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.5,
        logging_config={"log_level": "WARNING", "enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.router], request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=options.stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 4 * options.stats_period_s)),
    )
    return serve.run(deployment.bind(engine_kwargs, board), name=options.app_name, route_prefix=None)
