"""The request size limit (`--max-request-bytes`): an ASGI middleware that answers 413 with an
OpenAI error body before a too-large body is read, and a default that admits any prompt that
can fit `max_model_len`.

    Content-Length > limit      -> 413 at once; the app never sees the body
    chunked body past the limit -> 413 as soon as the running count passes it

Either way the 413 goes out whole at once, but its end is held back while the server reads and drops
what the client still sends (nginx's lingering close): a client still writing its body reads the
413 instead of a connection reset, as it would if the server closed with unread bytes. It drains the
declared Content-Length (a chunked body: at most `limit` more bytes), for at most
`LINGER_TIME_S`, and stops when the client sends nothing for `LINGER_IDLE_S`; the pieces are
uvicorn's small chunks, so memory stays flat. Then the connection is closed.

(The end is held because uvicorn reports a disconnect to every receive once a response is complete
and closes a `Connection: close` connection at that moment: nothing can be drained after it.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from forkpoint.server.errors import RequestTooLarge

logger = logging.getLogger("forkpoint.server")

# bytes of JSON per byte of UTF-8 text in the worst case: "\u0001" is 6 bytes for one
JSON_ESCAPE_FACTOR = 6
# the request's other fields (sampling parameters, roles, tool schemas)
REQUEST_OVERHEAD_BYTES = 1 << 20
# data URLs of a few large photographs, for models that take images (their size in bytes has no
# bound in tokens: the server resizes them)
IMAGE_ALLOWANCE_BYTES = 64 << 20
# nginx's lingering_time and lingering_timeout: how long a refused body is drained at most, and how
# long the drain waits for the client's next piece
LINGER_TIME_S = 30.0
LINGER_IDLE_S = 5.0


def default_max_request_bytes(tokenizer: PreTrainedTokenizerBase, max_model_len: int, *,
                              takes_images: bool) -> int:
    """Bytes of a request body that holds any one prompt of up to `max_model_len` tokens, each of
    them the vocabulary's longest (in UTF-8 bytes, an upper bound of its decoded text), written
    with the worst JSON escaping, plus `REQUEST_OVERHEAD_BYTES` (and `IMAGE_ALLOWANCE_BYTES`)."""
    longest = max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    total = max_model_len * longest * JSON_ESCAPE_FACTOR + REQUEST_OVERHEAD_BYTES
    return total + (IMAGE_ALLOWANCE_BYTES if takes_images else 0)


class RequestSizeLimit:
    """ASGI middleware: bodies over `max_bytes` get 413. `on_reject(scope, message, answered_here)`
    is told of each: answered_here is True when the middleware sent the 413 itself (a declared
    Content-Length), False when it raised `RequestTooLarge` into the app for its error handler.
    body_for(path, status, body): the error body a path's clients get instead of the OpenAI one that
    the middleware sends itself (as `errors.install_error_handlers` takes it)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[Scope, str, bool], None],
                 body_for: Callable[[str, int, dict], dict] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.body_for = body_for

    def message(self, size: str) -> str:
        return (f"the request body has {size}, but this server takes at most {self.max_bytes} bytes "
                "(--max-request-bytes): send a shorter prompt, or start the server with a larger --max-request-bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send, self.message(f"{declared} bytes"), declared)
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # the handler reading the body gets this; FastAPI passes HTTPExceptions on to the
                    # app's error handler, which answers 413 with an OpenAI error body
                    refused = True
                    text = self.message(f"more than {self.max_bytes} bytes")
                    self.on_reject(scope, text, False)
                    raise RequestTooLarge(text)
            return message

        async def lingering_send(message: Message) -> None:
            # the app's 413 for the body counting_receive refused: close the connection after it, and
            # drain the body before the response's end
            if refused and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            if refused and message["type"] == "http.response.body" and not message.get("more_body", False):
                await send({**message, "more_body": True})
                await _discard_body(receive, self.max_bytes)
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app(scope, counting_receive, lingering_send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, text: str, declared: int) -> None:
        """Answer 413 for a body that declares `declared` bytes; drain them before closing."""
        self.on_reject(scope, text, True)
        error = RequestTooLarge(text).body()
        body = json.dumps(self.body_for(scope["path"], 413, error) if self.body_for is not None else error).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await _discard_body(receive, declared)
        await send({"type": "http.response.body", "body": b""})


async def _discard_body(receive: Receive, limit: int) -> None:
    """Read and drop the rest of the body: until its end, `limit` bytes, `LINGER_TIME_S` in all, or
    `LINGER_IDLE_S` without a piece, whichever comes first."""
    drained = 0
    deadline = time.monotonic() + LINGER_TIME_S
    while drained < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), min(left, LINGER_IDLE_S))
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
