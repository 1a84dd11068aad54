"""A bounded waiting queue: beyond --max-waiting-requests, requests get 503 with Retry-After."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve


def test_full_queue_answers_503_with_retry_after(spare_llm):
    config = ServerConfig(max_waiting_requests=2, retry_after_s=3)
    with serve(spare_llm, config) as srv:
        prompt = " ".join(f"line {i} of a long prompt" for i in range(80))  # ~500 tokens: slow prefill

        async def burst():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": srv.model, "prompt": f"{i}: {prompt}", "max_tokens": 1}) for i in range(12)))

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503}
        rejected = [r for r in responses if r.status_code == 503]
        assert rejected and statuses.count(200) >= 2
        for response in rejected:
            assert response.headers["retry-after"] == "3"
            error = response.json()["error"]
            assert error["code"] == "server_overloaded" and "limit 2" in error["message"]
        assert srv.metric("forkpoint_requests_total", endpoint="completions", outcome="rejected") == len(rejected)
        assert srv.metric("forkpoint_requests_total", endpoint="completions", outcome="success") == statuses.count(200)

        # places are given back: the queue accepts work again
        srv.wait_idle()
        assert srv.metric("forkpoint_requests_waiting") == 0
        out = srv.client().completions.create(model=srv.model, prompt="after the burst", max_tokens=1)
        assert out.choices[0].finish_reason == "length"
        # a batch that could never fit is not worth retrying: 400, not 503
        with pytest.raises(openai.BadRequestError) as info:
            srv.client().completions.create(model=srv.model, prompt=["a", "b", "c"], max_tokens=1)
        assert info.value.body["param"] == "prompt"
