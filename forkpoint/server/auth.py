"""API keys (vLLM's `--api-key`): with keys configured, every HTTP request but the open paths must carry
`Authorization: Bearer <key>`, else it is answered 401 before the app reads its body. The /v1/messages
routes also take the key as Anthropic's clients send it, `x-api-key: <key>`, and answer the 401 in
Anthropic's error shape (messages_errors.py).

The key a request presented names its client: `scope["state"]["api_client"]` = "key<i>" (the key's
position in the configured tuple, never the key itself, so logs and metrics never show a secret). The
server counts admission places and checkpoint shares per client (server/generation.py,
cache/eviction.py) and `--cache-isolation api-key` salts by it: a client cannot multiply its shares by
rotating the request's `user` field, which it chooses freely.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, each against every configured key,
so the time taken does not depend on how much of a key a caller guessed.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from forkpoint.server.errors import error_body
from forkpoint.server.messages_errors import MESSAGES_PATHS, anthropic_error

# liveness probes, Prometheus scrapers and version checks carry no key (vLLM leaves them open too)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class APIKeyAuth:
    """ASGI middleware checking API keys (the module docstring). `keys`: at least one, non-empty."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        if not keys or not all(keys):
            raise ValueError("API keys must be non-empty strings")
        self.app = app
        self._digests = tuple((hashlib.sha256(key.encode()).digest(), f"key{i}") for i, key in enumerate(keys))

    def client_of(self, authorization: bytes | None) -> str | None:
        """The client a raw `Authorization` header value names, or None when it names no configured key."""
        if authorization is None:
            return None
        scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.client_of_key(token.encode("latin-1"))

    def client_of_key(self, key: bytes | None) -> str | None:
        """The client a raw key (an `x-api-key` header value, a bearer token) names, or None."""
        if key is None or not key.strip():
            return None
        digest = hashlib.sha256(key.strip()).digest()
        found = None
        for known, client in self._digests:  # no early exit: the time is the same for every key
            if hmac.compare_digest(digest, known):
                found = client
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        anthropic = scope["path"] in MESSAGES_PATHS
        client = self.client_of(headers.get(b"authorization"))
        if client is None and anthropic:
            client = self.client_of_key(headers.get(b"x-api-key"))
        if client is None:
            missing = b"authorization" not in headers and not (anthropic and b"x-api-key" in headers)
            message = ("this server requires an API key: send 'Authorization: Bearer <key>' (the OpenAI client's "
                       "api_key)" + (" or 'x-api-key: <key>' (the Anthropic client's)" if anthropic else "")
                       if missing else "the API key is not valid for this server")
            body = json.dumps(anthropic_error(message, 401) if anthropic else
                              error_body(message, "invalid_request_error", code="invalid_api_key")).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["api_client"] = client
        await self.app(scope, receive, send)
