"""A bounded waiting queue: beyond --max-waiting-requests, requests get 503 with Retry-After."""

from __future__ import annotations

import asyncio
import threading

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


def test_n_counts_as_n_sequences(spare_llm):
    """`n` completions of a prompt take n places: a request that asks for more sequences than a
    request may hold is a 400 naming `n`, and every place comes back when it ends."""
    config = ServerConfig(max_waiting_requests=8, max_num_seqs_per_request=6)
    with serve(spare_llm, config) as srv:
        client = srv.client()
        for n, prompts in ((7, ["one"]), (4, ["one", "two"])):  # 7 > 6 sequences; 2 x 4 = 8 > 6
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=srv.model, prompt=prompts, max_tokens=1, n=n)
            assert info.value.body["param"] == "n" and "--max-num-seqs-per-request" in info.value.body["message"]
        out = client.completions.create(model=srv.model, prompt=["one", "two"], max_tokens=2, n=3, temperature=1.0)
        assert len(out.choices) == 6
        srv.wait_idle()
        assert srv.metric("forkpoint_requests_waiting") == 0 and srv.metric("forkpoint_requests_running") == 0


def test_one_busy_prompt_builder_holds_up_no_other_prompt(server):
    """Prompts are built in a pool: with one tokenizer thread busy (a huge prompt), another
    request's prompt is still tokenised at once."""
    release = threading.Event()
    busy = server.app.state.tokenizer_pool.submit(release.wait, 60)
    try:
        response = server.post("/tokenize", json={"prompt": "not held up"}, timeout=10)
        assert response.status_code == 200 and response.json()["count"] > 0
    finally:
        release.set()
        busy.result(timeout=10)
