"""A client that goes away aborts its request and frees every engine resource it held."""

from __future__ import annotations

import httpx
import pytest


def _assert_freed(server, kv_blocks_before: int) -> None:
    values = server.wait_idle()
    assert values["state_slots_used"] == 0
    assert values["kv_blocks_used"] == kv_blocks_before
    server.engine_call(lambda engine: engine.check_integrity())
    assert server.metric("forkpoint_requests_running") == 0
    assert server.metric("forkpoint_requests_waiting") == 0


def test_disconnect_mid_stream_aborts(server):
    kv_before = server.wait_idle()["kv_blocks_used"]
    aborted_before = server.metric("forkpoint_requests_total", endpoint="chat", outcome="aborted")
    stream = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 2:
            break
    stream.close()
    _assert_freed(server, kv_before)
    assert server.metric("forkpoint_requests_total", endpoint="chat", outcome="aborted") == aborted_before + 1
    # the engine still serves
    out = server.client().completions.create(model=server.model, prompt="still alive?", max_tokens=1)
    assert out.choices[0].finish_reason == "length"


def test_disconnect_while_waiting_for_non_streaming_response(server):
    kv_before = server.wait_idle()["kv_blocks_used"]
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", timeout=1.0, json={
            "model": server.model, "prompt": "a long answer please", "max_tokens": 2000, "ignore_eos": True})
    _assert_freed(server, kv_before)
    assert server.metric("forkpoint_requests_total", endpoint="completions", outcome="aborted") >= 1
