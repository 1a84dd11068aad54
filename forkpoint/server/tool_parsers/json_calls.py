"""Tool calls written as JSON inside a block: Hermes' `<tool_call>` (Qwen3-Next, Granite-4.0-H, Falcon-H1)
and Nemotron-H v2's `<TOOLCALL>`. The text between the tags is one or more JSON values, separated by
whitespace, each a call or a list of calls:

    {"name": "get_weather", "arguments": {"city": "Paris"}}            Hermes, one call per block
    [{"name": "get_weather", "arguments": {...}}, {"name": ...}]        Nemotron; Falcon-H1-Tiny's template
    {"name": ...}\\n{"name": ...}                                        several calls, one per line

A call is an object with a `name` among the request's tools and `arguments` (vLLM's parsers read the
same key; `parameters` is taken too), which is an object, or a string holding a JSON object (Granite 4
tends to write it so), or absent (no arguments). Values are JSON already: nothing is converted. A body
that is no JSON is read as a Python literal, for Falcon-H1's template shows the call as
`{'arguments': <args-dict>, 'name': <function-name>}`. A block with one item that is not such a call is
not read at all (None): it stays in the content whole.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from forkpoint.server.tool_parsers.calls import Schemas, ToolCall

_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def read_json_block(body: str, schemas: Schemas) -> list[ToolCall] | None:
    """The calls in one block's body ([] for an empty list), or None when it is not a block of calls."""
    values = _json_values(body)
    if values is None:
        values = _python_literal(body)
    if values is None:
        return None
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    calls = [_call(item, schemas) for item in items]
    return None if any(call is None for call in calls) else calls


def _json_values(body: str) -> list[Any] | None:
    """The whitespace-separated JSON values of `body`, or None when it is anything else (or empty)."""
    values, at = [], _SPACE.match(body).end()
    while at < len(body):
        try:
            value, at = _DECODER.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        values.append(value)
        at = _SPACE.match(body, at).end()
    return values or None


def _python_literal(body: str) -> list[Any] | None:
    """`body` as one Python literal (single-quoted strings, True/None), or None when it is none."""
    text = body.strip()
    if not text.startswith(("{", "[")):
        return None
    try:
        return [ast.literal_eval(text)]
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _call(item: Any, schemas: Schemas) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in schemas:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError):  # a Python literal that JSON cannot hold (a set, bytes)
        return None
