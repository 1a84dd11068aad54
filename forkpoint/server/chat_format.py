"""/v1/chat/completions choices: the assistant message with `content`, `reasoning_content`
(reasoning.py) and `tool_calls` (tool_parsers/), whole or streamed. /v1/responses and /v1/messages shape
their output from these choices, so they read tool calls the same way.

How the output text is read, by the request's options:

    thinking (the prompt opened <think>, or the output opens one)   -> reasoning_content, then:
    tool_choice "auto" with tools      -> content, with the tool-call blocks taken out as tool_calls (in
                                          every format tool_parsers/ reads, or those of `tool_formats`)
    tool_choice "required"             -> the constrained JSON list of {"name", "parameters"} as tool_calls
    tool_choice {"function": {name}}   -> the constrained JSON arguments as one call to that function
    no tools, or tool_choice "none"    -> content

A streamed choice keeps one parser state per choice; tool calls go out whole, each in one chunk,
when their block (or, for "required" and named calls, the whole output) is complete. JSON that
does not parse (cut by max_tokens) comes back as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from forkpoint.server.protocol import ChatCompletionRequest, NamedToolChoice
from forkpoint.server.reasoning import ReasoningParser
from forkpoint.server.responses import Delta, ResponseFormatter
from forkpoint.server.tool_parsers import ALL_FORMATS, ToolCall, ToolCallParser, ToolCallStream


@dataclass(frozen=True)
class ChatOptions:
    """tool_mode: "none", "auto", "required" or "named"; function: the named function;
    thinking: the output starts inside a thought; parallel: more than one call is kept;
    tool_formats: the formats "auto" reads calls in (tool_parsers.FORMATS' names; vLLM's
    --tool-call-parser names one, see chat_args.tool_call_formats)."""

    tool_mode: str = "none"
    function: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    thinking: bool = False
    parallel: bool = True
    prompt_logprobs: int | None = None
    tool_formats: tuple[str, ...] = ALL_FORMATS

    @classmethod
    def of(cls, body: ChatCompletionRequest, *, thinking: bool,
           tool_formats: tuple[str, ...] = ALL_FORMATS) -> ChatOptions:
        choice = body.tool_choice
        tools = tuple(t.function.model_dump(exclude_none=True) for t in body.tools or ())
        if not tools or choice == "none":
            mode, function = "none", None
        elif isinstance(choice, NamedToolChoice):
            mode, function = "named", choice.function.name
        else:
            mode, function = choice or "auto", None
        return cls(mode, function, tools, thinking, body.parallel_tool_calls, body.prompt_logprobs, tool_formats)


@dataclass
class _ChoiceState:
    reasoning: ReasoningParser
    tools: ToolCallStream | None
    text: str = ""  # "required"/named: the constrained JSON so far
    num_calls: int = 0
    calls: list[ToolCall] = field(default_factory=list)


class ChatFormat(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top_logprobs: int | None,
                 options: ChatOptions | None = None) -> None:
        super().__init__(tokenizer, top_logprobs)
        self.options = options or ChatOptions()
        self._parser = ToolCallParser(self.options.tools, self.options.tool_formats)
        self._states: dict[int, _ChoiceState] = {}

    def choice(self, delta: Delta) -> dict[str, Any]:
        reasoning, content = ReasoningParser.split(delta.text, self.options.thinking)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        mode = self.options.tool_mode
        if mode == "auto" and content is not None:
            message["content"], calls = self._parser.parse(content)
        elif mode in ("required", "named"):
            calls = self._forced_calls(content or "")
            if calls:
                message["content"] = None
        calls = calls if self.options.parallel else calls[:1]
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        elif message["content"] is None and reasoning is None:
            message["content"] = ""  # a plain answer is a string, even an empty one
        return {"index": delta.index, "message": message, "logprobs": self._logprobs(delta),
                "finish_reason": self._finish_reason(delta.finish_reason, bool(calls))}

    def chunk_choice(self, delta: Delta) -> dict[str, Any]:
        state = self._states.get(delta.index)
        if state is None:
            tools = self._parser.stream() if self.options.tool_mode == "auto" else None
            state = self._states[delta.index] = _ChoiceState(ReasoningParser(self.options.thinking), tools)
        piece = state.reasoning.feed(delta.text)
        reasoning, content = piece.reasoning, piece.content
        if delta.finish_reason is not None:
            rest = state.reasoning.finish()
            reasoning, content = reasoning + rest.reasoning, content + rest.content
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        new_calls: list[ToolCall] = []
        if state.tools is not None:
            parsed = state.tools.feed(content)
            content, new_calls = parsed.content, parsed.calls
            if delta.finish_reason is not None:
                content += state.tools.finish().content
        elif self.options.tool_mode in ("required", "named"):
            state.text += content
            content = ""
            if delta.finish_reason is not None:
                new_calls = self._forced_calls(state.text)
                content = "" if new_calls else state.text
        if not self.options.parallel:
            new_calls = new_calls[: max(0, 1 - len(state.calls))]
        if content and not (state.calls and not content.strip()):
            out["content"] = content
        if new_calls:
            out["tool_calls"] = [{"index": len(state.calls) + i, **c.as_dict()} for i, c in enumerate(new_calls)]
            state.calls.extend(new_calls)
        return {"index": delta.index, "delta": out, "logprobs": self._logprobs(delta),
                "finish_reason": self._finish_reason(delta.finish_reason, bool(state.calls))}

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(num_choices)]

    def _finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required), "stop" for a named call."""
        if reason == "stop" and has_calls and self.options.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _forced_calls(self, text: str) -> list[ToolCall]:
        """The calls in the constrained JSON of tool_choice "required" or a named function."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.options.tool_mode == "named":
            return [ToolCall(self.options.function, json.dumps(value, ensure_ascii=False))] if isinstance(
                value, dict) else []
        if not isinstance(value, list):
            return []
        return [ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
                for item in value if isinstance(item, dict) and isinstance(item.get("name"), str)]

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        text = self.token_text

        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            piece = text(token_id)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        content = []
        for token_id, lps in zip(delta.token_ids, delta.logprobs):
            item = entry(token_id, lps.get(token_id))
            item["top_logprobs"] = [entry(t, lp) for t, lp in self.top(lps)]
            content.append(item)
        return {"content": content}
