"""POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages API, as vLLM serves it).

A message request runs as a chat request on the chat path (`OpenAIServing.chat_plan`, `start`,
`collect`, `stream_deltas`): the request becomes chat messages (messages_input.py), the chat
formatter reads the output (reasoning, tool calls), and messages_output.py shapes its message as
content blocks, whole or as the stream's events:

    message_start (the message, empty content, its usage so far: sent with the first output, so the
                   input side already counts the tokens read from checkpoints)
    per block: content_block_start, content_block_delta ..., content_block_stop
    message_delta (stop_reason, stop_sequence, the whole usage), message_stop

each `event: <type>` / `data: {...}` with the `type` inside; an engine failure after the status line
is an `error` event in Anthropic's shape (messages_errors.py), as every error of these routes is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from forkpoint.outputs import RequestOutput
from forkpoint.server.generation import Generation
from forkpoint.server.messages_errors import anthropic_error, from_openai
from forkpoint.server.messages_input import count_request, to_chat
from forkpoint.server.messages_output import BlockStream, content_blocks, message, stop_reason, usage
from forkpoint.server.messages_protocol import CountTokensRequest, MessagesRequest
from forkpoint.server.request_params import template_kwargs
from forkpoint.server.responses import Delta
from forkpoint.server.responses_output import new_id
from forkpoint.server.serving import ChatPlan, GenerationStream, OpenAIServing, stream_deltas
from forkpoint.server.sse import encode_json
from forkpoint.server.worker import EngineFailure, RequestOutOfMemory, ServerShuttingDown


class AnthropicMessages:
    """The /v1/messages handlers over the chat path of `serving`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        received = time.monotonic()
        chat = to_chat(body)
        plan = await self.serving.chat_plan(chat, request)
        message_id = new_id("msg")
        gen = await self.serving.start("messages", "messages", message_id, chat, [plan.prompt], plan.params,
                                       request, received, stream=body.stream)
        if body.stream:
            return GenerationStream(self._stream(gen, plan, message_id), gen.close)
        try:
            collected = await self.serving.collect(gen, plan.fmt, request)
        finally:
            gen.close()
        if collected.error is not None:
            error = collected.error
            return JSONResponse(from_openai(error.status, error.body()), status_code=error.status,
                                headers=error.headers)
        if collected.failure is not None:  # the client left
            return collected.failure
        output = collected.last[0]
        completion = output.outputs[0]
        choice = plan.fmt.choice(Delta(0, completion.text, completion.token_ids, None, completion.finish_reason,
                                       output=output))
        blocks = content_blocks(choice["message"], completion.finish_reason == "length")
        return JSONResponse(message(message_id, self.serving.model_name, blocks.blocks,
                                    self._stop(output, blocks, plan), usage(output)))

    async def count_tokens(self, body: CountTokensRequest) -> JSONResponse:
        """The prompt's token count as the message request would render it (`/tokenize`'s way: the ids the
        engine sees, markers removed)."""
        self.serving.check_model(body.model)
        chat = count_request(body)
        prompt = await self.serving.prompts.from_messages_async(
            chat.messages, template_kwargs=template_kwargs(chat, self.serving.template_sandbox), process=False)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    async def _stream(self, gen: Generation, plan: ChatPlan, message_id: str) -> AsyncIterator[str]:
        blocks = BlockStream()
        last: dict[int, RequestOutput] = {}
        started = incomplete = False
        try:
            async for delta in stream_deltas(gen, plan.fmt, last):
                if not started:
                    opening = message(message_id, self.serving.model_name, [], (None, None),
                                      {**usage(last[0]), "output_tokens": 0})
                    yield _event({"type": "message_start", "message": opening})
                    started = True
                incomplete = delta.finish_reason == "length" or incomplete
                for event in blocks.feed(plan.fmt.chunk_choice(delta)["delta"]):
                    yield _event(event)
            for event in blocks.finish(incomplete):
                yield _event(event)
            reason, sequence = self._stop(last[0], blocks, plan)
            yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": usage(last[0])})
            yield _event({"type": "message_stop"})
        except (RequestOutOfMemory, EngineFailure, ServerShuttingDown) as exc:  # the status line is sent: in-band
            # the status it would have had as an answer (serving.py's `collect`), for its error type
            status = 400 if isinstance(exc, RequestOutOfMemory) else 503 if isinstance(exc, ServerShuttingDown) else 500
            yield _event(anthropic_error(str(exc), status))
        gen.close()

    def _stop(self, output: RequestOutput, blocks: BlockStream, plan: ChatPlan) -> tuple[str, str | None]:
        return stop_reason(output.outputs[0], blocks.calls_tools, plan.params.stop, self.serving.prompts.tokenizer)


def _event(event: dict[str, Any]) -> str:
    data = encode_json(event)
    return f"event: {event['type']}\ndata: {data}\n\n"
