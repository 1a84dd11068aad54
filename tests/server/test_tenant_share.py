"""Through HTTP: one client (its `user`) that floods unique marked prefixes cannot evict another
client's checkpoints (cache/eviction.py, per-tenant shares); without `user` fields it can."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from forkpoint.server.config import ServerConfig
from tests.server.conftest import MARKER, TEST_LLM_KWARGS, serve

FLOOD = 2 * TEST_LLM_KWARGS["checkpoint_pool_size"]


def _cached(srv, prompt: str, user: str | None) -> int:
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 1} | ({"user": user} if user else {})
    response = srv.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _flood_then_return(srv, anchor: str, victim: str | None, flood: str | None) -> int:
    """The victim's marked anchor, then FLOOD unique marked prompts; the victim's cached tokens when it
    comes back to its anchor."""
    assert _cached(srv, f"{anchor}{MARKER} first question", victim) == 0
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _cached(srv, f"flood {i} " * 12 + MARKER + " q", flood), range(FLOOD)))
    return _cached(srv, f"{anchor}{MARKER} second question", victim)


def test_a_flooding_client_keeps_to_its_share(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig()) as srv:
        assert _flood_then_return(srv, anchor_text("shared-tenant"), None, None) == 0  # one tenant: evicted
        srv.wait_idle()
        assert srv.engine_call(lambda engine: engine.reset_prefix_cache())
        cached = _flood_then_return(srv, anchor_text("own-tenant"), "victim", "flood")
        assert cached > 40  # the ~60-token anchor, read from the victim's checkpoint
        srv.wait_idle()
        srv.engine_call(lambda engine: engine.check_integrity())
