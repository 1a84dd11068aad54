"""server/arrival.py: the outermost middleware stamps each HTTP request before the app reads its body."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from forkpoint.server.arrival import ArrivalTime, arrival_time


def test_the_stamp_is_taken_before_the_app_runs_and_read_back_from_the_request():
    seen = {}

    async def app(scope, receive, send):
        seen["stamp"] = arrival_time(Request(scope, receive))
        seen["app_started"] = time.monotonic()

    before = time.monotonic()
    asyncio.run(ArrivalTime(app)({"type": "http", "method": "POST", "path": "/", "headers": []}, None, None))
    assert before <= seen["stamp"] <= seen["app_started"]


def test_other_scopes_pass_unstamped():
    seen = {}

    async def app(scope, receive, send):
        seen["state"] = scope.get("state")

    asyncio.run(ArrivalTime(app)({"type": "lifespan"}, None, None))
    assert seen["state"] is None
    assert arrival_time(Request({"type": "http", "method": "GET", "path": "/", "headers": []})) is None
