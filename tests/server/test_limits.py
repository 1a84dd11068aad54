"""Hostile request sizes: --max-request-bytes answers 413 before the body is read, the server stays
responsive and its memory flat; big admitted prompts are tokenised off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from forkpoint.server.config import ServerConfig
from forkpoint.server.limits import JSON_ESCAPE_FACTOR, default_max_request_bytes
from tests.server.conftest import serve

CHUNK = b"a" * (1 << 20)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def body_of(size: int, chunk_delay_s: float = 0.0):
    """A JSON completion request of about `size` bytes, streamed (chunked) in 1 MiB pieces."""
    yield b'{"model": "forkpoint-test", "prompt": "'
    for _ in range(size // len(CHUNK)):
        time.sleep(chunk_delay_s)
        yield CHUNK
    yield b'", "max_tokens": 1}'


def test_the_default_limit_admits_any_prompt_of_max_model_len(server):
    tokenizer = server.llm.get_tokenizer()
    limit = server.app.state.max_request_bytes
    assert limit == default_max_request_bytes(tokenizer, 4096, takes_images=False)
    longest = max(len(t.encode()) for t in tokenizer.get_vocab())
    assert limit >= 4096 * longest * JSON_ESCAPE_FACTOR
    assert limit < 50_000_000  # ... and refuses the 50 MB requests below
    # a prompt at the edge of max_model_len gets the length check, not the size limit
    prompt = " ".join(["token"] * 4200)
    answer = server.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"


def test_a_declared_oversized_body_is_refused_unread(spare_llm):
    with serve(spare_llm, ServerConfig(served_model_name="forkpoint-test", max_request_bytes=100_000)) as running:
        payload = b'{"model": "forkpoint-test", "prompt": "' + b"a" * 5_000_000 + b'"}'
        began = time.monotonic()
        answer = httpx.post(f"{running.base_url}/v1/completions", content=payload,
                            headers={"content-type": "application/json"}, timeout=30)
        assert answer.status_code == 413
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
        assert "5000" in error["message"] and "--max-request-bytes" in error["message"]
        assert time.monotonic() - began < 5
        # streamed without Content-Length: refused once the count passes the limit
        answer = httpx.post(f"{running.base_url}/v1/chat/completions", content=body_of(3 << 20),
                            headers={"content-type": "application/json"}, timeout=30)
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
        assert running.metric("forkpoint_requests_total", endpoint="completions", outcome="invalid_request") == 1
        assert running.metric("forkpoint_requests_total", endpoint="chat", outcome="invalid_request") == 1
        # under the limit everything works as before
        ok = running.client().completions.create(model=running.model, prompt="small", max_tokens=2)
        assert ok.choices[0].finish_reason == "length"


def test_a_client_still_uploading_a_refused_body_reads_the_413(spare_llm):
    """A body some MiB over the limit, uploaded whole before the client reads (httpx's async client):
    the server drains the declared length before closing. Closing with the rest unread reset the
    connection, and the client saw a ReadError instead of the 413."""
    limit = 1 << 20
    payload = b'{"model": "forkpoint-test", "prompt": "' + b"a" * (limit + (4 << 20)) + b'"}'

    async def upload(url: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(f"{url}/v1/completions", content=payload,
                                     headers={"content-type": "application/json"})

    with serve(spare_llm, ServerConfig(served_model_name="forkpoint-test", max_request_bytes=limit)) as running:
        for _ in range(3):
            answer = asyncio.run(upload(running.base_url))
            assert answer.status_code == 413
            error = answer.json()["error"]
            assert error["code"] == "request_too_large" and str(len(payload)) in error["message"]
            assert answer.headers["connection"] == "close"


def test_health_answers_while_a_50_mb_request_is_refused_and_memory_stays_flat(server):
    server.wait_idle()
    baseline = rss_mb()
    results: dict[str, object] = {}

    def send() -> None:
        try:
            results["status"] = httpx.post(f"{server.base_url}/v1/completions", content=body_of(50 << 20, 0.02),
                                           headers={"content-type": "application/json"}, timeout=60).status_code
        except httpx.HTTPError as err:  # the server may close the connection once it has answered
            results["status"] = type(err).__name__

    sender = threading.Thread(target=send)
    sender.start()
    latencies = health_latencies(server.base_url, sender.is_alive, at_least=1)
    sender.join()
    assert results["status"] == 413
    assert max(latencies) < 1.0, latencies
    assert rss_mb() - baseline < 30, f"RSS grew from {baseline:.0f} MB to {rss_mb():.0f} MB"


def health_latencies(base_url: str, keep_going, at_least: int = 0) -> list[float]:
    latencies: list[float] = []
    while keep_going() or len(latencies) < at_least:
        began = time.monotonic()
        assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - began)
        time.sleep(0.05)
    return latencies


def test_a_slow_tokenisation_runs_off_the_event_loop(spare_llm, monkeypatch):
    """While /tokenize's text takes the tokenizer 3 s (slowed here: a text that cannot fit is refused
    after its first pieces, tests/server/test_prompt_length.py, so no legal text takes that long on
    this model), /health keeps answering within 1 s; on a machine so loaded that even an idle /health
    is slow, within 4 times the idle latency. Tokenising on the event loop would hold /health for
    the whole 3 s."""
    tokenizer = spare_llm.get_tokenizer()
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow:"):
            time.sleep(3.0)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with serve(spare_llm, ServerConfig(served_model_name="forkpoint-test")) as running:
        idle = max(health_latencies(running.base_url, lambda: False, at_least=5))
        results: dict[str, object] = {}

        def send() -> None:
            results["answer"] = running.post("/tokenize", timeout=300, json={"prompt": "slow: many words here"})

        sender = threading.Thread(target=send)
        sender.start()
        latencies = health_latencies(running.base_url, sender.is_alive)
        sender.join()
        assert results["answer"].status_code == 200 and results["answer"].json()["count"] > 3
        assert max(latencies) < max(1.0, 4 * idle), (idle, latencies)


@pytest.mark.parametrize("value", [0, -5])
def test_max_request_bytes_is_validated(value):
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerConfig(max_request_bytes=value)
