"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}.

A response runs as a chat request on the chat path (`OpenAIServing.chat_plan`, `start`, `collect`,
`stream_deltas`): the request becomes chat messages (responses_input.py), the chat formatter reads
the output (reasoning, tool calls), and responses_output.py shapes its message as output items, whole
or as the stream's events:

    response.created, response.in_progress,
    per item: response.output_item.added, response.content_part.added, response.output_text.delta ...
              (reasoning: response.reasoning_text.delta ...), response.output_text.done,
              response.content_part.done, response.output_item.done
              (a call: output_item.added, function_call_arguments.delta / .done, output_item.done),
    response.completed (or response.incomplete; response.failed after an `error` event)

each `event: <type>` / `data: {...}` with a `sequence_number` from 0.

Finished responses with `store` (the default) are kept in the `ResponseStore` under their tenant:
the API key the request presented and its cache namespace (`OpenAIServing.salt_of`: `cache_salt`,
or the `user` / key under `--cache-isolation`), the rule that keeps reuse apart. GET and DELETE take
`cache_salt` and `user` as query parameters for that rule. An id that is unknown, dropped, or another
tenant's is a 404 naming `previous_response_id` (or the path's id): indistinguishable.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from forkpoint.outputs import RequestOutput
from forkpoint.server.errors import APIError
from forkpoint.server.generation import Generation
from forkpoint.server.reasoning import THINK_END
from forkpoint.server.response_store import ResponseStore, StoredResponse
from forkpoint.server.responses import Delta
from forkpoint.server.responses_input import ChatConversion, items_to_messages, to_chat
from forkpoint.server.responses_output import (
    OutputStream,
    ResponseEcho,
    new_id,
    output_items,
    reasoning_tokens,
    usage,
)
from forkpoint.server.responses_protocol import ResponsesRequest, parse_items
from forkpoint.server.serving import ChatPlan, GenerationStream, OpenAIServing, api_client, stream_deltas
from forkpoint.server.sse import encode_json
from forkpoint.server.worker import EngineFailure, RequestOutOfMemory, ServerShuttingDown

# the chat request's fields a refusal may name, as the response request's fields they came from
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text", "chat_template_kwargs": "reasoning"}


def not_found(response_id: str, param: str) -> APIError:
    return APIError(f"no stored response with id {response_id!r} (unknown, deleted, dropped from the store, stored "
                    "with store: false, or another tenant's): send the whole conversation as input instead",
                    status=404, param=param, code="response_not_found")


class OpenAIResponses:
    """The /v1/responses handlers over the chat path of `serving`, with `store` keeping finished
    responses."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        tokenizer = serving.prompts.tokenizer
        end = tokenizer.convert_tokens_to_ids(THINK_END)
        # the thought's end as one token, for usage.output_tokens_details.reasoning_tokens (None: not counted)
        self.think_end_id = end if isinstance(end, int) and end != tokenizer.unk_token_id else None

    def tenant(self, cache_salt: str | None, user: str | None, request: Request) -> str:
        """The store's owner key of a request: its API key's client and its cache namespace."""
        return json.dumps([api_client(request), self.serving.salt_of(cache_salt, user, request)])

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        received = time.monotonic()
        self.serving.check_model(body.model)
        tenant = self.tenant(body.cache_salt, body.user, request)
        previous: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            entry = self.store.get(tenant, body.previous_response_id)
            if entry is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            previous = entry.messages
        conversion = to_chat(body, previous)
        echo = ResponseEcho(body, new_id("resp"), self.serving.model_name, int(time.time()),
                            stored=body.store and self.store.enabled)
        try:
            plan = await self.serving.chat_plan(conversion.chat, request)
            gen = await self.serving.start("responses", "input", echo.response_id, conversion.chat, [plan.prompt],
                                           plan.params, request, received, stream=body.stream)
        except APIError as err:  # it names the chat request's field: name the response request's
            err.param = RESPONSES_PARAMS.get(err.param, err.param)
            raise
        if body.stream:
            return GenerationStream(self._stream(gen, plan, echo, conversion, tenant), gen.close)
        try:
            collected = await self.serving.collect(gen, plan.fmt, request)
        finally:
            gen.close()
        if collected.failure is not None:
            return collected.failure
        output = collected.last[0]
        completion = output.outputs[0]
        choice = plan.fmt.choice(Delta(0, completion.text, completion.token_ids, None, completion.finish_reason,
                                       output=output))
        incomplete = completion.finish_reason == "length"
        items = output_items(choice["message"], incomplete)
        response = echo.response("incomplete" if incomplete else "completed", items,
                                 self._usage(output, items))
        self._keep(echo, conversion, tenant, response)
        return JSONResponse(response)

    def retrieve(self, response_id: str, cache_salt: str | None, user: str | None, request: Request) -> JSONResponse:
        entry = self.store.get(self.tenant(cache_salt, user, request), response_id)
        if entry is None:
            raise not_found(response_id, "response_id")
        return JSONResponse(entry.response)

    def delete(self, response_id: str, cache_salt: str | None, user: str | None, request: Request) -> JSONResponse:
        if not self.store.delete(self.tenant(cache_salt, user, request), response_id):
            raise not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _stream(self, gen: Generation, plan: ChatPlan, echo: ResponseEcho, conversion: ChatConversion,
                      tenant: str) -> AsyncIterator[str]:
        write = _EventWriter()
        yield write({"type": "response.created", "response": echo.response("in_progress", [], None)})
        yield write({"type": "response.in_progress", "response": echo.response("in_progress", [], None)})
        stream = OutputStream()
        last: dict[int, RequestOutput] = {}
        incomplete = False
        try:
            async for delta in stream_deltas(gen, plan.fmt, last):
                incomplete = delta.finish_reason == "length" or incomplete
                for event in stream.feed(plan.fmt.chunk_choice(delta)["delta"]):
                    yield write(event)
            for event in stream.finish(incomplete):
                yield write(event)
            response = echo.response("incomplete" if incomplete else "completed", stream.items,
                                     self._usage(last[0], stream.items))
            self._keep(echo, conversion, tenant, response)
            yield write({"type": f"response.{response['status']}", "response": response})
        except (RequestOutOfMemory, EngineFailure, ServerShuttingDown) as exc:  # the status line is sent: in-band
            code = "out_of_memory" if isinstance(exc, RequestOutOfMemory) else "server_error"
            yield write({"type": "error", "code": code, "message": str(exc), "param": None})
            error = {"code": "server_error", "message": str(exc)}
            yield write({"type": "response.failed", "response": echo.response("failed", stream.items, None, error)})
        gen.close()

    def _usage(self, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        token_ids = output.outputs[0].token_ids
        thought = any(item["type"] == "reasoning" for item in items)
        return usage(len(output.prompt_token_ids), output.num_cached_tokens, len(token_ids),
                     reasoning_tokens(token_ids, self.think_end_id, thought), output.cache_miss_reason)

    def _keep(self, echo: ResponseEcho, conversion: ChatConversion, tenant: str, response: dict[str, Any]) -> None:
        """Store a finished response: its conversation (without instructions) then its output, as chat
        messages read back the way a client's items would be."""
        if not echo.stored:
            return
        messages = conversion.conversation + items_to_messages(parse_items(response["output"], "output"))
        self.store.put(tenant, echo.response_id, StoredResponse.of(messages, response))


class _EventWriter:
    """Server-sent events of one stream: `event: <type>` and `data: <json>` with the next sequence_number."""

    def __init__(self) -> None:
        self._next: Callable[[], int] = itertools.count().__next__

    def __call__(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._next()
        data = encode_json(event)
        return f"event: {event['type']}\ndata: {data}\n\n"
