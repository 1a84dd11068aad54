"""A /v1/messages request as the chat request it runs as: its system prompt and messages as chat
messages, its fields as the chat fields that do the same (so the chat path's template, turn
checkpoints, token cache, parsers, structured outputs and limits apply unchanged).

    system (string or text blocks)     -> a system message, first (blocks as text parts)
    user text / image blocks           -> a user message of text / image_url parts (a data URL)
    user tool_result blocks            -> tool messages with tool_call_id (in block order: a run of
                                          text blocks between them is one user message)
    assistant text blocks              -> the assistant message's text parts
    assistant tool_use blocks          -> its tool_calls ({"id", "function": {"name", "arguments":
                                          the input as JSON}})
    thinking / redacted_thinking       -> dropped (the template drops earlier thoughts anyway)
    tools, tool_choice                 -> chat tools ({"function": {"name", "description",
                                          "parameters": input_schema}}); auto / any / tool / none ->
                                          auto / required / named / none; disable_parallel_tool_use ->
                                          parallel_tool_calls false
    thinking enabled, adaptive / disabled -> chat_template_kwargs {"enable_thinking": true / false}
    max_tokens, stop_sequences         -> max_completion_tokens, stop
    metadata.user_id                   -> user

Cache breakpoints (`cache_control`) land where the chat path places them (prompts.py): a text or
image block's on its part (at the part's exact end), a system block's on its part of the system
message, a tool_use's on its assistant message and a tool_result's on its tool message (at the
message's end), a tool's on the system message's end (the templates render the tools in the
system turn; without a system prompt it places nothing), the top-level one (Anthropic's automatic
caching) on the last block of the last message (a string content as one text part). At most
MAX_BREAKPOINTS in all, counted as Anthropic counts them (one per `cache_control`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from forkpoint.server.errors import invalid_request
from forkpoint.server.messages_protocol import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from forkpoint.server.prompts import MAX_BREAKPOINTS
from forkpoint.server.protocol import CacheControl, ChatCompletionRequest

CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# the chat fields a refusal names, as the message request's fields they came from
FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata",
               "chat_template_kwargs": "thinking"}


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a message request runs as; a 400 naming the field when the chat request
    refuses what it became."""
    fields = prompt_fields(body)
    fields.update({"max_completion_tokens": body.max_tokens, "stop": body.stop_sequences,
                   "temperature": body.temperature, "top_p": body.top_p, "cache_salt": body.cache_salt,
                   "user": body.metadata.user_id if body.metadata is not None else None})
    if body.top_k is not None:
        fields["top_k"] = body.top_k
    return _validated(fields)


def count_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request whose prompt a count_tokens body stands for (rendered as `to_chat`'s)."""
    return _validated(prompt_fields(body))


def prompt_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat fields that make the prompt: model, messages, tools, tool choice, thinking switch. A 400
    for more than MAX_BREAKPOINTS cache_control breakpoints."""
    count = breakpoint_count(body)
    if count > MAX_BREAKPOINTS:
        raise invalid_request(f"the request carries {count} blocks with cache_control; at most {MAX_BREAKPOINTS} "
                              "are allowed per request (Anthropic's limit): remove some", param="messages")
    system = system_messages(body.system, tools_cached=any(t.cache_control is not None for t in body.tools or ()))
    conversation = chat_messages(body.messages)
    if body.cache_control is not None:
        _cache_last_block(conversation[-1], body.cache_control)
    fields: dict[str, Any] = {"model": body.model, "messages": system + conversation}
    if body.tools is not None:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                 else CHOICES[choice.type])
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return fields


def breakpoint_count(body: CountTokensRequest) -> int:
    """cache_control fields of the request: system blocks, tools, message blocks (tool results' text too)."""
    blocks: list[Any] = [*(body.system if isinstance(body.system, list) else ()), *(body.tools or ())]
    for message in body.messages:
        for block in message.content if isinstance(message.content, list) else ():
            blocks.append(block)
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                blocks.extend(block.content)
    return sum(getattr(block, "cache_control", None) is not None for block in blocks) + (body.cache_control is not None)


def system_messages(system: str | list[TextBlock] | None, tools_cached: bool) -> list[dict[str, Any]]:
    """The system message (none without a system prompt); `tools_cached`: a tool carries cache_control,
    placed at the system message's end."""
    if system is None:
        return []
    message: dict[str, Any] = {"role": "system", "content": system if isinstance(system, str) else _parts(system)}
    if tools_cached:
        message["cache_control"] = {"type": "ephemeral"}
    return [message]


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat messages (plain JSON, as a client sends them to /v1/chat/completions) of Anthropic messages."""
    result: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message.content, str):
            result.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            result.append(_assistant(message.content))
        else:
            result.extend(_user(message.content))
    return result


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    parts = _parts([b for b in blocks if isinstance(b, TextBlock)])
    calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input, ensure_ascii=False)}} for call in calls]
    cached = next((call.cache_control for call in calls if call.cache_control is not None), None)
    return _with_cache_control(message, cached)


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages in block order: tool results as tool messages, each run of
    text and image blocks as one user message."""
    result: list[dict[str, Any]] = []
    run: list[Any] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if run:
                result.append({"role": "user", "content": _parts(run)})
                run = []
            content = block.content if isinstance(block.content, str) else _parts(block.content)
            result.append(_with_cache_control({"role": "tool", "tool_call_id": block.tool_use_id, "content": content},
                                              block.cache_control))
        else:
            run.append(block)
    if run or not result:
        result.append({"role": "user", "content": _parts(run)})
    return result


def _parts(blocks: list[TextBlock | ImageBlock]) -> list[dict[str, Any]]:
    parts = []
    for block in blocks:
        part = ({"type": "text", "text": block.text} if isinstance(block, TextBlock)
                else {"type": "image_url", "image_url": {"url": block.url}})
        parts.append(_with_cache_control(part, block.cache_control))
    return parts


def _cache_last_block(message: dict[str, Any], cache_control: CacheControl) -> None:
    """The breakpoint of the request's top-level cache_control, on the last block of `message` (the last
    chat message): its last part, a string content made one text part (the same rendering), else the
    message itself (an assistant message of calls only)."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = content = [{"type": "text", "text": content}]
    _with_cache_control(content[-1] if content else message, cache_control)


def _with_cache_control(value: dict[str, Any], cache_control: CacheControl | None) -> dict[str, Any]:
    if cache_control is not None:
        value["cache_control"] = cache_control.model_dump(exclude_none=True)
    return value


def _validated(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = FIELD_NAMES.get(loc[0], loc[0]) if loc else None
        where = ".".join([param, *loc[1:]]) if loc else "request"
        raise invalid_request(f"{where}: {first['msg'].removeprefix('Value error, ')}", param=param) from None
