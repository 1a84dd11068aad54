"""Large JSON bodies are decoded off the event loop, in steps short enough for the loop to run between
them, and the result is json.loads's (values and errors)."""

from __future__ import annotations

import json
import random
import threading

import pytest

import forkpoint.server.json_body as json_body
from forkpoint.server.json_body import decode_json

ALPHABET = ["a", " ", '"', "\\", "\n", "\t", "/", "é", "日", "😀", "\ud800"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 3 and kind < 0.2:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and kind < 0.4:
        return {random_text(rng, 40): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind < 0.5:
        return rng.randint(-10**6, 10**6)
    return random_text(rng, 80)


def random_text(rng: random.Random, longest: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, longest)))


def test_decode_json_equals_json_loads_with_literals_cut_into_pieces(monkeypatch):
    """Pieces of 16 characters: most literals are cut, through escapes, surrogate pairs and lone surrogates."""
    monkeypatch.setattr(json_body, "PIECE_CHARS", 16)
    rng = random.Random(0)
    for _ in range(1500):
        value = random_value(rng)
        for ensure_ascii in (True, False):
            body = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
            assert json.dumps(decode_json(body)) == json.dumps(json.loads(body)), body


@pytest.mark.parametrize("body", [b'{"a": "' + b"x" * 100 + b'\x01"}', b'{"a": "' + b"x" * 100,
                                  b'{"a": "' + b"x" * 100 + b'\\q"}', b'{"a": "' + b"x" * 100 + b'"} x'])
def test_an_invalid_body_raises_json_loads_error(monkeypatch, body):
    monkeypatch.setattr(json_body, "PIECE_CHARS", 16)
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(body)
    with pytest.raises(json.JSONDecodeError) as got:
        decode_json(body)
    assert (got.value.msg, got.value.pos) == (expected.value.msg, expected.value.pos)


def test_a_long_literal_is_decoded_in_pieces(monkeypatch):
    """No step of the decode scans more than PIECE_CHARS of the literal (the GIL is held per step)."""
    monkeypatch.setattr(json_body, "PIECE_CHARS", 1000)
    pieces: list[int] = []
    scanstring = json_body.scanstring

    def recording_scanstring(text, end, *args):
        pieces.append(len(text))
        return scanstring(text, end, *args)

    monkeypatch.setattr(json_body, "scanstring", recording_scanstring)
    prompt = "word \\u65e5 \\ud83d\\ude00 \\n " * 5000
    assert decode_json(b'{"prompt": "' + prompt.encode() + b'"}') == {"prompt": json.loads(f'"{prompt}"')}
    assert len(pieces) > 100 and max(pieces) <= 1001


def test_a_large_body_is_decoded_off_the_event_loop_and_a_small_one_on_it(server, monkeypatch):
    threads: list[int] = []

    def recording_decode(body: bytes):
        threads.append(threading.get_ident())
        return decode_json(body)

    monkeypatch.setattr(json_body, "decode_json", recording_decode)
    big = {"model": server.model, "prompt": "alpha beta " * 200_000, "max_tokens": 1}  # 2.2 MB: too long a prompt
    answer = server.post("/v1/completions", json=big)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert len(threads) == 1 and threads[0] != server.thread.ident
    small = server.post("/v1/completions", json={"model": server.model, "prompt": "small", "max_tokens": 1})
    assert small.status_code == 200 and len(threads) == 1
