"""Large JSON bodies are decoded off the event loop, in steps short enough for the loop to run between
them, and the result is json.loads's (values and errors); a body of more JSON objects than the limit
is refused while it is decoded, before any model is built."""

from __future__ import annotations

import json
import random
import threading

import pytest

import forkpoint.server.json_body as json_body
from forkpoint.server.errors import TooManyObjects
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

    def recording_decode(body: bytes, max_objects: int | None = None):
        threads.append(threading.get_ident())
        return decode_json(body, max_objects)

    monkeypatch.setattr(json_body, "decode_json", recording_decode)
    big = {"model": server.model, "prompt": "alpha beta " * 200_000, "max_tokens": 1}  # 2.2 MB: too long a prompt
    answer = server.post("/v1/completions", json=big)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert len(threads) == 1 and threads[0] != server.thread.ident
    small = server.post("/v1/completions", json={"model": server.model, "prompt": "small", "max_tokens": 1})
    assert small.status_code == 200 and len(threads) == 1


def count_objects(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(count_objects(item) for item in value.values())
    if isinstance(value, list):
        return sum(count_objects(item) for item in value)
    return 0


@pytest.mark.parametrize("piece_chars", [16, 1 << 20])
def test_decode_json_refuses_one_object_past_the_limit_and_no_fewer(monkeypatch, piece_chars):
    """Random bodies (literals cut into pieces or not, UTF-8 and UTF-16): at a limit of exactly their
    object count the value is json.loads's; one less raises TooManyObjects."""
    monkeypatch.setattr(json_body, "PIECE_CHARS", piece_chars)
    rng = random.Random(1)
    checked = 0
    for _ in range(600):
        value = {"messages": [random_value(rng) for _ in range(rng.randint(1, 4))]}
        objects = count_objects(value)
        for encoding in ("utf-8", "utf-16"):
            body = json.dumps(value, ensure_ascii=False).encode(encoding, "surrogatepass")
            assert json.dumps(decode_json(body, objects)) == json.dumps(json.loads(body)), body
            with pytest.raises(TooManyObjects) as refused:
                decode_json(body, objects - 1)
            assert refused.value.status_code == 400 and refused.value.body()["error"]["code"] == "too_many_objects"
            checked += objects > 1
    assert checked > 300


def test_a_body_past_the_object_limit_is_refused_before_validation(server, monkeypatch):
    """8,200 content parts (the default limit is 8,192 objects): 400 too_many_objects, from the
    decode (no model is built), on the OpenAI and the Anthropic routes in their own error shapes."""
    validated: list[str] = []
    from forkpoint.server import protocol

    original = protocol.ChatCompletionRequest.model_validate
    monkeypatch.setattr(protocol.ChatCompletionRequest, "model_validate",
                        classmethod(lambda cls, *a, **k: validated.append("chat") or original(*a, **k)))
    parts = [{"type": "text", "text": "a"}] * 8_200
    chat = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": parts}]})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "too_many_objects" and "--max-request-objects" in chat.text
    anthropic = server.post("/v1/messages", json={"model": server.model, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": parts}]})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "invalid_request_error" and "8192 JSON objects" in anthropic.text
    assert validated == []


def test_braces_inside_strings_are_no_objects(server):
    """A body of 20,000 '{' characters in a string (past the limit in bytes, one object in JSON) gets
    past the decode: /tokenize counts its tokens."""
    answer = server.post("/tokenize", json={"model": server.model, "prompt": "{" * 20_000})
    assert answer.status_code == 200 and answer.json()["count"] > 8192, answer.text


def test_a_body_past_the_value_limit_is_refused_from_its_bytes(server, monkeypatch):
    """600,000 token ids (the test server's limit: 2^18 values) are a 400 too_many_values without
    being decoded; the same count of one-letter stop strings too."""
    decoded: list[int] = []
    monkeypatch.setattr(json_body, "decode_json", lambda body, max_objects=None: decoded.append(len(body)))
    ids = server.post("/v1/completions", json={"model": server.model, "prompt": [7] * 600_000, "max_tokens": 1})
    assert ids.status_code == 400 and ids.json()["error"]["code"] == "too_many_values", ids.text
    assert "--max-request-values" in ids.text
    stops = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 1, "stop": ["a"] * 600_000,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert stops.status_code == 400 and stops.json()["error"]["code"] == "too_many_values", stops.text
    assert decoded == []


def test_commas_inside_strings_are_no_values(server):
    """A prompt of 600,000 commas (past the value limit in bytes, one value in JSON) is decoded and
    counted, and gets as far as the length check."""
    answer = server.post("/v1/completions", json={"model": server.model, "prompt": "," * 600_000, "max_tokens": 1})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded", answer.text


@pytest.mark.parametrize(("name", "body", "code"), [
    ("arrays 100,000 deep", b'{"model": "M", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deep"),
    ("objects 5,000 deep", b'{"model": "M", "prompt": "x", "x": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_001,
     "too_deep"),
    ("an integer of 5,000 digits", b'{"model": "M", "prompt": "x", "seed": ' + b"1" * 5_000 + b"}", "number_too_long"),
    ("NaN", b'{"model": "M", "prompt": "x", "temperature": NaN}', "not_json"),
    ("a byte that is no UTF-8", b'{"model": "M", "prompt": "x\xff"}', "not_json"),
    ("-Infinity in a body decoded in the thread",
     b'{"model": "M", "prompt": "' + b"x " * 600_000 + b'", "temperature": -Infinity}', "not_json"),
])
def test_a_body_json_cannot_hold_gets_a_clear_400(server, name, body, code):
    answer = server.post("/v1/completions", content=body.replace(b'"M"', f'"{server.model}"'.encode()),
                         headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == code, (name, answer.text)
    assert "error parsing the body" not in answer.text


def test_a_body_nested_past_the_depth_limit_is_refused_and_one_within_it_served(server):
    """A json_schema 129 objects deep (past MAX_JSON_DEPTH) is a 400 too_deep, from a small body and from one
    decoded in the thread; 30 deep is served (it was a 500 at 400 deep: the lone-surrogate walk recursed)."""
    def schema(depth):
        value = {"type": "string"}
        for _ in range(depth - 1):
            value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
        return value

    def ask(depth, padding=""):
        return server.post("/v1/chat/completions", json={
            "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi" + padding}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(depth)}}})

    # the schema object at depth d sits 3 + 2 (d - 1) levels deep: body, response_format, json_schema
    too_deep = (json_body.MAX_JSON_DEPTH - 3) // 2 + 2
    for answer in (ask(too_deep), ask(too_deep, " x" * 600_000)):
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "too_deep", answer.text
    within = ask(too_deep - 1)
    assert within.json().get("error", {}).get("code") != "too_deep", within.text
    assert ask(30).status_code == 200


def test_a_grammar_too_deep_to_convert_is_a_400(server):
    grammar = "root ::= " + "(" * 500 + '"a"' + ")" * 500
    answer = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}],
                                                       "structured_outputs": {"grammar": grammar}})
    assert answer.status_code == 400 and "nests too deeply" in answer.text, answer.text


def test_a_choice_list_past_the_limit_is_a_400_before_any_compile(server):
    """5,000 choices: a 400 naming structured_outputs.choice at once (100,000 once held the engine thread 32 s
    compiling, then failed with a Rust backtrace in the message)."""
    answer = server.post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"choice": [f"c{i}" for i in range(5_000)]}})
    assert answer.status_code == 400 and "at most 4096 are taken" in answer.text, answer.text
