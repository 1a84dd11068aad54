"""Prometheus metrics of one server (a per-app `CollectorRegistry`, never the global one).

Server-side series are observed by the request handlers; engine-side series are read from the
engine thread's latest `engine.metrics()` snapshot at scrape time, so a scrape never touches the
engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from forkpoint.server.gc_pauses import GENERATIONS

# engine.metrics() key -> (metric name without "_total", help); exposed as counters
ENGINE_COUNTERS = {
    "prompt_tokens_total": ("forkpoint_prompt_tokens", "Prompt tokens of all requests (markers excluded)."),
    "prompt_tokens_computed": ("forkpoint_prompt_tokens_computed", "Prompt tokens run through the model."),
    "generation_tokens_total": ("forkpoint_generation_tokens", "Generated tokens."),
    "checkpoints_created": ("forkpoint_checkpoints_created", "Checkpoints written."),
    "checkpoint_hits": ("forkpoint_checkpoint_hits", "Requests that started from a checkpoint."),
    "checkpoints_evicted": ("forkpoint_checkpoints_evicted", "Idle checkpoints evicted from a full pool."),
    "checkpoints_evicted_session_latest": ("forkpoint_checkpoints_evicted_session_latest",
                                           "Evicted checkpoints that were a live chat session's newest (value "
                                           "eviction takes them after every other automatic checkpoint)."),
    "checkpoints_unspilled_passed": ("forkpoint_checkpoints_unspilled_passed",
                                     "Evicted checkpoints not spilled to the host tier: a chat turn's end that "
                                     "its session's next turn read, read no more than that once."),
    "requests_deferred": ("forkpoint_requests_deferred", "Requests deferred behind an unready checkpoint."),
    "producer_promotions": ("forkpoint_producer_promotions", "Consumers promoted to producer after a producer failed."),
    "deferral_wait_s_total": ("forkpoint_deferral_wait_seconds", "Seconds requests spent deferred."),
    "steps_retried_for_memory": ("forkpoint_steps_retried_for_memory",
                                 "Steps that ran out of memory and were requeued in smaller steps."),
    "requests_failed_for_memory": ("forkpoint_requests_failed_for_memory",
                                   "Requests that ran out of memory alone in the smallest step (a 400)."),
    "cuda_graph_core_capture_failures": ("forkpoint_cuda_graph_core_capture_failures",
                                         "Steps whose recurrent-core CUDA graph capture failed (their cores ran "
                                         "eagerly)."),
    "cuda_graph_core_replay_steps": ("forkpoint_cuda_graph_core_replay_steps",
                                     "Steps whose later recurrent cores replayed a captured core graph."),
    # speculative decoding (--speculative-config), vLLM's spec_decode_* series
    "spec_verifications": ("forkpoint_spec_decode_num_drafts",
                           "Verifications of drafted tokens: one per sequence and step that verified drafts."),
    "spec_draft_tokens": ("forkpoint_spec_decode_num_draft_tokens", "Draft tokens verified by the target model."),
    "spec_accepted_tokens": ("forkpoint_spec_decode_num_accepted_tokens", "Draft tokens the target model accepted."),
}
# engine.metrics() key prefix (draft position i >= 1 follows) -> (metric name without "_total", help);
# exposed labelled by `position` from 0, as vLLM's spec_decode_num_accepted_tokens_per_pos
SPEC_PER_POSITION = {
    "spec_accepted_tokens_pos_": ("forkpoint_spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position (0: the first draft token)."),
    "spec_draft_tokens_pos_": ("forkpoint_spec_decode_num_draft_tokens_per_pos",
                               "Draft tokens verified, by draft position (0: the first draft token)."),
}
# pool name -> (used key, total key) of engine.metrics()
ENGINE_POOLS = {
    "kv_blocks": ("kv_blocks_used", "kv_blocks_total"),
    "state_slots": ("state_slots_used", "state_slots_total"),
    "checkpoint_slots": ("checkpoint_slots_used", "checkpoint_slots_total"),
}
OUTCOMES = ("success", "invalid_request", "rejected", "aborted", "error")
# the parts of the time to first token (server/generation.py), each a histogram forkpoint_request_<part>_time_seconds
FIRST_TOKEN_PARTS = {
    "request": "From the HTTP request reaching the application (its headers parsed) to its handler: the body "
               "read, parsed and validated, per request.",
    "prompt": "From the request reaching its handler to its prompts being handed to the engine thread (chat "
              "template rendered, tokenised, admitted, a structured-output grammar compiled), per request.",
    "handoff": "From the prompts handed to the engine thread to the engine taking them (between two steps), "
               "per prompt.",
    "queue": "From the engine taking a prompt to a step first scheduling it, per prompt.",
    "prefill": "From a prompt's first scheduling to its first sampled token, per prompt.",
    "delivery": "From a prompt's first sampled token to its handler seeing it, per prompt.",
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """Prometheus view of an engine metrics snapshot; keys the snapshot lacks are left out."""

    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        values = self._snapshot()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in values:
                yield CounterMetricFamily(name, doc, value=values[key])
        for prefix, (name, doc) in SPEC_PER_POSITION.items():
            positions = sorted(int(key[len(prefix):]) for key in values if key.startswith(prefix))
            if positions:
                family = CounterMetricFamily(name, doc, labels=["position"])
                for i in positions:
                    family.add_metric([str(i - 1)], values[f"{prefix}{i}"])
                yield family
        if "prompt_tokens_total" in values and "prompt_tokens_computed" in values:
            yield CounterMetricFamily(
                "forkpoint_prompt_tokens_reused", "Prompt tokens taken from checkpoints instead of computed.",
                value=values["prompt_tokens_total"] - values["prompt_tokens_computed"],
            )
        per_kind = {  # engine.metrics() key prefix -> (metric name, help), labelled by checkpoint kind
            "checkpoints_created_": ("forkpoint_checkpoints_created_by_kind", "Checkpoints written, by kind."),
            "checkpoint_hits_": ("forkpoint_checkpoint_hits_by_kind", "Segments that read a checkpoint, by kind."),
            "checkpoint_tokens_saved_": ("forkpoint_checkpoint_tokens_saved", "Prompt tokens read from checkpoints."),
            "checkpoints_evicted_": ("forkpoint_checkpoints_evicted_by_kind", "Checkpoints evicted, by kind."),
        }
        for prefix, (name, doc) in per_kind.items():
            family = CounterMetricFamily(name, doc, labels=["kind"])
            for key, value in values.items():
                if key.startswith(prefix):
                    family.add_metric([key[len(prefix):]], value)
            yield family
        misses = CounterMetricFamily("forkpoint_cache_misses", "Prompts whose reuse stopped short of what they "
                                     "share with earlier prompts, by reason (docs/server.md).", labels=["reason"])
        for key, value in values.items():
            if key.startswith("cache_misses_"):
                misses.add_metric([key.removeprefix("cache_misses_")], value)
        yield misses
        tier = CounterMetricFamily("forkpoint_host_tier_checkpoints", "Checkpoints moved to or from the host "
                                   "tier, by event.", labels=["event"])
        for event in ("spilled", "restored"):
            if f"checkpoints_{event}" in values:
                tier.add_metric([event], values[f"checkpoints_{event}"])
        yield tier
        declined = CounterMetricFamily("forkpoint_checkpoint_restores_declined",
                                       "Host or disk tier hits recomputed instead: moving them back was measured to "
                                       "cost more than twice the recompute (docs/server.md).", labels=["tier"])
        costs = GaugeMetricFamily("forkpoint_reuse_cost_seconds", "The measured costs the restore-or-recompute rule "
                                  "weighs: seconds per prompt token, decode or byte (docs/server.md).", labels=["cost"])
        for key, value in values.items():
            if key.startswith("checkpoint_restores_declined_"):
                declined.add_metric([key.removeprefix("checkpoint_restores_declined_")], value)
            elif key.startswith("reuse_"):
                costs.add_metric([key.removeprefix("reuse_")], value)
        yield declined
        yield costs
        if "checkpoints_pending" in values:
            yield GaugeMetricFamily("forkpoint_checkpoints_pending", "Checkpoints being produced (unready).",
                                    value=values["checkpoints_pending"])
        used = GaugeMetricFamily("forkpoint_pool_used", "Entries in use per cache pool.", labels=["pool"])
        capacity = GaugeMetricFamily("forkpoint_pool_capacity", "Entries per cache pool.", labels=["pool"])
        for pool, (used_key, total_key) in ENGINE_POOLS.items():
            if used_key in values and total_key in values:
                used.add_metric([pool], values[used_key])
                capacity.add_metric([pool], values[total_key])
        yield used
        yield capacity
        if "gc_collections_gen0" in values:  # the serving process's garbage collector (server/gc_pauses.py)
            collections = CounterMetricFamily("forkpoint_gc_collections", "Garbage collections of the serving "
                                              "process by generation (each holds the GIL).", labels=["generation"])
            paused = CounterMetricFamily("forkpoint_gc_pause_seconds", "Seconds the serving process's garbage "
                                         "collections took, by generation.", labels=["generation"])
            for generation in GENERATIONS:
                collections.add_metric([str(generation)], values[f"gc_collections_gen{generation}"])
                paused.add_metric([str(generation)], values[f"gc_pause_seconds_gen{generation}"])
            yield collections
            yield paused
            yield GaugeMetricFamily("forkpoint_gc_longest_pause_seconds", "The longest garbage collection so far.",
                                    value=values["gc_longest_pause_seconds"])


class ServerMetrics:
    """All series of one app. `requests` is labelled by endpoint (one of `endpoints`) and outcome
    (`OUTCOMES`); every combination is exported from the start, at 0."""

    def __init__(self, engine_snapshot: Callable[[], dict[str, float]], waiting: Callable[[], int],
                 running: Callable[[], int], endpoints: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("forkpoint_requests", "HTTP generation requests by outcome.",
                                ["endpoint", "outcome"], registry=self.registry)
        for endpoint in endpoints:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint=endpoint, outcome=outcome)
        self.ttft = Histogram("forkpoint_time_to_first_token_seconds",
                              "From arrival to the first generated token, per prompt.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("forkpoint_e2e_request_latency_seconds",
                             "From arrival to the last generated token, per prompt.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        # the time to first token, part by part (server/generation.py): vLLM's request_queue_time_seconds and
        # request_prefill_time_seconds, and the server's own parts before and after the engine
        self.first_token_parts = {part: Histogram(f"forkpoint_request_{part}_time_seconds", doc,
                                                  buckets=LATENCY_BUCKETS, registry=self.registry)
                                  for part, doc in FIRST_TOKEN_PARTS.items()}
        Gauge("forkpoint_requests_waiting", "Sequences (prompts x n) admitted without a first token yet.",
              registry=self.registry).set_function(waiting)
        Gauge("forkpoint_requests_running", "Sequences (prompts x n) generating tokens.",
              registry=self.registry).set_function(running)
        self.registry.register(EngineCollector(engine_snapshot))

    def observe_first_token(self, **seconds: float) -> None:
        """One prompt's time to first token by part (keys: `FIRST_TOKEN_PARTS`)."""
        for part, value in seconds.items():
            self.first_token_parts[part].observe(value)

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
