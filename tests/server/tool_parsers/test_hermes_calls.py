"""Hermes' JSON tool calls (Qwen3-Next, Granite-4.0-H, Falcon-H1): `<tool_call>{"name", "arguments"}</tool_call>`,
whole and streamed in every cutting, read alone and beside the other formats."""

from __future__ import annotations

import json

import pytest

from forkpoint.server.tool_parsers import ToolCallParser
from tests.server.tool_parsers.streamed import assert_streams_as_whole, named

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}, {"name": "noop"}]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
NOOP = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
BOTH = [("hermes",), ("qwen3_xml", "hermes", "nemotron_json")]


@pytest.mark.parametrize("formats", BOTH)
def test_calls_and_the_text_around_them(formats):
    parser = ToolCallParser(TOOLS, formats)
    content, calls = parser.parse("I'll look it up.\n\n" + WEATHER + "\n" + NOOP + "\nDone.")
    assert content == "I'll look it up.\n\n\n\nDone."
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]
    assert calls[0].id != calls[1].id
    assert parser.parse(WEATHER)[0] is None  # nothing but the call: no content


@pytest.mark.parametrize("body, expected", [
    ('{"name": "noop"}', [("noop", {})]),  # no arguments
    ('{"arguments": {"city": "Oslo"}, "name": "get_weather"}', [("get_weather", {"city": "Oslo"})]),  # any order
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', [("get_weather", {"city": "Oslo"})]),
    ('{"name": "get_weather", "parameters": {"days": 2}}', [("get_weather", {"days": 2})]),
    ('[{"name": "noop", "arguments": {}}, {"name": "get_weather", "arguments": {"days": 1}}]',  # Falcon-H1-Tiny
     [("noop", {}), ("get_weather", {"days": 1})]),
    ('{"name": "noop", "arguments": {}}\n{"name": "noop", "arguments": {"x": [1, null]}}',  # one per line
     [("noop", {}), ("noop", {"x": [1, None]})]),
    ("{'arguments': {'city': 'Oslo', 'metric': True}, 'name': 'get_weather'}",  # Falcon-H1's template's quotes
     [("get_weather", {"city": "Oslo", "metric": True})]),
    ('{"name": "get_weather", "arguments": {"city": "</tool"}}', [("get_weather", {"city": "</tool"})]),
    ('{"name": "get_weather", "arguments": {"city": "Zürich ☀"}}', [("get_weather", {"city": "Zürich ☀"})]),
])
def test_bodies_that_are_calls(body, expected):
    text = f"<tool_call>\n{body}\n</tool_call>"
    content, calls = ToolCallParser(TOOLS, ("hermes",)).parse(text)
    assert content is None and named(calls) == expected
    assert all(json.loads(call.arguments) == args for call, (_, args) in zip(calls, expected))


@pytest.mark.parametrize("body", [
    '{"name": "unknown", "arguments": {}}',  # no tool of the request
    '[{"name": "noop", "arguments": {}}, {"name": "unknown", "arguments": {}}]',  # one item is not a call
    '{"name": "get_weather", "arguments": {"city": "Paris"',  # cut short
    '{"name": "get_weather", "arguments": "not json"}',
    '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments not an object
    '{"name": "get_weather", "arguments": "[1]"}',
    '{"name": 7}', '"get_weather"', "[1, 2]", "", "   ", "get_weather(city='Paris')",
    "{'name': 'noop', 'arguments': {1, 2}}",  # a Python set: no JSON for it
    '{"name": "noop"} trailing words',
])
def test_blocks_that_are_not_calls_stay_content(body):
    text = f"Before <tool_call>\n{body}\n</tool_call> after"
    for formats in BOTH:
        content, calls = ToolCallParser(TOOLS, formats).parse(text + NOOP)  # the next block is still read
        assert content == text and named(calls) == [("noop", {})]


def test_an_unfinished_block_is_content():
    text = 'Let me check <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    content, calls = ToolCallParser(TOOLS).parse(NOOP + text)
    assert content == text and named(calls) == [("noop", {})]


@pytest.mark.parametrize("formats", BOTH)
def test_streaming_reads_as_whole_in_every_cutting(formats):
    parser = ToolCallParser(TOOLS, formats)
    content, calls = assert_streams_as_whole(parser, "Sure <tool the weather:\n" + WEATHER + NOOP + "\nbye <")
    assert content == "Sure <tool the weather:\n\nbye <" and [name for name, _ in calls] == ["get_weather", "noop"]
    unknown = '<tool_call>{"name": "unknown"}</tool_call>ok'
    content, calls = assert_streams_as_whole(parser, unknown + NOOP + '<tool_call>{"na')
    assert content == unknown + '<tool_call>{"na' and calls == [("noop", {})]


def test_read_alone_the_other_formats_stay_content():
    xml = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    nemotron = '<TOOLCALL>[{"name": "noop", "arguments": {}}]</TOOLCALL>'
    text = xml + WEATHER + nemotron
    content, calls = ToolCallParser(TOOLS, ("hermes",)).parse(text)
    assert content == xml + nemotron and named(calls) == [("get_weather", {"city": "Paris", "days": 3})]
