"""Which formats are read: every one by default, the one vLLM's --tool-call-parser names otherwise; and the
same choice through the chat formatter that /v1/chat/completions, /v1/responses and /v1/messages share."""

from __future__ import annotations

import json

import pytest

from forkpoint.server.chat_args import TOOL_CALL_PARSERS, tool_call_formats
from forkpoint.server.chat_format import ChatFormat, ChatOptions
from forkpoint.server.messages_output import content_blocks
from forkpoint.server.responses import Delta
from forkpoint.server.responses_output import output_items
from forkpoint.server.tool_parsers import ALL_FORMATS, BlockFormat, ToolCallParser, ToolCallStream
from tests.server.tool_parsers.streamed import assert_streams_as_whole, named

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                               "days": {"type": "integer"}}}}
XML = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NEMOTRON = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>'
MIXED = f"First {XML} then {HERMES} and {NEMOTRON}."


def test_every_format_is_read_by_default_each_alone_when_named():
    assert named(ToolCallParser([TOOL]).parse(MIXED)[1]) == [
        ("get_weather", {"days": 2}), ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert_streams_as_whole(ToolCallParser([TOOL]), MIXED)
    for fmt, kept in (("qwen3_xml", {"days": 2}), ("hermes", {"city": "Paris"}), ("nemotron_json", {"city": "Oslo"})):
        content, calls = ToolCallParser([TOOL], (fmt,)).parse(MIXED)
        assert named(calls) == [("get_weather", kept)]
        assert sum(block in content for block in (XML, HERMES, NEMOTRON)) == 2  # the others stay text


def test_vllm_parser_names_map_to_the_formats_they_read():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "qwen3_coder", "qwen3_xml", "nemotron_json"}
    assert tool_call_formats(None) == ALL_FORMATS == ("qwen3_xml", "hermes", "nemotron_json")
    assert [tool_call_formats(name) for name in ("qwen3_coder", "qwen3_xml", "hermes", "nemotron_json")] == [
        ("qwen3_xml",), ("qwen3_xml",), ("hermes",), ("nemotron_json",)]


@pytest.mark.parametrize("formats", [("granite",), ("hermes", "llama3_json"), ()])
def test_an_unknown_or_empty_format_list_is_an_error_naming_the_known_ones(formats):
    with pytest.raises(ValueError, match="name one or more of qwen3_xml, hermes, nemotron_json"):
        ToolCallParser([TOOL], formats)


def test_formats_sharing_a_start_tag_must_share_its_end_tag():
    def read(body, schemas):
        return None

    with pytest.raises(ValueError, match="close differently"):
        ToolCallStream([BlockFormat("a", "<tool_call>", "</tool_call>", read),
                        BlockFormat("b", "<tool_call>", "<end>", read)], {})


def chat(tool_formats: tuple[str, ...] = ALL_FORMATS, parallel: bool = True) -> ChatFormat:
    return ChatFormat(None, None, ChatOptions(tool_mode="auto", tools=(TOOL,), parallel=parallel,
                                              tool_formats=tool_formats))


def streamed(fmt: ChatFormat, text: str, step: int = 5) -> tuple[str, list[dict], str | None]:
    """(content, tool_calls, last finish_reason) of `text` streamed through `fmt` in pieces of `step`."""
    content, calls, reason = "", [], None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        choice = fmt.chunk_choice(Delta(0, piece, [], None, "stop" if i == len(pieces) - 1 else None))
        content += choice["delta"].get("content", "")
        calls += choice["delta"].get("tool_calls", [])
        reason = choice["finish_reason"]
    return content, calls, reason


@pytest.mark.parametrize("text, arguments", [("Checking.\n" + HERMES, {"city": "Paris"}),
                                             ("Checking.\n" + NEMOTRON, {"city": "Oslo"})])
def test_chat_choices_read_hermes_and_nemotron_calls_whole_and_streamed(text, arguments):
    choice = chat().choice(Delta(0, text, [], None, "stop"))
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == arguments
    content, calls, reason = streamed(chat(), text)
    assert content == "Checking.\n" and reason == "tool_calls"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", arguments)]


def test_chat_choices_read_only_the_formats_given():
    message = chat(("qwen3_xml",)).choice(Delta(0, MIXED, [], None, "stop"))["message"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"days": 2}]
    assert HERMES in message["content"] and NEMOTRON in message["content"]
    content, calls, reason = streamed(chat(("hermes",)), HERMES + NEMOTRON)
    assert content == NEMOTRON and len(calls) == 1 and reason == "tool_calls"
    one = chat(parallel=False).choice(Delta(0, MIXED, [], None, "stop"))["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in one] == [{"days": 2}]


def test_responses_and_messages_get_the_same_calls():
    message = chat().choice(Delta(0, "Let me look.\n" + HERMES, [], None, "stop"))["message"]
    items = output_items(message, incomplete=False)
    assert [item["type"] for item in items] == ["message", "function_call"]
    assert (items[1]["name"], json.loads(items[1]["arguments"])) == ("get_weather", {"city": "Paris"})
    blocks = content_blocks(message, incomplete=False)
    assert blocks.calls_tools and blocks.blocks[1]["input"] == {"city": "Paris"}
