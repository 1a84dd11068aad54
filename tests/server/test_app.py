"""The app's start-up (server/app.py): what is built before the first request is served."""

from __future__ import annotations

from forkpoint import LLM
from forkpoint.server.config import ServerConfig
from tests.server.conftest import TEST_LLM_KWARGS, serve


def test_startup_builds_the_grammar_vocabulary_before_serving():
    """Structured outputs' vocabulary view is built at start-up: the first constrained request
    does not hold the engine thread (and every stream) for seconds building it."""
    llm = LLM(**TEST_LLM_KWARGS)
    assert not llm.engine.grammars.prepared
    with serve(llm, ServerConfig()) as srv:
        assert srv.engine_call(lambda engine: engine.grammars.prepared)
