"""Finding tool-call blocks in output text as it streams: content passes through, each block goes to the
readers of the formats that open with its start tag.

    text:    Let me check.\\n<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>
             '-- content ---''-- start --''---------- body -----------''--- end ---'

A tail that may still become a start tag (`<`, `<tool_c`, `<TOOL`) is held back until the next piece
tells; a block is read once its end tag is out, by each reader of its start tag in turn until one reads
it. A block that no reader reads comes back as content, tags included; so does a block the output never
closes.
"""

from __future__ import annotations

from collections.abc import Sequence

from forkpoint.server.reasoning import held_back
from forkpoint.server.tool_parsers.calls import Schemas, ToolCall, ToolDelta
from forkpoint.server.tool_parsers.formats import BlockFormat


class ToolCallStream:
    """Feed the output text piece by piece, then `finish`. formats: the formats read (formats that share a
    start tag share its end tag, and are tried in this order); schemas: the request's tools."""

    def __init__(self, formats: Sequence[BlockFormat], schemas: Schemas) -> None:
        self._ends: dict[str, str] = {}
        self._formats: dict[str, list[BlockFormat]] = {}
        for fmt in formats:
            if self._ends.setdefault(fmt.start, fmt.end) != fmt.end:
                raise ValueError(f"formats opening with {fmt.start!r} close differently: "
                                 f"{self._ends[fmt.start]!r} and {fmt.end!r}")
            self._formats.setdefault(fmt.start, []).append(fmt)
        self._schemas = schemas
        self._buffer = ""
        self._open: str | None = None  # the start tag of the block being read

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        out = ToolDelta()
        while True:
            if self._open is None:
                found = self._next_start()
                if found is None:
                    keep = max((held_back(self._buffer, tag) for tag in self._ends), default=0)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                at, self._open = found
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(self._open):]
            end_tag = self._ends[self._open]
            end = self._buffer.find(end_tag)
            if end < 0:
                return out
            body, self._buffer = self._buffer[:end], self._buffer[end + len(end_tag):]
            calls = self._read(self._open, body)
            if calls is None:
                out.content += self._open + body + end_tag
            else:
                out.calls.extend(calls)
            self._open = None

    def finish(self) -> ToolDelta:
        """The held-back rest: an unfinished block comes back as content text."""
        rest = (self._open or "") + self._buffer
        self._buffer, self._open = "", None
        return ToolDelta(content=rest)

    def _next_start(self) -> tuple[int, str] | None:
        """(position, tag) of the first start tag in the buffer (the longest where two start there)."""
        found = [(at, -len(tag), tag) for tag in self._ends if (at := self._buffer.find(tag)) >= 0]
        if not found:
            return None
        at, _, tag = min(found)
        return at, tag

    def _read(self, start: str, body: str) -> list[ToolCall] | None:
        for fmt in self._formats[start]:
            calls = fmt.read(body, self._schemas)
            if calls is not None:
                return calls
        return None
