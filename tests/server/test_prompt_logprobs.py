"""Scoring over HTTP: /v1/completions with echo and logprobs (OpenAI's layout), max_tokens 0,
vLLM's prompt_logprobs; the numbers equal the offline RequestOutput.prompt_logprobs, through
checkpoints too."""

from __future__ import annotations

import math

from forkpoint import SamplingParams
from tests.server.conftest import MARKER


def offline(llm, ids: list[int], k: int = 1):
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k),
                       use_tqdm=False)[0]
    return out.prompt_logprobs


def test_echo_scores_the_prompt_without_generating(server, spare_llm):
    text = "The quick brown fox jumps over the lazy dog"
    ids = server.post("/tokenize", json={"prompt": text}).json()["tokens"]
    out = server.client().completions.create(model=server.model, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                             temperature=0)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = offline(spare_llm, ids, 2)
    assert expected[0] is None and len(expected) == len(ids)
    for i in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[i], float(expected[i][ids[i]]), abs_tol=1e-5)
        assert len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_with_generation_and_streaming(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=2, echo=True,
                                    logprobs=0, temperature=0)
    n = out.usage.prompt_tokens
    assert len(out.choices[0].logprobs.tokens) == n + 2 and out.choices[0].text.startswith("Once upon a time")
    chunks = list(client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=2, echo=True,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_prompt_logprobs_with_a_checkpoint_ready(server, spare_llm, anchor_text):
    """A scoring request whose prefix has a ready checkpoint gets the numbers of a plain run (the
    engine computes a scored prompt whole: see README)."""
    client = server.client()
    anchor = anchor_text("score")
    for suffix in (" first candidate", " second candidate"):  # producer, then a consumer that reuses it
        plain = client.completions.create(model=server.model, prompt=anchor + MARKER + suffix, max_tokens=1,
                                          temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    out = client.completions.create(model=server.model, prompt=anchor + MARKER + " second candidate", max_tokens=0,
                                    echo=True, logprobs=1, temperature=0)
    ids = server.post("/tokenize", json={"prompt": anchor + MARKER + " second candidate"}).json()["tokens"]
    expected = offline(spare_llm, ids)  # no marker: computed from scratch
    got = out.choices[0].logprobs.token_logprobs
    assert max(abs(got[i] - float(expected[i][ids[i]])) for i in range(1, len(ids))) < 1e-5


def test_vllm_prompt_logprobs_field(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="Hello there", max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out.usage.prompt_tokens
    assert all(1 <= len(e) <= 2 and all({"logprob", "rank", "decoded_token"} <= set(v) for v in e.values())
               for e in entries[1:])
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
