"""The OpenAI-compatible endpoints, through the official openai client against a real server."""

from __future__ import annotations

import json

import httpx


def test_health_and_models(server):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["forkpoint-test"]


def test_completion(server):
    out = server.client().completions.create(model=server.model, prompt="The capital of France is",
                                             max_tokens=3, temperature=0)
    assert out.object == "text_completion"
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens == len(server.post("/tokenize", json={"prompt": "The capital of France is"})
                                           .json()["tokens"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + 3
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_is_deterministic_and_matches_token_prompt(server):
    client = server.client()
    text = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=3, temperature=0)
    ids = server.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    again = client.completions.create(model=server.model, prompt=ids, max_tokens=3, temperature=0)
    assert again.choices[0].text == text.choices[0].text


def test_completion_batch_n_and_logprobs(server):
    out = server.client().completions.create(model=server.model, prompt=["Red", "Green"], n=2, max_tokens=2,
                                             temperature=1.0, seed=7, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == 2
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert out.usage.completion_tokens == 8


def test_chat(server):
    out = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert len(out.choices[0].logprobs.content) == 2
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 3
    assert out.usage.completion_tokens == 2


def test_streaming_completion_matches_non_streaming(server):
    client = server.client()
    whole = client.completions.create(model=server.model, prompt="Counting: one two", max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model=server.model, prompt="Counting: one two", max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


def test_streaming_chat(server):
    stream = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=3, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=3, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_sse_wire_format(server):
    """Raw SSE: every event is `data: <json>` and the stream ends with `data: [DONE]`."""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": server.model, "prompt": "abc", "max_tokens": 2, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_tokenize_and_detokenize(server):
    tokens = server.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 4096 and tokens["checkpoint_positions"] == []
    assert server.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello world"}
    chat = server.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert chat["count"] > tokens["count"]


def test_streamed_text_equals_whole_text_with_a_stop_string(server):
    """Streaming holds back a tail that may start a stop string, so it never sends text that the
    finished output does not contain."""
    client = server.client()
    prompt = "Streaming check: alpha beta gamma"
    probe = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
    pieces, text = probe.choices[0].logprobs.tokens, probe.choices[0].text
    # a stop string that spans a token boundary and first occurs there
    boundary = next(i for i in range(1, len(pieces) - 1) if pieces[i] and pieces[i + 1]
                    and "".join(pieces[: i + 1]) == text[: len("".join(pieces[: i + 1]))]
                    and text.find(pieces[i][-1] + pieces[i + 1][0]) == len("".join(pieces[: i + 1])) - 1)
    stop = pieces[boundary][-1] + pieces[boundary + 1][0]
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    chunks = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].text == text[: text.find(stop)]


def test_penalties_reach_the_sampler(server):
    """Negative penalties reward repeats: the greedy continuation must start repeating itself."""
    client = server.client()
    prompt = "Once upon a time there was"
    rewarded = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                                         frequency_penalty=-2.0, presence_penalty=-2.0,
                                         extra_body={"repetition_penalty": 0.5, "ignore_eos": True})
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert rewarded.choices[0].text != plain.choices[0].text
