"""/metrics: Prometheus text with request outcomes, token reuse, latencies, checkpoints and pools."""

from __future__ import annotations

import httpx

from tests.server.conftest import MARKER

EXPECTED_SERIES = [
    "forkpoint_requests_total", "forkpoint_prompt_tokens_total", "forkpoint_prompt_tokens_computed_total",
    "forkpoint_prompt_tokens_reused_total", "forkpoint_generation_tokens_total",
    "forkpoint_time_to_first_token_seconds_count", "forkpoint_e2e_request_latency_seconds_bucket",
    "forkpoint_checkpoints_created_total", "forkpoint_checkpoint_hits_total", "forkpoint_checkpoints_evicted_total",
    "forkpoint_checkpoints_pending", "forkpoint_requests_deferred_total", "forkpoint_producer_promotions_total",
    "forkpoint_deferral_wait_seconds_total", "forkpoint_pool_used", "forkpoint_pool_capacity",
    "forkpoint_requests_waiting", "forkpoint_requests_running",
]


def test_metrics_exposition(server):
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    names = {name for name, _ in server.metrics()}
    assert not [s for s in EXPECTED_SERIES if s not in names]
    for pool in ("kv_blocks", "state_slots", "checkpoint_slots"):
        assert server.metric("forkpoint_pool_capacity", pool=pool) > 0
    # a per-app registry: the process-global one has none of these series
    assert "python_gc_objects_collected_total" not in response.text


def test_metrics_count_a_one_to_two_run(server, anchor_text):
    server.wait_idle()
    anchor = anchor_text("metrics")
    anchor_len = server.post("/tokenize", json={"prompt": anchor}).json()["count"]
    before = server.metrics()
    client = server.client()
    outs = [client.completions.create(model=server.model, prompt=anchor + MARKER + q, max_tokens=2)
            for q in (" first", " second")]
    server.wait_idle()
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    assert delta("forkpoint_requests_total", endpoint="completions", outcome="success") == 2
    assert delta("forkpoint_prompt_tokens_total") == prompt_tokens
    assert delta("forkpoint_prompt_tokens_reused_total") == anchor_len
    assert delta("forkpoint_prompt_tokens_computed_total") == prompt_tokens - anchor_len
    assert delta("forkpoint_generation_tokens_total") == 4
    assert delta("forkpoint_checkpoints_created_total") == 1
    assert delta("forkpoint_checkpoint_hits_total") == 1
    assert delta("forkpoint_time_to_first_token_seconds_count") == 2
    assert delta("forkpoint_e2e_request_latency_seconds_count") == 2
    assert after[("forkpoint_checkpoints_pending", ())] == 0
    assert after[("forkpoint_pool_used", (("pool", "state_slots"),))] == 0
    assert after[("forkpoint_pool_used", (("pool", "checkpoint_slots"),))] >= 1
    # the restore-or-recompute rule's measured prefill cost, and its declines per tier (none here)
    assert after[("forkpoint_reuse_cost_seconds", (("cost", "prefill_s_per_token"),))] > 0
    assert after[("forkpoint_checkpoint_restores_declined_total", (("tier", "host"),))] == 0


def test_time_to_first_token_parts_add_up_to_it(server):
    """Each streamed chat request's time to first token, from its arrival at the application, splits into
    request (body read and validated), prompt, hand-off, queue, prefill and delivery (one histogram
    each); the parts add up to the whole."""
    server.wait_idle()
    parts = ("request", "prompt", "handoff", "queue", "prefill", "delivery")
    before = server.metrics()
    client = server.client()
    for question in ("Which river?", "Which city?"):
        stream = client.chat.completions.create(model=server.model, max_tokens=3, stream=True,
                                                messages=[{"role": "user", "content": question}])
        assert [chunk for chunk in stream]
    server.wait_idle()
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    assert delta("forkpoint_time_to_first_token_seconds_count") == 2
    for part in parts:
        assert delta(f"forkpoint_request_{part}_time_seconds_count") == 2, part
        assert delta(f"forkpoint_request_{part}_time_seconds_sum") >= 0, part
    total = sum(delta(f"forkpoint_request_{part}_time_seconds_sum") for part in parts)
    assert abs(total - delta("forkpoint_time_to_first_token_seconds_sum")) < 1e-6
    assert delta("forkpoint_request_prefill_time_seconds_sum") > 0
    assert delta("forkpoint_request_request_time_seconds_sum") > 0  # the stamp precedes the handler
