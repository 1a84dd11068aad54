"""Graceful shutdown: in-flight requests finish when they can, are aborted when they cannot, and
the engine is left clean either way."""

from __future__ import annotations

import json
import threading

import httpx

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve


def _stream_in_thread(srv, body: dict, first_chunk: threading.Event, result: dict) -> threading.Thread:
    """POST a streaming completion; set `first_chunk` at its first event; record events and errors."""

    def run() -> None:
        events = []
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
        except httpx.HTTPError as err:
            result["error"] = err
        finally:
            first_chunk.set()
            result["events"] = events

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _stop(srv) -> None:
    srv.uvicorn_server.should_exit = True
    srv.thread.join(timeout=60)
    assert not srv.thread.is_alive()


def _assert_engine_clean(llm) -> None:
    # the engine thread has stopped: the test thread may use the engine now
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.metrics()["state_slots_used"] == 0


def test_shutdown_lets_short_requests_finish(spare_llm):
    with serve(spare_llm, ServerConfig(), graceful_timeout_s=30) as srv:
        first, result = threading.Event(), {}
        thread = _stream_in_thread(srv, {"model": srv.model, "prompt": "finish me", "max_tokens": 4, "stream": True,
                                         "ignore_eos": True}, first, result)
        assert first.wait(60)
        _stop(srv)
        thread.join(60)
    assert "error" not in result
    assert result["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in result["events"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _assert_engine_clean(spare_llm)


def test_shutdown_aborts_requests_that_outlast_the_grace_period(spare_llm):
    with serve(spare_llm, ServerConfig(shutdown_timeout_s=1), graceful_timeout_s=1) as srv:
        first, result = threading.Event(), {}
        thread = _stream_in_thread(srv, {"model": srv.model, "prompt": "never ends", "max_tokens": 3000,
                                         "ignore_eos": True, "stream": True}, first, result)
        assert first.wait(60)
        _stop(srv)
        thread.join(60)
        assert not thread.is_alive()
        assert "[DONE]" not in result["events"] or any('"error"' in e for e in result["events"])
    _assert_engine_clean(spare_llm)
