"""Qwen3.5's XML tool calls (the embedded template's, forkpoint/inputs/qwen_template.py; also Qwen3-Coder's
and Nemotron-3-Nano's): the text between `<tool_call>` and `</tool_call>` is

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

Parameter values are text; each is converted by the tool's JSON schema for that parameter (integer,
number, boolean, object/array/null as JSON, string as written; without a schema, JSON when it parses,
else the text). The call's `arguments` is the JSON object of those values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from forkpoint.server.tool_parsers.calls import Schemas, ToolCall

_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def read_xml_block(body: str, schemas: Schemas) -> list[ToolCall] | None:
    """The call in one block's body, or None when the body is not one (not this format, or no given tool)."""
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    if name not in schemas:
        return None
    properties = schemas[name].get("properties") or {}
    arguments = {key.strip(): _typed(value, properties.get(key.strip()))
                 for key, value in _PARAMETER.findall(match.group(2))}
    return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


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
