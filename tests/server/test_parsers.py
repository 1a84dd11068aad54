"""Tool-call (Qwen3.5's XML format; tool_parsers/ tests the others) and reasoning parsers on given texts,
whole and streamed in every split."""

from __future__ import annotations

import json

import pytest

from forkpoint.server.reasoning import ReasoningParser, prompt_opens_thinking
from forkpoint.server.tool_parsers import ToolCallParser
from tests.server.tool_parsers.streamed import assert_streams_as_whole

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "ratio": {"type": "number"}}}},
    {"name": "noop"},
]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>")
ARGS = {"city": "San Francisco, CA", "days": 3, "metric": True, "hours": [1, 2], "ratio": 0.5}


def test_parse_calls_and_content():
    parser = ToolCallParser(TOOLS)
    noop = "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    content, calls = parser.parse("Let me check.\n\n" + CALL + noop)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0].arguments) == ARGS and json.loads(calls[1].arguments) == {}
    assert calls[0].id != calls[1].id and calls[0].as_dict()["type"] == "function"


def test_not_a_call_stays_content():
    parser = ToolCallParser(TOOLS)
    for text in ("no calls here", "<tool_call>\n<function=unknown>\n</function>\n</tool_call>",
                 "<tool_call>\nnot xml\n</tool_call>", "cut off <tool_call>\n<function=get_weather>\n<param"):
        content, calls = parser.parse(text)
        assert calls == [] and content == text.strip()


def test_values_that_do_not_fit_their_schema_stay_text():
    parser = ToolCallParser(TOOLS)
    _, calls = parser.parse("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
                            "</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"days": "three"}


@pytest.mark.parametrize("formats", [("qwen3_xml",), ("qwen3_xml", "hermes", "nemotron_json")])
def test_streaming_equals_whole(formats):
    parser = ToolCallParser(TOOLS, formats)
    noop = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    assert_streams_as_whole(parser, "Checking <tool the weather.\n" + CALL + "\nDone." + noop)
    assert_streams_as_whole(parser, "<tool_call>\n<function=unknown>\n</function>\n</tool_call> <tool_call>\n"
                                    "<function=noop>")  # not a call, then an unfinished one: content


def test_a_tail_that_may_start_a_call_is_held_back():
    stream = ToolCallParser(TOOLS).stream()
    assert stream.feed("Let me <").content == "Let me "
    assert stream.feed("tool_c").content == ""
    assert stream.feed("ar is red").content == "<tool_car is red"
    assert stream.feed(" <TOOLC").content == " "
    assert stream.finish().content == "<TOOLC"


@pytest.mark.parametrize("starts_in_reasoning, text, reasoning, content", [
    (True, "I should think.\n</think>\n\nThe answer.", "I should think.\n", "The answer."),
    (False, "<think>hmm</think>Yes", "hmm", "Yes"),
    (False, "\n<think>\nhmm\n</think>\n\nYes", "\nhmm\n", "Yes"),
    (False, "Plain answer with </think> inside", None, "Plain answer with </think> inside"),
    (True, "never closed", "never closed", None),
    (False, "\n\nPlain", None, "\n\nPlain"),
])
@pytest.mark.parametrize("step", [1, 4, 100])
def test_reasoning_split_whole_and_streamed(starts_in_reasoning, text, reasoning, content, step):
    assert ReasoningParser.split(text, starts_in_reasoning) == (reasoning, content)
    parser = ReasoningParser(starts_in_reasoning)
    got_reasoning, got_content = "", ""
    for i in range(0, len(text), step):
        piece = parser.feed(text[i:i + step])
        got_reasoning, got_content = got_reasoning + piece.reasoning, got_content + piece.content
    rest = parser.finish()
    assert got_reasoning + rest.reasoning == (reasoning or "")
    assert got_content + rest.content == (content or "")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
