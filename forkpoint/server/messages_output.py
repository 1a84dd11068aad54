"""/v1/messages output: the chat formatter's assistant message as Anthropic content blocks, whole or
as the stream's events, with its stop reason and usage.

The blocks are read off the Responses API's output items (responses_output.py), which already order
and stream a chat message's thought, text and tool calls (trailing whitespace held back before a
call, a call sent whole once complete):

    reasoning item      -> {"type": "thinking", "thinking", "signature": ""}
    message item        -> {"type": "text", "text"}          (none for an empty text)
    function_call item  -> {"type": "tool_use", "id": "toolu_...", "name", "input": {...}}

and their stream events become Anthropic's: content_block_start at a block's first text (so an empty
text makes no block), content_block_delta (text_delta, thinking_delta; a tool_use's whole input as one
input_json_delta), content_block_stop. Block indices count from 0 in start order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from forkpoint.outputs import CompletionOutput, RequestOutput
from forkpoint.server.responses_output import OutputStream

_DELTAS = {"response.output_text.delta": "text", "response.reasoning_text.delta": "thinking"}


def tool_use_id(item_id: str) -> str:
    """The tool_use block id of a function_call item id ("fc_<hex>" -> "toolu_<hex>"): stable per item,
    so a stream's start event and its final block agree."""
    return "toolu_" + item_id.removeprefix("fc_")


def content_block(item: dict[str, Any]) -> dict[str, Any] | None:
    """The content block of one output item, None for a message item without text."""
    if item["type"] == "reasoning":
        return {"type": "thinking", "thinking": item["content"][0]["text"], "signature": ""}
    if item["type"] == "message":
        text = item["content"][0]["text"]
        return {"type": "text", "text": text} if text else None
    return {"type": "tool_use", "id": tool_use_id(item["id"]), "name": item["name"],
            "input": json.loads(item["arguments"])}


@dataclass
class BlockStream:
    """Content blocks built from a chat choice's streamed deltas (`ChatFormat.chunk_choice`'s `delta`):
    `feed` each, then `finish`; both return the stream events to send. `blocks`: the finished message's
    content. A whole message is fed once (`content_blocks`)."""

    items: OutputStream = field(default_factory=OutputStream)
    _started: int = 0  # blocks started so far (the next block's index)
    _open: int | None = None  # the index of the open text or thinking block
    _pending: bool = False  # a text or thinking item was added, its block not started yet (no text yet)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        return self._events(self.items.feed(delta))

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """incomplete: the length limit ended the output."""
        return self._events(self.items.finish(incomplete))

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return [block for item in self.items.items if (block := content_block(item)) is not None]

    @property
    def calls_tools(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items.items)

    def _events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            kind = event["type"]
            if kind == "response.output_item.added" and event["item"]["type"] != "function_call":
                self._pending = True
            elif kind in _DELTAS:
                block = _DELTAS[kind]
                if self._pending:
                    self._open, self._pending = self._start(), False
                    start = {"type": "text", "text": ""} if block == "text" else {
                        "type": "thinking", "thinking": "", "signature": ""}
                    out.append({"type": "content_block_start", "index": self._open, "content_block": start})
                out.append({"type": "content_block_delta", "index": self._open,
                            "delta": {"type": f"{block}_delta", block: event["delta"]}})
            elif kind == "response.output_item.done" and event["item"]["type"] == "function_call":
                item, index = event["item"], self._start()
                start = {**content_block(item), "input": {}}
                out += [{"type": "content_block_start", "index": index, "content_block": start},
                        {"type": "content_block_delta", "index": index,
                         "delta": {"type": "input_json_delta", "partial_json": item["arguments"]}},
                        {"type": "content_block_stop", "index": index}]
            elif kind == "response.output_item.done":
                if self._open is not None:
                    out.append({"type": "content_block_stop", "index": self._open})
                self._open, self._pending = None, False
        return out

    def _start(self) -> int:
        index, self._started = self._started, self._started + 1
        return index


def content_blocks(message: dict[str, Any], incomplete: bool) -> BlockStream:
    """The blocks of a whole chat message ({"content", "reasoning_content"?, "tool_calls"?})."""
    stream = BlockStream()
    stream.feed({key: message[key] for key in ("reasoning_content", "content", "tool_calls") if message.get(key)})
    stream.finish(incomplete)
    return stream


def stop_reason(completion: CompletionOutput, calls_tools: bool, stops: Sequence[str],
                tokenizer: PreTrainedTokenizerBase) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion: max_tokens (the length limit), tool_use
    (the output holds a call), stop_sequence (with the stop string the engine cut the text at), else
    end_turn (an end-of-sequence token)."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if calls_tools:
        return "tool_use", None
    if stops:
        # the engine cuts the text where the stop string begins: it starts there in the whole decoded output
        full = tokenizer.decode(completion.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        matched = next((stop for stop in stops if full.startswith(stop, len(completion.text))), None)
        if matched is not None:
            return "stop_sequence", matched
    return "end_turn", None


def usage(output: RequestOutput) -> dict[str, int | str | None]:
    """Anthropic's usage of a prompt's output: `input_tokens` the prompt tokens not read from a
    checkpoint, `cache_read_input_tokens` those read (the chat path's cached_tokens), so the two add up to
    the prompt; `cache_creation_input_tokens` 0, since the engine output does not say which checkpoints
    a request wrote (a full pool may decline one); `cache_miss_reason`, forkpoint's extension as in
    chat's usage: why reuse stopped where it did (None: it did not stop short)."""
    cached = output.num_cached_tokens
    return {"input_tokens": len(output.prompt_token_ids) - cached, "output_tokens": len(output.outputs[0].token_ids),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "cache_miss_reason": output.cache_miss_reason}


def message(message_id: str, model: str, blocks: list[dict[str, Any]], stop: tuple[str | None, str | None],
            usage_: dict[str, int]) -> dict[str, Any]:
    """The message object; `stop` (None, None) while it streams."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}
