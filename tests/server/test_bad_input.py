"""Malformed input a careless or hostile client sends is a 400 naming the right parameter, never a 500:
lone surrogates and CESU-8 bytes, ids outside the vocabulary, booleans as token ids, unknown roles,
clashing template arguments; and a client that hangs up while uploading is not an invalid request."""

from __future__ import annotations

import socket
import time

import pytest

from tests.server.test_errors import _assert_error_body

LONE = "\\ud800"  # a JSON escape that decodes to a lone surrogate (valid JSON, not encodable text)
USER = '{"role": "user", "content": "hello"}'

# (case id, path, raw JSON body with {model}, expected param)
CASES = [
    ("lone surrogate in prompt", "/v1/completions", '{"model": "{model}", "prompt": "a' + LONE + 'b"}', "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", '{"model": "{model}", "prompt": ["ok", "' + LONE + '"]}',
     "prompt"),
    ("lone surrogate in messages", "/v1/chat/completions",
     '{"model": "{model}", "messages": [{"role": "user", "content": "x' + LONE + '"}]}', "messages"),
    ("lone surrogate in a content part", "/v1/chat/completions",
     '{"model": "{model}", "messages": [{"role": "user", "content": [{"type": "text", "text": "' + LONE + '"}]}]}',
     "messages"),
    # a body over OFF_LOOP_CHECK_BYTES (64 KiB) is checked in the tokenizer pool: the same 400
    ("lone surrogate after 8,000 content parts", "/v1/chat/completions",
     '{"model": "{model}", "messages": [{"role": "user", "content": ['
     + '{"type": "text", "text": "x"}, ' * 8000 + '{"type": "text", "text": "' + LONE + '"}]}]}', "messages"),
    ("lone surrogate in a 64 KiB /v1/responses input", "/v1/responses",
     '{"model": "{model}", "input": "' + "x" * 70000 + LONE + '"}', "input"),
    ("lone surrogate in bad_words", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "bad_words": ["' + LONE + '"]}', "bad_words"),
    ("lone surrogate in stop", "/v1/completions", '{"model": "{model}", "prompt": "x", "stop": ["' + LONE + '"]}',
     "stop"),
    ("too many stop strings", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "stop": [' + ", ".join(f'"s{i}"' for i in range(129)) + ']}', "stop"),
    ("a stop string too long", "/v1/completions", '{"model": "{model}", "prompt": "x", "stop": "' + "s" * 1025 + '"}',
     "stop"),
    ("lone surrogate in /tokenize", "/tokenize", '{"prompt": "' + LONE + '"}', "prompt"),
    ("lone surrogate in /tokenize messages", "/tokenize",
     '{"messages": [{"role": "user", "content": "' + LONE + '"}]}', "messages"),
    ("logit_bias id outside the vocabulary", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "logit_bias": {"999999999": 1}}', "logit_bias"),
    ("logit_bias value a boolean", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "logit_bias": {"1": true}}', "logit_bias"),
    ("allowed_token_ids outside the vocabulary", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "allowed_token_ids": [999999999]}', "allowed_token_ids"),
    ("seed too large", "/v1/completions", '{"model": "{model}", "prompt": "x", "seed": 100000000000000000000000}',
     "seed"),
    ("seed too small", "/v1/completions", '{"model": "{model}", "prompt": "x", "seed": -100000000000000000000000}',
     "seed"),
    ("boolean token ids", "/v1/completions", '{"model": "{model}", "prompt": [true, false]}', "prompt"),
    ("boolean token id in a batch", "/v1/completions", '{"model": "{model}", "prompt": [[1, 2], [3, true]]}',
     "prompt"),
    ("boolean allowed_token_ids", "/v1/completions",
     '{"model": "{model}", "prompt": "x", "allowed_token_ids": [true]}', "allowed_token_ids"),
    ("boolean stop_token_ids", "/v1/completions", '{"model": "{model}", "prompt": "x", "stop_token_ids": [false]}',
     "stop_token_ids"),
    ("boolean detokenize ids", "/detokenize", '{"tokens": [true]}', "tokens"),
    ("unknown role", "/v1/chat/completions", '{"model": "{model}", "messages": [{"role": "hacker", "content": "x"}]}',
     "messages"),
    ("template kwarg clashes with messages", "/v1/chat/completions",
     '{"model": "{model}", "messages": [' + USER + '], "chat_template_kwargs": {"messages": []}}',
     "chat_template_kwargs"),
    ("template kwarg clashes with add_generation_prompt", "/v1/chat/completions",
     '{"model": "{model}", "messages": [' + USER + '], "chat_template_kwargs": {"add_generation_prompt": false}}',
     "chat_template_kwargs"),
    ("template kwarg clashes with tokenize", "/tokenize",
     '{"messages": [' + USER + '], "chat_template_kwargs": {"tokenize": true}}', "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,raw,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_400_naming_the_parameter(server, path, raw, param):
    response = server.post(path, content=raw.replace("{model}", server.model).encode(),
                           headers={"content-type": "application/json"})
    error = _assert_error_body(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_cesu8_bytes_are_400(server):
    """A surrogate encoded as UTF-8 bytes (CESU-8, b'\\xed\\xa0\\x80') is not UTF-8: 400, not 500."""
    body = b'{"model": "' + server.model.encode() + b'", "prompt": "a\xed\xa0\x80b"}'
    error = _assert_error_body(server.post("/v1/completions", content=body,
                                           headers={"content-type": "application/json"}))
    assert error["type"] == "invalid_request_error"


def test_disconnect_during_upload_is_not_an_invalid_request(server):
    """A client that sends half its body and hangs up is counted as aborted, not as invalid_request."""
    invalid = server.metric("forkpoint_requests_total", endpoint="completions", outcome="invalid_request")
    aborted = server.metric("forkpoint_requests_total", endpoint="completions", outcome="aborted")
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hal")
    server.wait_idle()
    for _ in range(100):  # the server notices the hang-up asynchronously
        if server.metric("forkpoint_requests_total", endpoint="completions", outcome="aborted") > aborted:
            break
        time.sleep(0.05)
    assert server.metric("forkpoint_requests_total", endpoint="completions", outcome="invalid_request") == invalid
    assert server.metric("forkpoint_requests_total", endpoint="completions", outcome="aborted") == aborted + 1
    assert server.post("/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": 1}).status_code \
        == 200


def test_stop_bounds_are_named_in_the_message(server):
    response = server.post("/v1/completions", json={"model": server.model, "prompt": "x",
                                                    "stop": [f"s{i}" for i in range(100_000)]})
    error = _assert_error_body(response)
    assert error["param"] == "stop" and "100000 strings; at most 128" in error["message"]
