"""How many JSON values a request body holds: bounds read from its bytes before it is decoded, and the
exact count of a decoded body.

A value is anything inside an array or an object (an element, or a member's value); the root is not
one. A body of millions of values (8,000,000 token ids in a 24 MB completions prompt, 4,000,000 stop
strings) costs ~100 ns of GIL-held decoding and validation per value, about a second that stalls the
event loop and every stream, before any check on the field's length could run. The bounds decide most
bodies without decoding them:

    upper bound (any encoding)    every value but the first of its container follows a comma outside
                                  strings, and the first ones are at most the containers, each of which
                                  opens with "{" or "[" (bytes inside strings only add):
                                  values <= count(",") + count("{") + count("[")
    lower bound (UTF-8 only:      strings: a raw '"' only delimits a string, and at most count('\\"') of
    ASCII bytes never occur       the quote bytes are escaped, so strings >= (count('"') - count('\\"')) / 2;
    inside another character)     each string is a value, a member's key (which comes with its value and
                                  one colon) or the root: values >= (strings - 1) / 2 and
                                  values >= strings - 1 - count(":")
                                  commas: with the strings' spans found one by one (bodies of at most
                                  `MAX_SPAN_QUOTES` quotes), each comma outside them separates two values:
                                  values >= commas outside strings

A body whose upper bound is within a limit is within it; one whose lower bound is past it is past it;
the rest are decoded and counted (`values_beyond`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# past this many quotes, finding the strings' spans one by one costs more than decoding the body
MAX_SPAN_QUOTES = 100_000
# bytes compared per numpy call (the temporary arrays' size)
WINDOW_BYTES = 1 << 22


def count_bytes(body: bytes, pattern: bytes, start: int = 0, end: int | None = None) -> int:
    """`body.count(pattern, start, end)` for a one- or two-byte `pattern` that cannot overlap itself,
    by numpy comparisons that run without the GIL (`bytes.count` keeps it: ~0.6 ms a MiB, 30 ms a
    pattern for a 50 MB body, all of it time the engine thread cannot step), in windows of at most
    `WINDOW_BYTES` (an occurrence is counted in the window it starts in)."""
    if not 1 <= len(pattern) <= 2:
        raise ValueError(f"count_bytes counts one- or two-byte patterns, got {pattern!r}")
    end = len(body) if end is None else min(end, len(body))
    count = 0
    for pos in range(start, end, WINDOW_BYTES):
        window = np.frombuffer(body, dtype=np.uint8, count=min(WINDOW_BYTES + 1, end - pos), offset=pos)
        if len(pattern) == 1:
            count += int(np.count_nonzero(window[:WINDOW_BYTES] == pattern[0]))
        else:
            count += int(np.count_nonzero((window[:-1] == pattern[0]) & (window[1:] == pattern[1])))
    return count


def values_upper_bound(body: bytes) -> int:
    """At least the number of JSON values in `body` (see the module docstring)."""
    return count_bytes(body, b",") + count_bytes(body, b"{") + count_bytes(body, b"[")


def values_lower_bound(body: bytes) -> int:
    """At most the number of JSON values in `body` if it is valid JSON (0 for a body not in UTF-8)."""
    if json.detect_encoding(body) != "utf-8":
        return 0
    quotes = count_bytes(body, b'"')
    strings = (quotes - count_bytes(body, b'\\"')) // 2
    bound = max(strings // 2, strings - 1 - count_bytes(body, b":"))
    if quotes <= MAX_SPAN_QUOTES:
        bound = max(bound, _commas_outside_strings(body))
    return bound


def values_beyond(value: Any, limit: int) -> bool:
    """Whether the decoded JSON `value` holds more than `limit` values (stops as soon as it does)."""
    count = 0
    containers = [value] if isinstance(value, (dict, list)) else []
    while containers:
        container = containers.pop()
        children = container.values() if isinstance(container, dict) else container
        count += len(children)
        if count > limit:
            return True
        containers.extend(child for child in children if isinstance(child, (dict, list)))
    return False


def depth_beyond(value: Any, limit: int) -> bool:
    """Whether the decoded JSON `value` nests arrays and objects more than `limit` deep (a scalar root is
    depth 0, `[]` and `{}` depth 1); stops at the first container past it."""
    containers = [(value, 1)] if isinstance(value, (dict, list)) else []
    while containers:
        container, depth = containers.pop()
        if depth > limit:
            return True
        children = container.values() if isinstance(container, dict) else container
        containers.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _commas_outside_strings(body: bytes) -> int:
    """Commas in `body` outside its string literals (a quote opens a literal, the next quote that no
    backslash escapes closes it); an unterminated literal runs to the end."""
    commas = count_bytes(body, b",")
    pos = 0
    while (start := body.find(b'"', pos)) != -1:
        end = closing_quote(body, start + 1)
        commas -= count_bytes(body, b",", start, len(body) if end is None else end)
        if end is None:
            break
        pos = end + 1
    return commas


def closing_quote(text: str | bytes, pos: int) -> int | None:
    """Index of the first quote in `text` at or after `pos` that no backslash escapes, or None."""
    quote_mark, backslash = ('"', "\\") if isinstance(text, str) else (b'"', b"\\")
    while (quote := text.find(quote_mark, pos)) != -1:
        first = quote
        while first > pos and text[first - 1:first] == backslash:
            first -= 1
        if (quote - first) % 2 == 0:
            return quote
        pos = quote + 1
    return None
