"""API keys (server/auth.py, vLLM's --api-key): 401 without a valid key on every route but /health and
/metrics, the OpenAI client works with one (the /v1/messages routes also take Anthropic's x-api-key), and
each key is one client for checkpoint shares, so a client rotating its `user` field cannot evict another
client's checkpoints (it can on a server without keys)."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from forkpoint.server.auth import APIKeyAuth
from forkpoint.server.cli import api_keys
from forkpoint.server.config import ServerConfig
from tests.server.conftest import MARKER, TEST_LLM_KWARGS, serve

FLOOD = 2 * TEST_LLM_KWARGS["checkpoint_pool_size"]
KEYS = ("victim-key", "flood-key")


def _cached(srv, prompt: str, key: str | None, user: str | None = None) -> int:
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 1} | ({"user": user} if user else {})
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = srv.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _flood_with_rotating_users(srv, anchor: str, victim_key: str | None, flood_key: str | None) -> int:
    """The victim's marked anchor, then FLOOD unique marked prompts each from a new `user`; the
    victim's cached tokens when it comes back to its anchor."""
    assert _cached(srv, f"{anchor}{MARKER} first question", victim_key, "victim") == 0
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _cached(srv, f"flood {i} " * 12 + MARKER + " q", flood_key, f"user-{i}"),
                      range(FLOOD)))
    return _cached(srv, f"{anchor}{MARKER} second question", victim_key, "victim")


def test_keys_guard_every_route_but_health_and_metrics(spare_llm):
    with serve(spare_llm, ServerConfig(api_keys=KEYS)) as srv:
        body = {"model": srv.model, "prompt": "hello", "max_tokens": 1}
        missing = srv.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_api_key" and "Authorization" in missing.json()["error"][
            "message"]
        wrong = srv.post("/v1/completions", json=body, headers={"Authorization": "Bearer victim-ke"})
        assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
        assert srv.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{srv.base_url}/v1/models").status_code == 401
        assert all(httpx.get(f"{srv.base_url}{path}").status_code == 200 for path in ("/health", "/metrics"))
        for key in KEYS:
            assert srv.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEYS[1], max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_rotating_user_names_defeat_shares_without_keys_but_not_with_them(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig()) as srv:  # without keys, each new `user` is a new client
        assert _flood_with_rotating_users(srv, anchor_text("rotating"), None, None) == 0
        srv.wait_idle()
        srv.engine_call(lambda engine: engine.check_integrity())
    with serve(spare_llm, ServerConfig(api_keys=KEYS)) as srv:
        assert srv.engine_call(lambda engine: engine.reset_prefix_cache())
        assert _flood_with_rotating_users(srv, anchor_text("keyed"), KEYS[0], KEYS[1]) > 40
        srv.wait_idle()
        srv.engine_call(lambda engine: engine.check_integrity())


def test_api_key_isolation_salts_by_key(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig(api_keys=KEYS, cache_isolation="api-key")) as srv:
        anchor = anchor_text("isolated")
        assert _cached(srv, f"{anchor}{MARKER} one", KEYS[0]) == 0
        assert _cached(srv, f"{anchor}{MARKER} two", KEYS[1]) == 0  # another key reads nothing
        assert _cached(srv, f"{anchor}{MARKER} three", KEYS[0]) > 40  # the same key reuses


def test_config_and_cli_checks(monkeypatch):
    with pytest.raises(ValueError, match="needs api_keys"):
        ServerConfig(cache_isolation="api-key")
    with pytest.raises(ValueError, match="non-empty"):
        ServerConfig(api_keys=("",))
    with pytest.raises(ValueError, match="non-empty"):
        APIKeyAuth(app=None, keys=())
    monkeypatch.setenv("FORKPOINT_API_KEY", "from-env")
    assert api_keys(argparse.Namespace(api_key=None)) == ("from-env",)
    assert api_keys(argparse.Namespace(api_key=["a", "b"])) == ("a", "b")
    monkeypatch.delenv("FORKPOINT_API_KEY")
    assert api_keys(argparse.Namespace(api_key=None)) == ()
    auth = APIKeyAuth(app=None, keys=KEYS)
    assert auth.client_of(b"Bearer flood-key") == "key1" and auth.client_of(b"bearer  victim-key ") == "key0"
    assert auth.client_of(b"Basic flood-key") is None and auth.client_of(b"Bearer") is None
    assert auth.client_of_key(b" flood-key ") == "key1" and auth.client_of_key(b"") is None
    assert auth.client_of_key(None) is None and auth.client_of_key(b"flood") is None


def test_x_api_key_is_taken_on_the_messages_routes_only():
    """Anthropic's clients send `x-api-key`: the /v1/messages routes take it (and answer a 401 in
    Anthropic's shape); every other route still wants `Authorization: Bearer`."""

    async def echo_client(scope, receive, send):
        body = scope["state"]["api_client"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    client = TestClient(APIKeyAuth(echo_client, keys=KEYS))  # no `with`: the app has no lifespan
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert client.post(path, headers={"x-api-key": "flood-key"}).text == "key1"
        assert client.post(path, headers={"Authorization": "Bearer victim-key"}).text == "key0"
        wrong = client.post(path, headers={"x-api-key": "flood"})
        assert wrong.status_code == 401 and wrong.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "the API key is not valid for this server"}}
        assert "x-api-key" in client.post(path).json()["error"]["message"]
    refused = client.post("/v1/chat/completions", headers={"x-api-key": "flood-key"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
