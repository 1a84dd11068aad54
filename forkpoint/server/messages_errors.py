"""Anthropic's error shape for the /v1/messages routes: ``{"type": "error", "error": {"type",
"message"}}``, with the status codes every other endpoint answers (errors.py); the other endpoints
keep OpenAI's shape.

    400, 422  invalid_request_error        404  not_found_error
    401       authentication_error         413  request_too_large
    403       permission_error             429  rate_limit_error
    503, 529  overloaded_error             other 5xx  api_error

Anthropic's errors carry no `param`: a message that does not name the field at fault starts with it.
"""

from __future__ import annotations

from typing import Any

MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body (errors.error_body) in Anthropic's shape."""
    error = body["error"]
    message, param = error["message"], error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return anthropic_error(message, status)


def error_body_for(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The error body a request on `path` gets: Anthropic's on the /v1/messages routes, else `body`."""
    return from_openai(status, body) if path in MESSAGES_PATHS else body
