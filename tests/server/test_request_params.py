"""`server/request_params.py`: which request field a structured-output constraint came from (named by the
400 when the constraint does not compile)."""

from __future__ import annotations

import pytest

from forkpoint.server.protocol import ChatCompletionRequest, CompletionRequest
from forkpoint.server.request_params import constraint_param, forces_tool_call, structured_outputs

MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
])
def test_a_chat_constraint_names_its_field(fields, expected):
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    assert constraint_param(body) == expected
    assert forces_tool_call(body) == (expected == "tool_choice")
    assert (structured_outputs(body) is not None) == (expected not in (None, "tool_choice"))


def test_a_completion_constraint_names_its_field():
    assert constraint_param(CompletionRequest(prompt="x", guided_regex="[0-9]+")) == "guided_regex"
    assert constraint_param(CompletionRequest(prompt="x")) is None
