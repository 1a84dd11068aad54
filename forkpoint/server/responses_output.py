"""/v1/responses output: the chat formatter's assistant message (chat_format.py: reasoning_content,
content, tool_calls) as Responses output items, whole or as the stream's events, and the response
object around them.

Output items, in this order (OpenAI's and vLLM's):

    {"type": "reasoning", "id": "rs_...", "summary": [], "content": [{"type": "reasoning_text", "text"}]}
                                            when the reasoning parser found a thought (non-empty)
    {"type": "message", "id": "msg_...", "role": "assistant", "content": [{"type": "output_text", "text",
     "annotations": []}]}                   when there is text, or when there would be no item at all
    {"type": "function_call", "id": "fc_...", "call_id", "name", "arguments"}   per parsed tool call

Each item's status is "completed", but a reasoning or message item that the length limit cut
("incomplete", as the response). A stream opens an item at its first text and closes it when the
next one opens (a call goes out whole: added, its arguments in one delta, done), so the items of
the final event are those its events built, with the same ids. Trailing whitespace of the text is
held back until more text follows: a call right after it drops it, as the whole output's tool
parser strips the text around calls.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from forkpoint.server.responses_protocol import FunctionChoice, ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """The output items of a whole chat message ({"content", "reasoning_content"?, "tool_calls"?});
    incomplete: the length limit ended the output."""
    stream = OutputStream()
    stream.feed({key: message[key] for key in ("reasoning_content", "content", "tool_calls") if message.get(key)})
    stream.finish(incomplete)
    return stream.items


@dataclass
class _OpenItem:
    """The reasoning or message item being streamed: its index, id, kind and text so far."""

    index: int
    id: str
    kind: str  # "reasoning" or "message"
    text: str = ""


@dataclass
class OutputStream:
    """Output items built from a chat choice's streamed deltas (`ChatFormat.chunk_choice`'s
    `delta`): `feed` each, then `finish`; both return the events to send (without their
    `sequence_number`, which the writer numbers). `items`: the closed items, in output order."""

    items: list[dict[str, Any]] = field(default_factory=list)
    _open: _OpenItem | None = None
    _held: str = ""  # trailing whitespace of the content, not sent yet

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            text = self._held + delta["content"]
            body = text.rstrip()
            self._held = text[len(body):]
            events += self._text("message", body) if body else []
        for call in delta.get("tool_calls") or ():
            self._held = ""
            events += self._close("completed")
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Send what was held back and close the open item (an empty message when there is no item)."""
        events = self._text("message", self._held) if self._held else []
        self._held = ""
        if not self.items and self._open is None:
            events += self._open_item("message")
        return events + self._close("incomplete" if incomplete else "completed")

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != kind:
            events += self._close("completed") + self._open_item(kind)
        item = self._open
        item.text += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        event = {"type": f"response.{name}.delta", "item_id": item.id, "output_index": item.index,
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        self._open = _OpenItem(len(self.items), new_id("rs" if kind == "reasoning" else "msg"), kind)
        item = self._item(self._open, "in_progress")
        item["content"] = []
        return [{"type": "response.output_item.added", "output_index": self._open.index, "item": item},
                self._part_event("added", self._open, "")]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        done = {"type": f"response.{'reasoning_text' if item.kind == 'reasoning' else 'output_text'}.done",
                "item_id": item.id, "output_index": item.index, "content_index": 0, "text": item.text}
        if item.kind == "message":
            done["logprobs"] = []
        whole = self._item(item, status)
        self.items.append(whole)
        return [done, self._part_event("done", item, item.text),
                {"type": "response.output_item.done", "output_index": item.index, "item": whole}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call["function"]
        index, item_id = len(self.items), new_id("fc")
        item = {"id": item_id, "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": "completed"}
        self.items.append(item)
        where = {"item_id": item_id, "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **where, "delta": function["arguments"]},
                {"type": "response.function_call_arguments.done", **where, "name": function["name"],
                 "arguments": function["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _part_event(self, stage: str, item: _OpenItem, text: str) -> dict[str, Any]:
        return {"type": f"response.content_part.{stage}", "item_id": item.id, "output_index": item.index,
                "content_index": 0, "part": self._part(item.kind, text)}

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        content = [self._part(item.kind, item.text)]
        if item.kind == "reasoning":
            return {"id": item.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": item.id, "type": "message", "role": "assistant", "status": status, "content": content}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int,
          cache_miss_reason: str | None) -> dict[str, Any]:
    """The response's usage; `input_tokens_details.cache_miss_reason` is forkpoint's extension, as in chat's
    `prompt_tokens_details`: why reuse stopped where it did (None: it did not stop short)."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_miss_reason": cache_miss_reason},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def reasoning_tokens(token_ids: list[int], end_id: int | None, has_reasoning: bool) -> int:
    """Output tokens of the thought: those before the thought's end token (`</think>`, one token in
    Qwen's vocabulary), all of them when it never ends; 0 without a thought, or when the tokenizer has
    no such single token (the count is then unknown)."""
    if not has_reasoning or end_id is None:
        return 0
    return token_ids.index(end_id) if end_id in token_ids else len(token_ids)


@dataclass(frozen=True)
class ResponseEcho:
    """The response object's fields that echo the request (the openai client's `Response` needs
    them): built once per request. stored: whether the response is kept (`store` and a store on)."""

    body: ResponsesRequest
    response_id: str
    model: str
    created_at: int
    stored: bool

    def response(self, status: str, output: list[dict[str, Any]],
                 usage_: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object; status "in_progress", "completed", "incomplete" (the length limit:
        `incomplete_details.reason` "max_output_tokens") or "failed" (with `error`)."""
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "store": self.stored, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": usage_, "user": body.user,
        }
