"""The bounds on a JSON body's values read from its bytes hold for every body (lower <= exact <= upper),
and the exact count of a decoded body stops at the limit."""

from __future__ import annotations

import json
import random

import pytest

import forkpoint.server.json_counts as json_counts
from forkpoint.server.json_counts import closing_quote, values_beyond, values_lower_bound, values_upper_bound

ALPHABET = ["a", " ", '"', "\\", ",", "{", "[", "]", "}", ":", "é", "😀", "\\u"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 4 and kind < 0.25:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    if depth < 4 and kind < 0.5:
        return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    if kind < 0.6:
        return rng.randint(-10**6, 10**6)
    if kind < 0.65:
        return rng.choice([None, True, 1.5e300])
    return random_text(rng)


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 10)))


def exact_values(value) -> int:
    if isinstance(value, dict):
        return len(value) + sum(exact_values(item) for item in value.values())
    if isinstance(value, list):
        return len(value) + sum(exact_values(item) for item in value)
    return 0


@pytest.mark.parametrize("max_span_quotes", [0, 100_000])
def test_the_bounds_hold_for_random_bodies(monkeypatch, max_span_quotes):
    """2,000 random values, each written compact and spaced, escaped and not, in UTF-8 and UTF-16;
    with and without the strings' spans (max_span_quotes 0 leaves only the quotes' bound)."""
    monkeypatch.setattr(json_counts, "MAX_SPAN_QUOTES", max_span_quotes)
    rng = random.Random(0)
    tight = 0
    for _ in range(2000):
        value = random_value(rng)
        exact = exact_values(value)
        for ensure_ascii, separators, encoding in ((True, None, "utf-8"), (False, (",", ":"), "utf-8"),
                                                   (False, None, "utf-16")):
            body = json.dumps(value, ensure_ascii=ensure_ascii, separators=separators).encode(encoding)
            lower, upper = values_lower_bound(body), values_upper_bound(body)
            assert lower <= exact <= upper, (body, lower, exact, upper)
            if encoding == "utf-16":
                assert lower == 0
            tight += exact > 0 and lower == exact
            assert values_beyond(value, exact) is False
            if exact > 0:
                assert values_beyond(value, exact - 1) is True
    assert tight > 50  # the lower bound is the exact count for many bodies: not vacuous


def test_a_body_of_token_ids_or_strings_is_bounded_near_its_count():
    """What the bounds are for: 100,000 token ids, or 100,000 one-letter strings, are proven to be
    more than 99,999 values by their bytes alone."""
    ids = json.dumps({"prompt": [7] * 100_000}).encode()
    strings = json.dumps({"stop": ["a"] * 100_000}).encode()
    assert values_lower_bound(ids) >= 99_999
    assert values_lower_bound(strings) >= 50_000 and values_upper_bound(strings) >= 100_001


@pytest.mark.parametrize("text", ['ab"', 'a\\"b"', 'a\\\\"', 'a\\\\\\"b"', "abc"])
def test_closing_quote_skips_escaped_quotes_in_text_and_bytes(text):
    expected = None
    if text.endswith('"'):
        expected = len(text) - 1
    for given in (text, text.encode()):
        assert closing_quote(given, 0) == expected


def test_count_bytes_in_windows_equals_bytes_count(monkeypatch):
    """Windows of 7 bytes: one- and two-byte patterns across every cut, over whole bodies and ranges."""
    monkeypatch.setattr(json_counts, "WINDOW_BYTES", 7)
    rng = random.Random(2)
    for _ in range(300):
        body = bytes(rng.choice(b'ab\\",') for _ in range(rng.randint(0, 60)))
        start = rng.randint(0, len(body))
        end = rng.randint(start, len(body) + 3)
        for pattern in (b",", b'\\"', b"ab"):
            assert json_counts.count_bytes(body, pattern) == body.count(pattern)
            assert json_counts.count_bytes(body, pattern, start, end) == body.count(pattern, start, end)
