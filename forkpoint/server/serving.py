"""The generation endpoints (/v1/completions, /v1/chat/completions): from a validated request body
to an OpenAI response, whole or streamed as server-sent events.

Both endpoints share one path: build `EnginePrompt`s, check lengths, build `SamplingParams`, start
a `Generation`, then either collect its final outputs or stream deltas. The two differ only in
the shape of a choice, which `CompletionFormat` and `ChatFormat` supply. /v1/responses
(responses_serving.py) and /v1/messages (messages_serving.py) run on the chat half of this path:
`chat_plan`, `start`, `collect`, `stream_deltas`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from forkpoint.inputs.template_sandbox import TemplateSandbox
from forkpoint.outputs import CompletionOutput, RequestOutput
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.arrival import arrival_time
from forkpoint.server.chat_format import ChatFormat, ChatOptions
from forkpoint.server.errors import APIError, error_body, invalid_request
from forkpoint.server.generation import Admission, Generation
from forkpoint.server.grammar_threads import GrammarThreads
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import EnginePrompt, PromptBuilder
from forkpoint.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from forkpoint.server.request_params import (
    constraint_param,
    sampling_params,
    structured_outputs,
    template_kwargs,
    tool_constraint,
)
from forkpoint.server.responses import (
    CompletionFormat,
    Delta,
    ResponseFormatter,
    prompt_logprobs_json,
)
from forkpoint.server.sse import ChunkFrame, sse
from forkpoint.server.tool_parsers import ALL_FORMATS
from forkpoint.server.worker import EngineFailure, EngineWorker, RequestOutOfMemory, ServerShuttingDown

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (without a generation config)


@dataclass
class _ChoiceCursor:
    """How much of one choice's cumulative output has been streamed."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request runs: its prompt, its sampling, and the formatter that reads its output
    (reasoning, tool calls) into choices. /v1/responses runs the same plan (responses_serving.py)."""

    prompt: EnginePrompt
    params: SamplingParams
    fmt: ChatFormat


@dataclass(frozen=True)
class Collected:
    """A whole (not streamed) generation's end: `last`, the last output of each prompt by prompt
    index, or `failure`, the answer to send instead (499 when the client left, an engine failure's
    error): exactly one of them is set. `error`: the `APIError` behind a failure that is one (None for
    the 499), for endpoints that answer errors in another shape."""

    last: dict[int, RequestOutput] | None = None
    failure: Response | None = None
    error: APIError | None = None

    @classmethod
    def failed(cls, error: APIError) -> Collected:
        return cls(failure=error.response(), error=error)


@dataclass
class _Usage:
    """Token counts of a request, from the last output of each prompt."""

    last: dict[int, RequestOutput] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(len(out.prompt_token_ids) for out in self.last.values())
        completion = sum(len(c.token_ids) for out in self.last.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.last.values())
        # forkpoint's extension: why reuse stopped short (the first prompt's with a reason; None: none did)
        reason = next((out.cache_miss_reason for _, out in sorted(self.last.items()) if out.cache_miss_reason), None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached, "cache_miss_reason": reason}}


class GenerationStream(StreamingResponse):
    """A streaming response that closes its `Generation` however the response ends, even when the
    client is gone before the body iterator starts (then its own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass



def api_client(request: Request) -> str | None:
    """The client the request's API key names ("key<i>", server/auth.py), or None on a server without keys."""
    return request.scope.get("state", {}).get("api_client")

class OpenAIServing:
    """Handlers of the two generation endpoints, bound to one engine worker."""

    def __init__(self, *, model_name: str, max_model_len: int, prompts: PromptBuilder, worker: EngineWorker,
                 admission: Admission, metrics: ServerMetrics, default_max_tokens: int | None = None,
                 template_sandbox: TemplateSandbox | None = None, cache_isolation: str = "none",
                 model_aliases: tuple[str, ...] = (), grammars: GrammarThreads | None = None,
                 tool_formats: tuple[str, ...] = ALL_FORMATS) -> None:
        self.cache_isolation = cache_isolation  # "user" / "api-key": requests without cache_salt are salted by it
        self.template_sandbox = template_sandbox  # runs request-supplied chat templates (None: they are a 400)
        self.default_max_tokens = default_max_tokens  # the model's generation_config.json max_new_tokens
        self.model_name = model_name  # responses carry it
        self.model_names = frozenset((model_name, *model_aliases))  # what requests may name
        self.max_model_len = max_model_len
        self.prompts = prompts
        self.worker = worker
        self.admission = admission
        self.metrics = metrics
        self.grammars = grammars  # compiles constraints off the engine thread (None: the engine compiles them)
        self.tool_formats = tool_formats  # the formats tool_choice "auto" reads calls in (--tool-call-parser)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = " or ".join(repr(name) for name in sorted(self.model_names))
            raise invalid_request(f"model {model!r} does not exist: this server serves {served}",
                                  param="model", code="model_not_found")

    def cache_salt(self, body: CompletionRequest | ChatCompletionRequest, request: Request) -> str | None:
        """The request's cache namespace: its `cache_salt`; with `--cache-isolation user`, the `user`
        field's (a request without one shares the unsalted namespace); with `api-key`, the key's it
        presented: tenants never share reuse."""
        return self.salt_of(body.cache_salt, body.user, request)

    def salt_of(self, cache_salt: str | None, user: str | None, request: Request) -> str | None:
        """`cache_salt`'s rule for a request that carries these two fields (in its body, or in the query
        of GET /v1/responses/{id})."""
        if cache_salt is not None:
            return cache_salt
        if self.cache_isolation == "user" and user:
            return f"user:{user}"
        if self.cache_isolation == "api-key":
            return f"api-key:{api_client(request)}"
        return None

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        received = time.monotonic()
        self.check_model(body.model)
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        salt = self.cache_salt(body, request)
        prompts = await self.prompts.run(lambda: [
            self.prompts.from_text(p, body.checkpoint_positions, cache_salt=salt) if isinstance(p, str)
            else self.prompts.from_token_ids(p, body.checkpoint_positions, cache_salt=salt) for p in batch])
        score_only = body.echo and body.max_tokens == 0  # vLLM: one token is sampled, then dropped
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, self.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        max_tokens = 1 if score_only else self._max_tokens(body.max_tokens, prompts, "prompt", default)
        if score_only:
            self._max_tokens(1, prompts, "prompt", None)  # the length checks still apply
        # echo with logprobs scores the prompt too (OpenAI, lm-eval-harness' loglikelihood)
        prompt_top = body.logprobs if body.echo and body.logprobs is not None else None
        if body.prompt_logprobs is not None:
            prompt_top = max(prompt_top or 0, body.prompt_logprobs)
        params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_top,
                                 structured=structured_outputs(body))
        fmt = CompletionFormat(self.prompts.tokenizer, body.logprobs, echo=body.echo, drop_output=score_only,
                               prompt_logprobs=body.prompt_logprobs)
        return await self._generate("completions", "prompt", "cmpl", body, prompts, params, fmt, request, received)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        received = time.monotonic()
        plan = await self.chat_plan(body, request)
        return await self._generate("chat", "messages", "chatcmpl", body, [plan.prompt], plan.params, plan.fmt,
                                    request, received)

    async def chat_plan(self, body: ChatCompletionRequest, request: Request) -> ChatPlan:
        """The prompt (rendered in the tokenizer pool), sampling and formatter of a chat request;
        an `APIError` (400) naming the field at fault."""
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = await self.prompts.from_messages_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                        template_kwargs=template_kwargs(body, self.template_sandbox),
                                                        cache_salt=self.cache_salt(body, request))
        max_tokens = self._max_tokens(body.max_new_tokens, [prompt], "messages", self.default_max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        structured, forced = structured_outputs(body), tool_constraint(body)
        if structured is not None and forced is not None:
            raise invalid_request(f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'function'}"
                                  " already constrains the output: drop the structured-output field",
                                  param="tool_choice")
        params = sampling_params(body, max_tokens=max_tokens, logprobs=top, prompt_logprobs=body.prompt_logprobs,
                                 structured=structured or forced)
        # a constrained output is the answer itself: an open <think> in the prompt does not apply to it
        options = ChatOptions.of(body, thinking=prompt.opens_thinking and params.structured_outputs is None,
                                 tool_formats=self.tool_formats)
        return ChatPlan(prompt, params, ChatFormat(self.prompts.tokenizer, top, options))

    def _max_tokens(self, requested: int | None, prompts: list[EnginePrompt], prompt_param: str,
                    default: int | None) -> int:
        """Check every prompt's length against max_model_len and resolve max_tokens (default: the
        given one, or all the room the longest prompt leaves)."""
        longest = max(len(p.token_ids) for p in prompts)
        if longest >= self.max_model_len:
            raise invalid_request(
                f"prompt has {longest} tokens but max_model_len is {self.max_model_len}: shorten the prompt",
                param=prompt_param, code="context_length_exceeded")
        room = self.max_model_len - longest
        if requested is None:  # the model's generation config, else the endpoint's default, else the room left
            return min(default, room) if default is not None else room
        if requested > room:
            raise invalid_request(
                f"max_tokens is {requested} but the prompt ({longest} tokens) leaves room for only {room} "
                f"of max_model_len {self.max_model_len}: lower max_tokens or shorten the prompt",
                param="max_tokens", code="context_length_exceeded")
        return requested

    async def start(self, endpoint: str, prompt_param: str, request_id: str, body: SamplingFields,
                    prompts: list[EnginePrompt], params: SamplingParams, request: Request,
                    received: float, *, stream: bool) -> Generation:
        """A started `Generation` of `prompts` (admitted, its constraint compiled, handed to the engine
        thread); the caller closes it however the request ends. `stream`: the response streams (every
        step's output); otherwise only each prompt's first-token and finished outputs come. Raises
        `APIError` (503 at capacity, 400 for a constraint that does not compile, naming the field of
        `body` that carried it, or for a prompt the engine refuses)."""
        gen = Generation(self.worker, self.admission, self.metrics, endpoint=endpoint, prompt_param=prompt_param,
                         request_id=request_id, prompts=prompts, params=params, cache_key=body.prompt_cache_key,
                         client=api_client(request) or body.user or "", received=received,
                         arrived=arrival_time(request), grammars=self.grammars,
                         constraint_param=constraint_param(body), stream=stream)
        await gen.start()
        return gen

    async def _generate(self, endpoint: str, prompt_param: str, id_prefix: str, body: SamplingFields,
                        prompts: list[EnginePrompt], params: SamplingParams, fmt: ResponseFormatter,
                        request: Request, received: float) -> Response:
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        gen = await self.start(endpoint, prompt_param, request_id, body, prompts, params, request, received,
                               stream=body.stream)
        header = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            events = self._stream(gen, fmt, header, len(prompts), body.include_usage)
            return GenerationStream(events, gen.close)
        try:
            return await self._collect(gen, fmt, header, request)
        finally:
            gen.close()

    async def collect(self, gen: Generation, fmt: ResponseFormatter, request: Request) -> Collected:
        """Wait for every prompt of `gen` to finish (its outputs through `fmt.transform`), or for the
        client to leave (the caller's `gen.close()` then aborts the prompts)."""
        last: dict[int, RequestOutput] = {}

        async def run() -> None:
            async for index, output in gen.outputs():
                last[index] = fmt.transform(output)

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():  # the client left: close() aborts the prompts
            work.cancel()
            return Collected(failure=Response(status_code=499))
        exc = work.exception()
        # answered here, not raised: the outcome is already counted by the Generation
        if isinstance(exc, ServerShuttingDown):
            return Collected.failed(APIError(str(exc), status=503, type="service_unavailable_error",
                                             code="shutting_down"))
        if isinstance(exc, RequestOutOfMemory):
            return Collected.failed(APIError(str(exc), status=400, code="out_of_memory"))
        if isinstance(exc, EngineFailure):
            return Collected.failed(APIError(str(exc), status=500, type="server_error"))
        if exc is not None:
            raise exc
        return Collected(last=last)

    async def _collect(self, gen: Generation, fmt: ResponseFormatter, header: dict[str, Any],
                       request: Request) -> Response:
        collected = await self.collect(gen, fmt, request)
        if collected.failure is not None:
            return collected.failure
        usage = _Usage(collected.last)
        n = gen.params.n

        def response() -> JSONResponse:
            """The body, rendered in the tokenizer pool: prompt scores of a long prompt are megabytes
            of JSON and a decode per entry, which would stall every stream on the event loop."""
            choices = [fmt.choice(Delta(index * n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason,
                                        output=output))
                       for index, output in sorted(usage.last.items()) for c in output.outputs]
            body = {**header, "object": fmt.object_name, "choices": choices, "usage": usage.as_dict()}
            if isinstance(fmt, ChatFormat) and fmt.options.prompt_logprobs is not None:  # vLLM: once, top level
                body["prompt_logprobs"] = prompt_logprobs_json(self.prompts.tokenizer, usage.last[0].prompt_logprobs)
            return JSONResponse(body)

        return await self.prompts.run(response)

    async def _stream(self, gen: Generation, fmt: ResponseFormatter, header: dict[str, Any], num_prompts: int,
                      include_usage: bool) -> AsyncIterator[str]:
        frame = ChunkFrame(header, fmt.chunk_object_name)  # id, created, model, object: serialised once
        usage = _Usage()
        try:
            for choice in fmt.opening_chunks(num_prompts * gen.params.n):
                yield frame.event(choice)
            async for delta in stream_deltas(gen, fmt, usage.last):
                yield frame.event(fmt.chunk_choice(delta))
            if include_usage:
                yield frame.with_fields([], usage=usage.as_dict())
        except RequestOutOfMemory as exc:  # the status line is sent: report in-band
            yield sse(error_body(str(exc), "invalid_request_error", code="out_of_memory"))
        except (EngineFailure, ServerShuttingDown) as exc:
            yield sse(error_body(str(exc), "server_error"))
        gen.close()
        yield sse("[DONE]")


async def stream_deltas(gen: Generation, fmt: ResponseFormatter,
                        last: dict[int, RequestOutput]) -> AsyncIterator[Delta]:
    """The new output of each choice (index: prompt index x n + completion index) as the engine makes
    it, the last one of each choice with its finish_reason; `last` keeps each prompt's latest output
    (through `fmt.transform`; the finished one is cumulative) for the usage. A streamed `gen`'s outputs
    are the engine's deltas (only what is new, the text already held back where it may change) until
    each prompt's finished, cumulative one. Raises what `gen.outputs()` raises."""
    n = gen.params.n
    cursors: dict[int, _ChoiceCursor] = {}
    async for index, raw in gen.outputs():
        output = fmt.transform(raw)
        last[index] = output
        for completion in output.outputs:
            key = index * n + completion.index
            cursor = cursors.get(key)
            if cursor is None:
                cursor = cursors[key] = _ChoiceCursor()
            delta = _rest_of(key, completion, cursor) if output.finished else _delta_since(key, completion, cursor)
            if delta is not None:
                delta.output = output
                yield delta


def _delta_since(index: int, completion: CompletionOutput, cursor: _ChoiceCursor) -> Delta | None:
    """`completion` of a delta output (the engine's `make_delta_output`: only what is new, its text
    already held back where it may change) as the next chunk, advancing `cursor`; None when it is empty."""
    finish = completion.finish_reason if not cursor.finished else None
    if not completion.text and not completion.token_ids and finish is None:
        return None
    delta = Delta(index, completion.text, completion.token_ids, completion.logprobs, finish,
                  text_offset=cursor.text_len)
    cursor.text_len += len(completion.text)
    cursor.num_tokens += len(completion.token_ids)
    cursor.finished = finish is not None or cursor.finished
    return delta


def _rest_of(index: int, completion: CompletionOutput, cursor: _ChoiceCursor) -> Delta | None:
    """The part of a finished, cumulative `completion` past `cursor` (what the deltas sent: always a prefix
    of it), with its finish_reason unless sent already; None when nothing is left."""
    finish = completion.finish_reason if not cursor.finished else None
    if len(completion.text) <= cursor.text_len and finish is None:
        return None
    tokens = completion.token_ids[cursor.num_tokens:]
    logprobs = completion.logprobs[cursor.num_tokens:] if completion.logprobs is not None else None
    delta = Delta(index, completion.text[cursor.text_len:], tokens, logprobs, finish, text_offset=cursor.text_len)
    cursor.text_len = max(cursor.text_len, len(completion.text))
    cursor.num_tokens = len(completion.token_ids)
    cursor.finished = True
    return delta
