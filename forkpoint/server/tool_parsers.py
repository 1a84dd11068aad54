"""Reading tool calls out of generated text: Qwen3.5's XML format (the chat template's, see
forkpoint/inputs/qwen_template.py), whole or streamed.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by the tool's JSON schema for that parameter
(integer, number, boolean, object/array/null as JSON, string as written; without a schema, JSON
when it parses, else the text). The call's `arguments` is the JSON object of those values. A
block that does not parse, or names no given tool, stays in the content as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from forkpoint.server.reasoning import held_back

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object text, as OpenAI's API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """New output of a stream: content text and the calls completed by this piece."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class Qwen3XMLToolParser:
    """tools: the request's function definitions ({"name", "parameters", ...}) by which calls are
    checked and their values typed."""

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._schemas = {t["name"]: (t.get("parameters") or {}) for t in tools}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a complete output. The content is the text outside the
        parsed calls, stripped."""
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        content = (first.content + last.content).strip()
        return content or None, first.calls + last.calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse_block(self, body: str) -> ToolCall | None:
        """The call in the text between <tool_call> and </tool_call>, or None when it is not one."""
        match = _FUNCTION.match(body)
        if match is None:
            return None
        name = match.group(1).strip()
        if name not in self._schemas:
            return None
        properties = self._schemas[name].get("properties") or {}
        arguments = {key.strip(): _typed(value, properties.get(key.strip()))
                     for key, value in _PARAMETER.findall(match.group(2))}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Feed the output text piece by piece: content passes through (a tail that may start a
    `<tool_call>` is held back), each call is reported whole once its `</tool_call>` is out."""

    def __init__(self, parser: Qwen3XMLToolParser) -> None:
        self._parser = parser
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        out = ToolDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_START)
                if start < 0:
                    keep = held_back(self._buffer, CALL_START)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(CALL_START):]
                self._in_call = True
            end = self._buffer.find(CALL_END)
            if end < 0:
                return out
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END):]
            self._in_call = False
            call = self._parser.parse_block(body)
            if call is None:
                out.content += CALL_START + body + CALL_END
            else:
                out.calls.append(call)

    def finish(self) -> ToolDelta:
        """The held-back rest: an unfinished call block comes back as content text."""
        rest = (CALL_START if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return ToolDelta(content=rest)


def _typed(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for (the text itself when it does not fit)."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return text
    try:
        if kind == "integer":
            return int(text.strip())
        if kind == "number":
            value = float(text.strip())
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        return json.loads(text)
    except ValueError:
        return text
