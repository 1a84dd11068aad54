"""A /v1/responses request as the chat request it runs as: its items as chat messages, its fields
as the chat fields that do the same (so the chat path's template, turn checkpoints, token cache,
parsers, structured outputs and limits apply unchanged).

    instructions                     -> a system message, first
    message (user, system, assistant) -> that message; developer -> system; text parts joined by "\\n"
    function_call                    -> an assistant message's tool_calls (calls right after an
                                        assistant message join it: one turn, as the chat API has it)
    function_call_output             -> a tool message with tool_call_id
    reasoning                        -> dropped (the template drops earlier thoughts anyway)
    tools (flat), tool_choice        -> chat tools ({"function": {...}}), tool_choice
    max_output_tokens                -> max_completion_tokens
    text.format                      -> response_format
    reasoning.effort none / minimal  -> chat_template_kwargs {"enable_thinking": false}; other
                                        efforts {"enable_thinking": true}; none given: the template's default

`previous_response_id`'s stored conversation (response_store.py) goes between the instructions and
the new input: OpenAI does not carry a previous response's instructions over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from forkpoint.server.errors import invalid_request
from forkpoint.server.protocol import ChatCompletionRequest
from forkpoint.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputItem,
    MessageItem,
    ResponsesRequest,
    TextPart,
)

THINKING_OFF_EFFORTS = frozenset({"none", "minimal"})


@dataclass(frozen=True)
class ChatConversion:
    """chat: the chat request the response runs as; conversation: its messages but the instructions
    (the stored response's `messages` start with these)."""

    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]


def items_to_messages(items: Sequence[InputItem] | str,
                      previous: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Chat messages (plain JSON, as a client sends them to /v1/chat/completions) of `previous` (a stored
    conversation, left unmodified) followed by input items, or by a string (one user message). A call
    right after an assistant message joins it whether that message came in the same input or ended
    `previous`, so a conversation renders the same whole or continued by `previous_response_id`."""
    if isinstance(items, str):
        return [*previous, {"role": "user", "content": items}]
    messages: list[dict[str, Any]] = list(previous)
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # a new dict: `previous` stays as stored
                messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # a reasoning item: dropped
    return messages


def to_chat(body: ResponsesRequest, previous: Sequence[dict[str, Any]] = ()) -> ChatConversion:
    """The chat request of `body` after `previous` (a stored conversation); a 400 naming the field
    when the chat request refuses what it became (a conversation without a message, say)."""
    conversation = items_to_messages(body.input, previous)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": system + conversation, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
        "prompt_cache_key": body.prompt_cache_key, "cache_salt": body.cache_salt,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools is not None:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True)}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.reasoning.effort not in THINKING_OFF_EFFORTS}
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        param = "input" if first["loc"][:1] == ("messages",) else (str(first["loc"][0]) if first["loc"] else None)
        raise invalid_request(f"{where}: {first['msg']}", param=param) from None
    return ChatConversion(chat, conversation)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)
