"""The restore-versus-recompute rule over HTTP: a host tier hit priced above the compute it saves is
recomputed, and the request's usage and /metrics say `recompute_faster` (docs/server.md)."""

from __future__ import annotations

from forkpoint import LLM
from forkpoint.cache.reuse_rates import MeasuredCost
from forkpoint.server.config import ServerConfig
from tests.server.conftest import MARKER, TEST_LLM_KWARGS, serve


def _price_host_restores(engine) -> None:
    """A second per byte to move anything back from the host tier (decay 1: declines do not age it)."""
    engine.registry.rates.host_restore = MeasuredCost(1.0, 1.0, decay=1.0)


def test_a_declined_host_hit_says_recompute_faster_in_usage_and_metrics(anchor_text):
    llm = LLM(**{**TEST_LLM_KWARGS, "checkpoint_pool_size": 1, "checkpoint_host_bytes": 64 << 20,
                 "auto_checkpoints": True})
    with serve(llm, ServerConfig(served_model_name="rule")) as running:
        running.engine_call(_price_host_restores)
        client = running.client()
        first, other = anchor_text("rule-first"), anchor_text("rule-other")
        for anchor in (first, other):  # the second anchor's checkpoint spills the first's to the host tier
            client.completions.create(model="rule", prompt=anchor + MARKER + " question", max_tokens=2)
        assert running.engine_call(lambda engine: engine.metrics()["checkpoints_spilled"]) >= 1
        again = client.completions.create(model="rule", prompt=first + " another question", max_tokens=2)
        details = again.usage.prompt_tokens_details
        assert details.cached_tokens == 0 and details.model_extra["cache_miss_reason"] == "recompute_faster"
        running.wait_idle()
        assert running.metric("forkpoint_cache_misses_total", reason="recompute_faster") == 1
        assert running.metric("forkpoint_checkpoint_restores_declined_total", tier="host") >= 1
        assert running.metric("forkpoint_reuse_cost_seconds", cost="prefill_s_per_token") > 0
        running.engine_call(lambda engine: engine.check_integrity())
