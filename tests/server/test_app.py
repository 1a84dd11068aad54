"""The app's start-up (server/app.py): what is built before the first request is served."""

from __future__ import annotations

from forkpoint import LLM
from forkpoint.server.app import body_limits
from forkpoint.server.config import ServerConfig
from forkpoint.server.json_body import BodyLimits
from tests.server.conftest import TEST_LLM_KWARGS, serve


def test_startup_builds_the_grammar_vocabulary_before_serving():
    """Structured outputs' vocabulary view is built at start-up: the first constrained request
    does not hold the engine thread (and every stream) for seconds building it."""
    llm = LLM(**TEST_LLM_KWARGS)
    assert not llm.engine.grammars.prepared
    with serve(llm, ServerConfig()) as srv:
        assert srv.engine_call(lambda engine: engine.grammars.prepared)


def test_body_limits_default_from_the_context_length_and_follow_the_flags():
    """8,192 objects and 2^18 values up to 131,072-token contexts; past that one object per 16 tokens and
    two token-id prompts; the flags win."""
    assert body_limits(ServerConfig(), 4096) == BodyLimits(8192, 262_144)
    assert body_limits(ServerConfig(), 262_144) == BodyLimits(16_384, 524_288)
    assert body_limits(ServerConfig(), 1_048_576) == BodyLimits(65_536, 2_097_152)
    assert body_limits(ServerConfig(max_request_objects=10, max_request_values=20), 262_144) == BodyLimits(10, 20)
