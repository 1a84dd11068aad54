"""The OpenAI-compatible endpoint in front of the replicas: the server's own request handling
(`OpenAIServing`, `PromptBuilder`, admission, errors) over a `ClusterWorker` instead of one engine.

Prompts are tokenised here (with the engines' tokenizer and marker, in one tokenizer thread), so the
router sees the exact marker-free ids and checkpoint positions that the engine will hash. As in
`server.app`, bodies over --max-request-bytes get 413 before they are read and the lifespan logs
a periodic stats line (of the replicas' summed metrics). Images are not taken (a 400):
their content hashes enter the checkpoint keys and only the engine computes them.

/metrics has the single server's series (engine counters summed over the replicas, dead ones
included), and per replica, labelled `replica`:
`forkpoint_replica_prompt_tokens_computed_total` (and the other engine counters),
`forkpoint_replica_checkpoints_held`, `forkpoint_replica_requests_in_flight`, `forkpoint_replica_up`,
`forkpoint_routing_decisions_total{replica, decision}`; and `forkpoint_replica_retries_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from transformers import PreTrainedTokenizerBase

from forkpoint.inputs.segment_tokens import SegmentEncoder
from forkpoint.server.app import GENERATION_ENDPOINTS, add_openai_routes, body_limits, install_request_guards
from forkpoint.server.config import ServerConfig
from forkpoint.server.generation import Admission
from forkpoint.server.limits import default_max_request_bytes
from forkpoint.server.metrics import ENGINE_COUNTERS, ServerMetrics
from forkpoint.server.prompt_threads import PromptThreads
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.replicas.cluster import ClusterWorker
from forkpoint.server.replicas.deployment import ReplicaInfo, ReplicaSnapshot
from forkpoint.server.response_store import ResponseStore
from forkpoint.server.serving import OpenAIServing
from forkpoint.server.stats import log_stats_forever

logger = logging.getLogger("forkpoint.server")


class ReplicaCollector(Collector):
    """Per-replica series from the cluster worker's latest snapshots (`up_age_s`: a replica that
    has not published for this long counts as down)."""

    def __init__(self, cluster: ClusterWorker, up_age_s: float) -> None:
        self._cluster = cluster
        self._up_age_s = up_age_s

    def collect(self) -> Iterator[Metric]:
        snapshots: list[ReplicaSnapshot] = self._cluster.snapshots()
        now = time.time()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name.replace("forkpoint_", "forkpoint_replica_", 1), doc, labels=["replica"])
            for s in snapshots:
                if key in s.metrics:
                    family.add_metric([s.replica], s.metrics[key])
            yield family
        routes = CounterMetricFamily("forkpoint_routing_decisions", "Requests routed to each replica, by decision.",
                                     labels=["replica", "decision"])
        held = GaugeMetricFamily("forkpoint_replica_checkpoints_held", "Ready checkpoints per replica.",
                                 labels=["replica"])
        busy = GaugeMetricFamily("forkpoint_replica_requests_in_flight", "Requests waiting or running per replica.",
                                 labels=["replica"])
        up = GaugeMetricFamily("forkpoint_replica_up", "1 while the replica publishes its metrics.", labels=["replica"])
        for s in snapshots:
            for decision, count in s.routes.items():
                routes.add_metric([s.replica, decision], count)
            held.add_metric([s.replica], s.checkpoint_keys)
            busy.add_metric([s.replica], s.metrics.get("num_waiting", 0) + s.metrics.get("num_running", 0))
            up.add_metric([s.replica], float(now - s.published_at <= self._up_age_s))
        yield from (routes, held, busy, up)
        yield CounterMetricFamily("forkpoint_replica_retries", "Prompts sent again after their replica died.",
                                  value=self._cluster.retries)


def build_cluster_app(cluster: ClusterWorker, info: ReplicaInfo, tokenizer: PreTrainedTokenizerBase,
                      config: ServerConfig, *, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The app serving the replicas behind `cluster`; `tokenizer` must be the engines' (the marker
    registered as `info.checkpoint_token_id`). Its lifespan polls the replicas' metrics every
    `cluster.poll_s` and calls `on_shutdown` at the end."""
    admission = Admission(config.max_waiting_requests, config.retry_after_s,
                          max_per_request=config.max_num_seqs_per_request,
                          max_waiting_per_client=config.max_waiting_per_user)
    metrics = ServerMetrics(cluster.metrics_snapshot, lambda: admission.waiting, lambda: admission.running,
                            endpoints=tuple(GENERATION_ENDPOINTS.values()))
    up_age_s = max(5.0, 10 * cluster.poll_s)
    metrics.registry.register(ReplicaCollector(cluster, up_age_s))
    tokenizer_thread = PromptThreads(1, "forkpoint-tokenizer")  # daemon threads: no join at exit
    prompts = PromptBuilder(tokenizer, checkpoint_token=info.checkpoint_token,
                            checkpoint_token_id=info.checkpoint_token_id,
                            max_checkpoints=info.max_checkpoints_per_request, policy=config.marker_policy,
                            executor=tokenizer_thread, turn_boundaries=info.turn_boundaries,
                            max_model_len=info.max_model_len,
                            segments=(SegmentEncoder(tokenizer, config.token_cache_bytes)
                                      if config.token_cache_bytes > 0 else None),
                            chat_template=config.chat_template)
    max_request_bytes = (config.max_request_bytes if config.max_request_bytes is not None else
                         default_max_request_bytes(tokenizer, info.max_model_len, takes_images=False))
    serving = OpenAIServing(model_name=config.served_model_name, model_aliases=config.served_model_aliases,
                            max_model_len=info.max_model_len,
                            prompts=prompts, worker=cluster, admission=admission, metrics=metrics,
                            default_max_tokens=info.default_max_tokens, cache_isolation=config.cache_isolation,
                            tool_formats=config.tool_formats)
    created = int(time.time())

    async def poll() -> None:
        while True:
            with contextlib.suppress(Exception):  # the board answers again once Ray recovers
                await cluster.refresh()
            await asyncio.sleep(cluster.poll_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        snapshots = await cluster.refresh()
        logger.info("serving %s on %d replicas (max_model_len %d, requests up to %d bytes)",
                    config.served_model_name, len(snapshots), info.max_model_len, max_request_bytes)
        tasks = [asyncio.ensure_future(poll())]
        if config.log_stats:
            stats = log_stats_forever(cluster.metrics_snapshot, config.log_stats_interval_s)
            tasks.append(asyncio.ensure_future(stats))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            cluster.shutdown()
            tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="forkpoint", summary="OpenAI-compatible server over checkpoint-affine replicas",
                  lifespan=lifespan)
    app.state.cluster = cluster
    app.state.metrics = metrics
    app.state.config = config

    install_request_guards(app, metrics, max_request_bytes, body_limits(config, info.max_model_len), config.api_keys,
                           config.cors)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one replica publishes its metrics, 503 otherwise."""
        live = len(cluster.live_replicas(up_age_s))
        if live:
            return JSONResponse({"status": "ok", "replicas": live})
        return JSONResponse({"status": "no replica running", "replicas": 0}, status_code=503)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the probe

    add_openai_routes(app, serving=serving, prompts=prompts, tokenizer=tokenizer, metrics=metrics,
                      model_root=info.model_path, max_model_len=info.max_model_len,
                      served_model_names=config.served_model_names, created=created,
                      response_store=ResponseStore(config.responses_store_bytes))
    return app
