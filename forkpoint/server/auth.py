"""API keys (vLLM's `--api-key`): with keys configured, every HTTP request but the open paths must carry
`Authorization: Bearer <key>`, else it is answered 401 before the app reads its body.

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

# liveness probes and Prometheus scrapers carry no key (vLLM leaves both open too)
OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyAuth:
    """ASGI middleware checking bearer keys (the module docstring). `keys`: at least one, non-empty."""

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
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
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
        client = self.client_of(headers.get(b"authorization"))
        if client is None:
            missing = b"authorization" not in headers
            message = ("this server requires an API key: send 'Authorization: Bearer <key>' (the OpenAI client's "
                       "api_key)" if missing else "the API key is not valid for this server")
            body = json.dumps(error_body(message, "invalid_request_error", code="invalid_api_key")).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["api_client"] = client
        await self.app(scope, receive, send)
