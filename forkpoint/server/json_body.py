"""Large JSON request bodies decoded off the event loop: `OffLoopJSONRoute`, the routes' `APIRoute` class.

FastAPI decodes a body with `await request.json()` on the event loop. For a 50 MB body that is one
`json.loads` call of 0.1-1 s, and the C decoder keeps the GIL for all of it, so a thread alone would
still hold the loop. A body over `LARGE_BODY_BYTES` is decoded in a worker thread, in steps that
each hold the GIL for about `PIECE_CHARS` characters' work:

    bytes -> text            UTF-8 in pieces (an incremental decoder, "surrogatepass" as json.loads)
    long string literals     cut out of the text and decoded in pieces cut between escapes
    the rest (the skeleton)  json.loads, each long literal there a short placeholder; then the
                             placeholders are replaced by the literals' values

Invariant: the result equals `json.loads(body)` (NaN and Infinity, which JSON has not, refused); a body
that fails any step is decoded again by `json.loads`, which raises its exact error. Limits: a body in
another encoding than UTF-8, or with more than `MAX_QUOTES` quotes (too many strings for a step per
string), is one `json.loads` in the thread; a literal with a backslash in every 5 characters has no cut
and is decoded whole. Smaller bodies keep FastAPI's path: no thread hop.

Two counts are capped, both before FastAPI's validation builds a model or a list per value on the
event loop, all under the GIL (500,000 one-letter content parts, 15 MB: 1.2 s of validation on the
loop, the engine thread starved for 3.9 s, 440 MB kept; 8,000,000 token ids, 24 MB: 0.8 s):

    objects (`--max-request-objects`)  every object opens with a `{`, so a small body with at most the
        limit's count of `{` bytes is within it; any other body (braces inside strings count too) is
        decoded in the thread with a hook that counts objects as the decoder closes them and stops it
        at the first one past the limit (`TooManyObjects`): the refusal costs the decoding of about the
        limit's objects
    values (`--max-request-values`)    a small body whose byte counts bound its values within the
        limit is within it; a body with more commas than the limit is refused undecoded where lower
        bounds from its bytes prove it past (json_counts.py); the rest are decoded in the thread and
        counted (`TooManyValues`)
"""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from json.decoder import scanstring
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope

from forkpoint.server.errors import BodyRefused, TooDeep, TooManyObjects, TooManyValues
from forkpoint.server.json_counts import (
    closing_quote,
    count_bytes,
    depth_beyond,
    values_beyond,
    values_lower_bound,
    values_upper_bound,
)

# bodies above this are decoded in a thread (~1-10 ms of json.loads below it)
LARGE_BODY_BYTES = 1 << 20
# characters decoded per step; the event loop waits at most about one step for the GIL
PIECE_CHARS = 1 << 20
# past this many quotes, finding the literals one by one would cost more than it saves
MAX_QUOTES = 100_000
# arrays and objects nested deeper are refused (`too_deep`): the server's walks over a request
# (the lone-surrogate check, a schema's rewrite for structured outputs) recurse a few Python frames a
# level under the interpreter's 1,000-frame limit; schemas and conversations nest a few tens deep
MAX_JSON_DEPTH = 128
_LOW_SURROGATE_ESCAPE = ("\\udc", "\\udd", "\\ude", "\\udf", "\\uDC", "\\uDD", "\\uDE", "\\uDF")


@dataclass(frozen=True)
class BodyLimits:
    """The most JSON objects and values a request body may hold (both >= 1)."""

    max_objects: int
    max_values: int

    def __post_init__(self) -> None:
        if self.max_objects < 1 or self.max_values < 1:
            raise ValueError(f"max_objects and max_values must be >= 1, got {self.max_objects}, {self.max_values}")


class OffLoopJSONRequest(Request):
    """A Request whose `json()` decodes a body over `LARGE_BODY_BYTES` in a thread (`decode_json`),
    and refuses one past `limits` (`TooManyObjects`, `TooManyValues`) before or while decoding it."""

    def __init__(self, scope: Scope, receive: Receive, limits: BodyLimits) -> None:
        super().__init__(scope, receive)
        self.limits = limits

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            large = len(body) > LARGE_BODY_BYTES
            try:
                if large or not _within_limits_surely(body, self.limits):
                    self._json = await asyncio.to_thread(decode_within, body, self.limits)
                else:
                    self._json = json.loads(body, parse_constant=_refuse_constant)
                    if count_bytes(body, b"{") + count_bytes(body, b"[") > MAX_JSON_DEPTH:
                        _refuse_deep(self._json)
            except json.JSONDecodeError:
                raise  # FastAPI answers it with the position of the error
            except UnicodeDecodeError as error:  # a ValueError too
                raise BodyRefused(400, f"the request body is not JSON text in UTF-8, UTF-16 or UTF-32: {error}",
                                  "not_json") from None
            except RecursionError:  # deeper than the decoder goes
                raise TooDeep(MAX_JSON_DEPTH) from None
            except ValueError:  # the decoder's only other ValueError: int()'s digit limit
                raise BodyRefused(400, f"the request body has an integer of more than {sys.get_int_max_str_digits()} "
                                       "digits", "number_too_long") from None
        return self._json


def off_loop_json_route(limits: BodyLimits) -> type[APIRoute]:
    """The APIRoute class whose handlers read requests as `OffLoopJSONRequest`s with `limits`."""

    class OffLoopJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def off_loop_json_handler(request: Request) -> Response:
                return await handler(OffLoopJSONRequest(request.scope, request.receive, limits))

            return off_loop_json_handler

    return OffLoopJSONRoute


def _within_limits_surely(body: bytes, limits: BodyLimits) -> bool:
    """Whether `body` is within `limits` by its byte counts alone (each object has a `{`; the values'
    upper bound)."""
    return body.count(b"{") <= limits.max_objects and values_upper_bound(body) <= limits.max_values


def decode_within(body: bytes, limits: BodyLimits) -> Any:
    """`decode_json(body)`, or `TooManyValues` / `TooManyObjects` for a body past `limits`: from its
    bytes when they prove it (json_counts.py), else while or after decoding it. One pass over the
    bytes for most bodies (the commas: ~30 ms for 50 MB); the lower bound's passes only for a body of
    more commas than the limit's values (a dense body, which decoding would cost most)."""
    dense = count_bytes(body, b",") > limits.max_values
    if dense and values_lower_bound(body) > limits.max_values:
        raise TooManyValues(limits.max_values)
    value = decode_json(body, limits.max_objects)
    if values_beyond(value, limits.max_values):
        raise TooManyValues(limits.max_values)
    _refuse_deep(value)
    return value


def _refuse_deep(value: Any) -> None:
    """`TooDeep` for a decoded body nested deeper than `MAX_JSON_DEPTH`."""
    if depth_beyond(value, MAX_JSON_DEPTH):
        raise TooDeep(MAX_JSON_DEPTH)


def decode_json(body: bytes, max_objects: int | None = None) -> Any:
    """`json.loads(body)`, in steps of about `PIECE_CHARS` characters (see the module docstring);
    with `max_objects`, `TooManyObjects` as soon as the decoder has closed more objects than that."""
    if json.detect_encoding(body) != "utf-8":
        return _loads(body, max_objects)
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    view = memoryview(body)
    text = "".join([decoder.decode(view[i:i + PIECE_CHARS]) for i in range(0, len(body), PIECE_CHARS)]
                   + [decoder.decode(b"", final=True)])
    try:
        return _decode_text(text, max_objects)
    except (ValueError, RecursionError):
        return _loads(text, max_objects)


def _loads(text: str | bytes, max_objects: int | None) -> Any:
    """json.loads with the object counter (`_object_counter`) and NaN / Infinity refused."""
    return json.loads(text, object_hook=_object_counter(max_objects), parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> float:
    """json.loads' parse_constant: NaN, Infinity and -Infinity, which Python's decoder takes and JSON
    (RFC 8259) does not, are refused."""
    raise BodyRefused(400, f"the request body has {name}, which is not JSON (it has no NaN or Infinity): send a "
                           "finite number", "not_json")


def _object_counter(max_objects: int | None) -> Callable[[dict], dict] | None:
    """A `json.loads` object_hook that counts the objects it is given and raises `TooManyObjects`
    at the first past `max_objects`; None (no hook) without a limit."""
    if max_objects is None:
        return None
    count = 0

    def count_object(value: dict) -> dict:
        nonlocal count
        count += 1
        if count > max_objects:
            raise TooManyObjects(max_objects)
        return value

    return count_object


def _decode_text(text: str, max_objects: int | None) -> Any:
    spans = _long_literals(text)
    if not spans:
        return _loads(text, max_objects)
    nonce = secrets.token_hex(16)
    values: dict[str, str] = {}
    skeleton: list[str] = []
    pos = 0
    for start, end in spans:
        placeholder = f"{nonce}:{len(values)}"
        values[placeholder] = _decode_literal(text, start, end)
        skeleton += [text[pos:start], '"', placeholder, '"']
        pos = end
    skeleton.append(text[pos:])
    return _put_back(_loads("".join(skeleton), max_objects), values)


def _long_literals(text: str) -> list[tuple[int, int]]:
    """[start, end) of each string literal longer than `PIECE_CHARS`, quotes included; [] when the
    text has more than `MAX_QUOTES` quotes. A quote outside a literal opens one (valid JSON has no
    other); an unterminated literal ends the search (json.loads reports it)."""
    if text.count('"') > MAX_QUOTES:
        return []
    spans = []
    pos = 0
    while (start := text.find('"', pos)) != -1:
        end = closing_quote(text, start + 1)
        if end is None:
            break
        if end - start > PIECE_CHARS:
            spans.append((start, end + 1))
        pos = end + 1
    return spans


def _decode_literal(text: str, start: int, end: int) -> str:
    """The value of the literal text[start:end] (quotes included), decoded piece by piece."""
    parts = []
    pos, close = start + 1, end - 1
    while pos < close:
        cut = _cut(text, pos, close)
        parts.append(scanstring(text[pos:cut] + '"', 0)[0])
        pos = cut
    return "".join(parts)


def _cut(text: str, pos: int, close: int) -> int:
    """Where the piece starting at `pos` ends: at most `PIECE_CHARS` on, where no escape (at most 6
    characters: \\uXXXX) straddles the cut and no surrogate pair is split; `close` when none is."""
    cut = pos + PIECE_CHARS
    if cut >= close:
        return close
    while cut > pos:
        backslash = text.rfind("\\", cut - 5, cut)
        if backslash != -1:
            cut = backslash
        elif text.startswith(_LOW_SURROGATE_ESCAPE, cut):
            cut -= 1
        else:
            return cut
    return close


def _put_back(value: Any, values: dict[str, str]) -> Any:
    """`value` with every string (key or item) found in `values` replaced by its entry."""
    if isinstance(value, str):
        return values.get(value, value)
    if isinstance(value, list):
        return [_put_back(item, values) for item in value]
    if isinstance(value, dict):
        return {values.get(key, key): _put_back(item, values) for key, item in value.items()}
    return value
