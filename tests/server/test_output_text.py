"""vLLM's output-text fields over HTTP (skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output) through the openai client's extra_body, on a server over the tiny word-level
model (its decoder puts a space between tokens, so the spaces rule shows): each changes the text as
SamplingParams says, streamed deltas add up to the whole text, and a wrong type is a 400 naming the field.
/v1/responses and /v1/messages do not take them (nor does vLLM)."""

from __future__ import annotations

import re

import pytest

from forkpoint import LLM
from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve
from tests.server.test_errors import _assert_error_body

PROMPT = "w1 w2 w3 w4"
START = "<|im_start|>"  # id 2 of the tiny tokenizer (special), EOS "<|im_end|>" is id 1
FIELDS = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


@pytest.fixture(scope="module")
def tiny(moe_model):
    llm = LLM(str(moe_model[0]), num_kv_blocks=128, max_model_len=256, enable_checkpoints=False)
    with serve(llm, ServerConfig(served_model_name="tiny")) as server:
        yield server


def completion(server, **extra) -> tuple[str, str, str]:
    """(whole text, streamed deltas joined, finish_reason) of one greedy completion of PROMPT."""
    whole, streamed = completion_streamed(server, **extra)
    return whole.text, "".join(streamed), whole.finish_reason


def completion_streamed(server, **extra):
    """(the whole choice, the streamed text deltas) of one completion of PROMPT (greedy unless told)."""
    client = server.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, seed=1)
    args.update({k: extra.pop(k) for k in ("temperature", "stop") if k in extra})
    whole = client.completions.create(**args, extra_body=extra).choices[0]
    return whole, [c.choices[0].text for c in client.completions.create(**args, stream=True, extra_body=extra)]


def test_include_stop_str_in_output_keeps_the_stop_string(tiny):
    """Cut right after the stop string instead of right before it; streamed, nothing is held back (vLLM):
    the word where the stop string starts is sent whole as soon as it is out."""
    text, _, _ = completion(tiny, ignore_eos=True)
    words, starts = text.split(" "), [0]
    for word in words:
        starts.append(starts[-1] + len(word) + 1)
    # a stop string from the second character of a word into the next: its first occurrence
    j = next(j for j in range(1, len(words) - 1) if text.find(f"{words[j][1:]} {words[j + 1][:2]}") == starts[j] + 1)
    stop, word_end = f"{words[j][1:]} {words[j + 1][:2]}", starts[j + 1] - 1
    cut, cut_streamed, reason = completion(tiny, ignore_eos=True, stop=[stop])
    assert cut == cut_streamed == text[:starts[j] + 1] and reason == "stop"
    kept, streamed = completion_streamed(tiny, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == "".join(streamed) == text[:starts[j] + 1 + len(stop)] and kept.finish_reason == "stop"
    sent = [sum(map(len, streamed[:i])) for i in range(len(streamed) + 1)]
    assert word_end in sent  # held back as a possible stop string start without include_stop_str_in_output
    _, held = completion_streamed(tiny, ignore_eos=True, stop=[stop])
    assert word_end not in [sum(map(len, held[:i])) for i in range(len(held) + 1)]


def test_special_tokens_kept_and_joined(tiny):
    mixed = dict(temperature=1.0, ignore_eos=True, allowed_token_ids=[2, 30, 31], logit_bias={"2": 4.0})
    plain, plain_streamed, _ = completion(tiny, **mixed)
    kept, kept_streamed, _ = completion(tiny, **mixed, skip_special_tokens=False)
    joined, joined_streamed, _ = completion(tiny, **mixed, skip_special_tokens=False,
                                           spaces_between_special_tokens=False)
    assert plain == plain_streamed and START not in plain
    assert kept == kept_streamed and f"{START} {START}" in kept
    assert [word for word in kept.split() if word != START] == plain.split()
    assert joined == joined_streamed == re.sub(r"(?<=<\|im_start\|>) (?=<\|im_start\|>)", "", kept)


def test_the_eos_text_comes_only_with_include_stop_str_in_output(tiny):
    eos = dict(min_tokens=3, logit_bias={"1": 30.0})
    text, streamed, reason = completion(tiny, **eos, skip_special_tokens=False)
    assert text == streamed and len(text.split()) == 3 and reason == "stop"
    kept, kept_streamed, _ = completion(tiny, **eos, skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept == kept_streamed == text + " <|im_end|>"
    client = tiny.client()
    args = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0,
                extra_body={**eos, "skip_special_tokens": False, "include_stop_str_in_output": True})
    chat = client.chat.completions.create(**args).choices[0]
    chunks = client.chat.completions.create(**args, stream=True)
    assert chat.message.content.endswith(" <|im_end|>") and chat.finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.message.content


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]})])
def test_a_wrong_type_is_400_naming_the_field(tiny, path, body, field):
    error = _assert_error_body(tiny.post(path, json={"model": "tiny", **body, field: "maybe"}))
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert tiny.post(path, json={"model": "tiny", "max_tokens": 1, **body, field: True}).status_code == 200


@pytest.mark.parametrize("field", FIELDS)
def test_responses_and_messages_do_not_take_them(tiny, field):
    error = _assert_error_body(tiny.post("/v1/responses", json={"model": "tiny", "input": "w1", field: True}))
    assert error["param"] == field
    refused = tiny.post("/v1/messages", json={"model": "tiny", "max_tokens": 1, field: True,
                                              "messages": [{"role": "user", "content": "w1"}]})
    assert refused.status_code == 400 and field in refused.json()["error"]["message"]
