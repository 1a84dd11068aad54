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
from starlette.requests import ClientDisconnect

logger = logging.getLogger("forkpoint.server")

# nginx's status for a client that closed the connection before the answer (nobody reads it)
CLIENT_CLOSED_REQUEST = 499


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


class BodyRefused(StarletteHTTPException):
    """A request body refused while it is read, before its fields are validated: answered `status`
    with an ``invalid_request_error`` body whose code is `code`. (An HTTPException, so FastAPI passes
    it on from its body reading instead of answering its own 400.)"""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(status, detail=message)
        self.code = code

    def body(self) -> dict:
        return error_body(str(self.detail), "invalid_request_error", code=self.code)


class RequestTooLarge(BodyRefused):
    """The request body is over --max-request-bytes (raised while it is read; answered 413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message, "request_too_large")


class TooDeep(BodyRefused):
    """The request body nests arrays and objects deeper than the server takes (answered 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, f"the request body nests arrays and objects deeper than {limit} levels, the most "
                              "this server takes", "too_deep")


class TooManyValues(BodyRefused):
    """The request body holds more JSON values (array elements and members' values) than
    --max-request-values (found from its bytes or while it is decoded; answered 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, f"the request body holds more than {limit} JSON values (token ids, strings and every "
                              "other array element or field count one each), the most this server takes "
                              "(--max-request-values): send fewer, or start the server with a larger "
                              "--max-request-values", "too_many_values")


class TooManyObjects(BodyRefused):
    """The request body holds more JSON objects than --max-request-objects (found while it is
    decoded, before any field is validated; answered 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, f"the request body holds more than {limit} JSON objects (messages, content parts, "
                              "tools and their schemas count one each), the most this server takes "
                              "(--max-request-objects): send fewer, or start the server with a larger "
                              "--max-request-objects", "too_many_objects")


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


def log_error_response(method: str, path: str, status: int, body: dict) -> None:
    """One log line per error answer, with its reason: INFO for 4xx, ERROR for 5xx."""
    error = body["error"]
    param = f" (param {error['param']})" if error.get("param") else ""
    logger.log(logging.ERROR if status >= 500 else logging.INFO, "%s %s -> %d %s%s: %s", method, path, status,
               error["type"], param, error["message"])


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None],
                           body_for: Callable[[str, int, dict], dict] | None = None) -> None:
    """Route every exception type the app can raise to an OpenAI error body; `on_error(request,
    status)` is told about each one (for the outcome metrics), and each is logged with its reason.
    body_for(path, status, body): the body a path's clients get instead (another API's error shape:
    messages_errors.py); None: the OpenAI body everywhere."""

    def answer(request: Request, status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
        on_error(request, status)
        log_error_response(request.method, request.url.path, status, body)
        if body_for is not None:
            body = body_for(request.url.path, status, body)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return answer(request, 400, invalid_request(message, param=param).body())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body the client stopped sending
            message = "the client closed the connection while sending the request body"
            return answer(request, CLIENT_CLOSED_REQUEST, error_body(message, "client_closed_request"))
        if isinstance(exc, BodyRefused):
            body = exc.body()
        else:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            body = error_body(str(exc.detail), kind, code=str(exc.status_code))
        return answer(request, exc.status_code, body, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return answer(request, 500, error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error"))
