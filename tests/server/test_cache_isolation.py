"""Isolation between tenants (issue 27 item 2): `cache_salt` and `--cache-isolation user`. Reuse is
reported exactly (`usage.prompt_tokens_details.cached_tokens`), so without isolation it is an oracle of
what another client sent; with different salts no checkpoint or KV block is shared and the number says
nothing."""

from __future__ import annotations

import uuid

import pytest

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve

MARKER = "<|mamba_checkpoint|>"


def secret_document() -> str:
    """A prompt no other test sends (the engines are shared by the session's tests), checkpointed at its
    end by the marker, as an application marks a shared document."""
    lines = " ".join(f"line {i}: balance and PIN kept private." for i in range(8))
    return f"Account notes {uuid.uuid4().hex}. {lines}"


def victim(running, document: str, **fields) -> int:
    return cached(running, document + MARKER + " Summarise the account.", **fields)


def guess(running, document: str, **fields) -> int:
    return cached(running, document + " What is the PIN?", **fields)


def cached(running, prompt: str, **fields) -> int:
    body = {"model": running.model, "prompt": prompt, "max_tokens": 2, **fields}
    response = running.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def isolating(spare_llm):
    with serve(spare_llm, ServerConfig(served_model_name="isolating", cache_isolation="user")) as running:
        yield running


def test_without_isolation_reuse_crosses_clients(server):
    """The side channel the salts close: a second client sending the same text is told it was cached."""
    document = secret_document()
    assert victim(server, document, user="alice") == 0
    assert guess(server, document, user="mallory") > 0


def test_different_salts_share_nothing(server):
    document = secret_document()
    assert victim(server, document, cache_salt="tenant-a") == 0
    assert guess(server, document, cache_salt="tenant-b") == 0
    assert guess(server, document) == 0  # no salt: another namespace again
    assert guess(server, document, cache_salt="tenant-a") > 0  # reuse within a salt still works


def test_isolation_by_user_is_the_default_salt(isolating):
    document = secret_document()
    assert victim(isolating, document, user="alice") == 0
    assert guess(isolating, document, user="mallory") == 0
    assert guess(isolating, document, user="alice") > 0
    chat = {"model": isolating.model, "messages": [{"role": "user", "content": document + MARKER + " Hi."}],
            "max_tokens": 1}
    first = isolating.post("/v1/chat/completions", json={**chat, "user": "carol"})
    other = isolating.post("/v1/chat/completions", json={**chat, "user": "dave"})
    again = isolating.post("/v1/chat/completions", json={**chat, "user": "carol"})
    assert first.status_code == other.status_code == 200, (first.text, other.text)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_empty_salt_is_a_400(server):
    response = server.post("/v1/completions", json={"model": server.model, "prompt": "hi", "cache_salt": ""})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
