"""Nemotron-H v2's tool calls (Nemotron Nano 9B/12B v2): `<TOOLCALL>[{"name", "arguments"}, ...]</TOOLCALL>`,
whole and streamed in every cutting, read alone and beside the other formats."""

from __future__ import annotations

import pytest

from forkpoint.server.tool_parsers import ToolCallParser
from tests.server.tool_parsers.streamed import assert_streams_as_whole, named

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"name": "noop"}]
TWO = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop", "arguments": {}}]'
       "</TOOLCALL>")
BOTH = [("nemotron_json",), ("qwen3_xml", "hermes", "nemotron_json")]


@pytest.mark.parametrize("formats", BOTH)
def test_a_list_of_calls_and_the_text_around_it(formats):
    parser = ToolCallParser(TOOLS, formats)
    content, calls = parser.parse("<think>\n</think>\nOne moment. " + TWO + " Then more.")
    assert content == "<think>\n</think>\nOne moment.  Then more."  # (reasoning.py takes the thought out first)
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("noop", {})]
    second = '<TOOLCALL>[{"name": "noop", "arguments": {}}]</TOOLCALL>'
    assert named(parser.parse(TWO + "\n" + second)[1]) == [("get_weather", {"city": "Paris"}), ("noop", {}),
                                                           ("noop", {})]


def test_an_empty_list_is_read_as_no_call():
    assert ToolCallParser(TOOLS).parse("Nothing to call.<TOOLCALL>[]</TOOLCALL>") == ("Nothing to call.", [])


@pytest.mark.parametrize("body", [
    '[{"name": "unknown", "arguments": {}}]',
    '[{"name": "noop", "arguments": {}}, {"name": "unknown", "arguments": {}}]',
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}',  # cut short
    '[{"name": "get_weather", "arguments": 5}]', "not json", "",
])
def test_blocks_that_are_not_calls_stay_content(body):
    text = f"Before <TOOLCALL>{body}</TOOLCALL> after"
    for formats in BOTH:
        content, calls = ToolCallParser(TOOLS, formats).parse(TWO + text)  # the block before is still read
        assert content == text and len(calls) == 2


@pytest.mark.parametrize("formats", BOTH)
def test_streaming_reads_as_whole_in_every_cutting(formats):
    parser = ToolCallParser(TOOLS, formats)
    rest = ' and <TOOLCALL>[{"name": "unknown"}]</TOOLCALL> <TOOLCALL>[{"na'
    content, calls = assert_streams_as_whole(parser, "<TOOL is not a tag; " + TWO + rest)
    assert content == "<TOOL is not a tag; " + rest and calls == [("get_weather", {"city": "Paris"}), ("noop", {})]


def test_read_alone_the_tool_call_tags_stay_content():
    hermes = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    content, calls = ToolCallParser(TOOLS, ("nemotron_json",)).parse(hermes + TWO)
    assert content == hermes and named(calls) == [("get_weather", {"city": "Paris"}), ("noop", {})]
