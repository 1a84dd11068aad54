"""OpenAI-style errors: every failure leaves the server as
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status, never a bare traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("forkpoint.server")


class APIError(Exception):
    """An error answered to the client as an OpenAI error body.

    status: HTTP status; type: OpenAI error type (``invalid_request_error`` for every 400);
    param: the request field at fault, or None; code: a short machine-readable code, or None;
    headers: extra response headers (Retry-After on 503).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(message, status=400, param=param, code=code)


def overloaded(retry_after_s: int, message: str) -> APIError:
    """A 503 that tells the client when to retry."""
    return APIError(
        message, status=503, type="service_unavailable_error", code="server_overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First validation problem as ("field: what is wrong", field)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    param = loc[0] if loc else None
    where = ".".join(loc)
    detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":  # the models forbid fields that forkpoint does not honour
        detail = ("this parameter is not supported by forkpoint (docs/server.md lists every parameter and "
                  "its status): remove it")
    message = f"{where}: {detail}" if where else detail
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, param


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None]) -> None:
    """Route every exception type the app can raise to an OpenAI error body; `on_error(request,
    status)` is told about each one (for the outcome metrics)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        on_error(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error(request, 400)
        message, param = _validation_message(exc)
        return invalid_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_error(request, exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(exc.detail), kind, code=str(exc.status_code)),
            status_code=exc.status_code, headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        on_error(request, 500)
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error"),
            status_code=500,
        )
