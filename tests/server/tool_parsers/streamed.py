"""Streaming a text through a tool-call parser in every cutting: the check the format tests share."""

from __future__ import annotations

import json

from forkpoint.server.tool_parsers import ToolCallParser


def named(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def assert_streams_as_whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    """Cut in two at every character boundary, and fed one character at a time, the text reads as it does
    whole: the same content and calls, and no content that a later piece contradicts (a start tag, or a
    tail that may become one, never goes out as content before its block is read). Returns the whole
    reading: (content, named calls)."""
    whole = parser.stream()
    raw = whole.feed(text).content + whole.finish().content
    content_whole, calls_whole = parser.parse(text)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        stream, content, calls = parser.stream(), "", []
        for piece in pieces:
            delta = stream.feed(piece)
            content, calls = content + delta.content, calls + delta.calls
            assert raw.startswith(content), (pieces, content)
        content += stream.finish().content
        assert content == raw and (content.strip() or None) == content_whole, pieces
        assert named(calls) == named(calls_whole), pieces
    return content_whole, named(calls_whole)
