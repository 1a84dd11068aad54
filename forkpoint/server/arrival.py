"""When each HTTP request reached the application: the first part of its time to first token.

`ArrivalTime` is the outermost ASGI middleware: it stamps `time.monotonic()` into the request's scope
state the moment uvicorn hands the request over (its headers parsed, its body not yet read). The
handler starts after the body is read, parsed and validated (FastAPI); `Generation` times the gap as
the `request` part of the time to first token, so a request that waits before its handler (a large
body, an event loop busy with others) shows there instead of before the server's clock starts.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

ARRIVAL_KEY = "forkpoint_arrival"


class ArrivalTime:
    """Stamps each HTTP request's arrival (`time.monotonic()`) into `scope["state"][ARRIVAL_KEY]`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = time.monotonic()
        await self.app(scope, receive, send)


def arrival_time(request: Request) -> float | None:
    """The request's arrival stamp, or None when it did not pass `ArrivalTime` (an app built without it)."""
    return request.scope.get("state", {}).get(ARRIVAL_KEY)
