"""The parser a chat request's output is read with: the request's tools and the formats read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from forkpoint.server.tool_parsers.calls import ToolCall, schemas_of
from forkpoint.server.tool_parsers.formats import ALL_FORMATS, formats_named
from forkpoint.server.tool_parsers.stream import ToolCallStream


class ToolCallParser:
    """tools: the request's function definitions ({"name", "parameters", ...}) by which calls are checked
    (and XML values typed); formats: the names of the formats read (formats.FORMATS; default: all)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], formats: tuple[str, ...] = ALL_FORMATS) -> None:
        self._formats = formats_named(formats)
        self._schemas = schemas_of(tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a complete output. The content is the text outside the parsed
        calls, stripped."""
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        content = (first.content + last.content).strip()
        return content or None, first.calls + last.calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self._formats, self._schemas)
