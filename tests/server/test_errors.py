"""Every invalid request is a 400 with an OpenAI error body, never a 500, and the engine keeps
serving; an engine failure fails only the requests in flight."""

from __future__ import annotations

import httpx
import openai
import pytest

from forkpoint.server.config import ServerConfig
from tests.server.conftest import MARKER, serve

LONG_PROMPT = "word " * 5000  # > max_model_len 4096 of the test servers

# (case id, path, body, expected param or None for "any")
CASES = [
    ("unknown model", "/v1/completions", {"model": "gpt-nope", "prompt": "x"}, "model"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("oversized max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("oversized max_completion_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000}, "max_tokens"),
    ("temperature too high", "/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("negative temperature", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": -0.1}, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("marker at position 0", "/v1/completions", {"prompt": MARKER + "hello"}, "prompt"),
    ("two markers at one position", "/v1/completions", {"prompt": "hello" + MARKER + MARKER + " x"}, "prompt"),
    ("too many markers", "/v1/completions", {"prompt": "".join(f"w{i}{MARKER}" for i in range(6))}, "prompt"),
    ("checkpoint position beyond prompt", "/v1/completions",
     {"prompt": [1, 2, 3], "checkpoint_positions": [9]}, "prompt"),
    ("checkpoint position 0", "/v1/completions", {"prompt": [1, 2, 3], "checkpoint_positions": [0]}, "prompt"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, "prompt"),
    ("missing prompt", "/v1/completions", {"max_tokens": 1}, "prompt"),
    ("wrong prompt type", "/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("presence_penalty too high", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty too low", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty zero", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("unsupported field", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("unsupported chat field", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ("unsupported stream option", "/v1/completions",
     {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("max_tokens 0 without echo", "/v1/completions", {"prompt": "x", "max_tokens": 0}, None),
    ("logit_bias key not an id", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias id outside vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}},
     "logit_bias"),
    ("allowed_token_ids empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("min_tokens above max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
     "min_tokens"),
    ("two structured constraints", "/v1/completions",
     {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("structured_outputs with two fields", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("structured_outputs unknown field", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"structural_tag": "a"}}, "structured_outputs"),
    ("invalid regex", "/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
    ("json_schema without schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ("tool_choice without tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
    ("named tool not in tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    ("tool_choice with a structured constraint", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ("tool call arguments not JSON", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls"),
    ("tokenize both inputs", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
    ("detokenize bad id", "/detokenize", {"tokens": [-1]}, "tokens"),
]


def _assert_error_body(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("path,body,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request_is_400(server, path, body, param):
    body = {"model": server.model, **body} if path.startswith("/v1") and "model" not in body else body
    error = _assert_error_body(server.post(path, json=body))
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_malformed_json_is_400(server):
    error = _assert_error_body(server.post("/v1/chat/completions", content=b'{"messages": [',
                                           headers={"content-type": "application/json"}))
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


def test_openai_client_raises_bad_request_and_engine_survives(server):
    client = server.client()
    invalid_before = server.metric("forkpoint_requests_total", endpoint="completions", outcome="invalid_request")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="x", temperature=3.0)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=MARKER + "x")
    assert server.metric("forkpoint_requests_total", endpoint="completions",
                         outcome="invalid_request") == invalid_before + 2
    assert client.completions.create(model=server.model, prompt="fine", max_tokens=1).choices[0].text is not None
    server.engine_call(lambda engine: engine.check_integrity())


def test_unknown_route_has_error_body(server):
    error = _assert_error_body(httpx.get(f"{server.base_url}/v1/nothing-here"), status=404)
    assert error["type"] == "invalid_request_error"


def test_engine_failure_fails_in_flight_requests_only(spare_llm, monkeypatch):
    """A step that raises ends the requests in flight with a 500 (or an in-band error event when
    streaming); the server and the engine keep serving."""
    engine = spare_llm.engine
    real_step = engine.step
    failures = iter([True])

    def failing_step():
        if next(failures, False):
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with serve(spare_llm, ServerConfig()) as srv:
        response = srv.post("/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 2})
        error = _assert_error_body(response, status=500)
        assert error["type"] == "server_error" and "injected step failure" in error["message"]
        srv.wait_idle()
        srv.engine_call(lambda e: e.check_integrity())
        out = srv.client().completions.create(model=srv.model, prompt="after", max_tokens=1)
        assert out.choices[0].finish_reason == "length"
        assert srv.metric("forkpoint_requests_total", endpoint="completions", outcome="error") == 1
