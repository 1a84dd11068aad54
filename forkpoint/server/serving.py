"""The generation endpoints (/v1/completions, /v1/chat/completions): from a validated request body
to an OpenAI response, whole or streamed as server-sent events.

Both endpoints share one path: build `EnginePrompt`s, check lengths, build `SamplingParams`, start
a `Generation`, then either collect its final outputs or stream deltas. The two differ only in
the shape of a choice, which `CompletionFormat` and `ChatFormat` supply.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from forkpoint.outputs import CompletionOutput, RequestOutput
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.errors import APIError, error_body, invalid_request
from forkpoint.server.generation import Admission, Generation
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import EnginePrompt, PromptBuilder
from forkpoint.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from forkpoint.server.worker import EngineFailure, EngineWorker, ServerShuttingDown

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class _ChoiceCursor:
    """How much of one choice's cumulative output has been streamed."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _Delta:
    """New output of one choice since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int = 0


class _Format(abc.ABC):
    """Shape of one endpoint's responses. Subclasses fill in the choice layouts."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs in the response

    @abc.abstractmethod
    def choice(self, delta: _Delta) -> dict[str, Any]:
        """A choice of the whole response (`delta` holds the complete output)."""

    @abc.abstractmethod
    def chunk_choice(self, delta: _Delta) -> dict[str, Any]:
        """A choice of a streamed chunk."""

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices of the chunks sent before any token (chat: the assistant role)."""
        return []

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, logprobs: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(logprobs.items(), key=lambda item: -item[1])[: self.top_logprobs]


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def choice(self, delta: _Delta) -> dict[str, Any]:
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}

    chunk_choice = choice

    def _logprobs(self, delta: _Delta) -> dict[str, Any] | None:
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = delta.text_offset
        for token_id, entry in zip(delta.token_ids, delta.logprobs):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry.get(token_id))
            top.append({self.token_text(t): lp for t, lp in self._top(entry)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, delta: _Delta) -> dict[str, Any]:
        return {"index": delta.index, "message": {"role": "assistant", "content": delta.text},
                "logprobs": self._logprobs(delta), "finish_reason": delta.finish_reason}

    def chunk_choice(self, delta: _Delta) -> dict[str, Any]:
        return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._logprobs(delta), "finish_reason": delta.finish_reason}

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(num_choices)]

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, delta: _Delta) -> dict[str, Any] | None:
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs):
            item = self._entry(token_id, entry.get(token_id))
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in self._top(entry)]
            content.append(item)
        return {"content": content}


@dataclass
class _Usage:
    """Token counts of a request, from the last output of each prompt."""

    last: dict[int, RequestOutput] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(len(out.prompt_token_ids) for out in self.last.values())
        completion = sum(len(c.token_ids) for out in self.last.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class _GenerationStream(StreamingResponse):
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


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """Handlers of the two generation endpoints, bound to one engine worker."""

    def __init__(self, *, model_name: str, max_model_len: int, prompts: PromptBuilder, worker: EngineWorker,
                 admission: Admission, metrics: ServerMetrics) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.prompts = prompts
        self.worker = worker
        self.admission = admission
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise invalid_request(f"model {model!r} does not exist: this server serves {self.model_name!r}",
                                  param="model", code="model_not_found")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prompts = await self.prompts.run(lambda: [
            self.prompts.from_text(p, body.checkpoint_positions) if isinstance(p, str)
            else self.prompts.from_token_ids(p, body.checkpoint_positions) for p in batch])
        max_tokens = self._max_tokens(body.max_tokens, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        params = self._sampling_params(body, max_tokens, body.logprobs)
        fmt = CompletionFormat(self.prompts.tokenizer, body.logprobs)
        return await self._generate("completions", "prompt", "cmpl", body, prompts, params, fmt, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = await self.prompts.from_messages_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                        template_kwargs=body.chat_template_kwargs)
        max_tokens = self._max_tokens(body.max_new_tokens, [prompt], "messages", None)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, top)
        fmt = ChatFormat(self.prompts.tokenizer, top)
        return await self._generate("chat", "messages", "chatcmpl", body, [prompt], params, fmt, request)

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
        if requested is None:
            return min(default, room) if default is not None else room
        if requested > room:
            raise invalid_request(
                f"max_tokens is {requested} but the prompt ({longest} tokens) leaves room for only {room} "
                f"of max_model_len {self.max_model_len}: lower max_tokens or shorten the prompt",
                param="max_tokens", code="context_length_exceeded")
        return requested

    @staticmethod
    def _sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed, max_tokens=max_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, logprobs=logprobs)
        except ValueError as err:  # SamplingParams names the field first: "stop must be ..."
            field_name = str(err).split(" ", 1)[0]
            raise invalid_request(str(err), param=field_name if field_name in SAMPLING_FIELDS else None) from None

    async def _generate(self, endpoint: str, prompt_param: str, id_prefix: str, body: SamplingFields,
                        prompts: list[EnginePrompt], params: SamplingParams, fmt: _Format,
                        request: Request) -> Response:
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        gen = Generation(self.worker, self.admission, self.metrics, endpoint=endpoint, prompt_param=prompt_param,
                         request_id=request_id, prompts=prompts, params=params)
        await gen.start()
        header = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            events = self._stream(gen, fmt, header, len(prompts), body.include_usage)
            return _GenerationStream(events, gen.close)
        try:
            return await self._collect(gen, fmt, header, request)
        finally:
            gen.close()

    async def _collect(self, gen: Generation, fmt: _Format, header: dict[str, Any], request: Request) -> Response:
        usage = _Usage()

        async def run() -> None:
            async for index, output in gen.outputs():
                usage.last[index] = output

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():  # the client left: close() aborts the prompts
            work.cancel()
            return Response(status_code=499)
        exc = work.exception()
        # answered here, not raised: the outcome is already counted by the Generation
        if isinstance(exc, ServerShuttingDown):
            return APIError(str(exc), status=503, type="service_unavailable_error", code="shutting_down").response()
        if isinstance(exc, EngineFailure):
            return APIError(str(exc), status=500, type="server_error").response()
        if exc is not None:
            raise exc
        n = gen.params.n
        choices = [fmt.choice(_Delta(index * n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason))
                   for index, output in sorted(usage.last.items()) for c in output.outputs]
        return JSONResponse({**header, "object": fmt.object_name, "choices": choices, "usage": usage.as_dict()})

    async def _stream(self, gen: Generation, fmt: _Format, header: dict[str, Any], num_prompts: int,
                      include_usage: bool) -> AsyncIterator[str]:
        chunk = {**header, "object": fmt.chunk_object_name}
        n = gen.params.n
        usage = _Usage()
        cursors: dict[int, _ChoiceCursor] = {}
        try:
            for choice in fmt.opening_chunks(num_prompts * n):
                yield _sse({**chunk, "choices": [choice]})
            async for index, output in gen.outputs():
                usage.last[index] = output
                for completion in output.outputs:
                    key = index * n + completion.index
                    delta = _delta_of(key, completion, cursors.setdefault(key, _ChoiceCursor()), gen.params.stop)
                    if delta is not None:
                        yield _sse({**chunk, "choices": [fmt.chunk_choice(delta)]})
            if include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage.as_dict()})
        except (EngineFailure, ServerShuttingDown) as exc:  # the status line is sent: report in-band
            yield _sse(error_body(str(exc), "server_error"))
        gen.close()
        yield _sse("[DONE]")


def _delta_of(index: int, completion: CompletionOutput, cursor: _ChoiceCursor, stops: list[str]) -> _Delta | None:
    """The output of `completion` past `cursor` (advancing it), or None when there is nothing to
    send yet. Until the choice finishes, two tails of the cumulative text are held back because
    the engine may still rewrite them: replacement characters (a multi-byte character whose
    remaining bytes are in the next token) and the start of a stop string (the engine cuts the
    text where a stop string begins once it is complete)."""
    text = completion.text
    finish = completion.finish_reason if not cursor.finished else None
    end = len(text)
    if completion.finish_reason is None:
        end = len(text.rstrip("\ufffd"))
        end -= _stop_prefix_len(text[:end], stops)
    if end <= cursor.text_len and finish is None:
        return None
    tokens = completion.token_ids[cursor.num_tokens:]
    logprobs = completion.logprobs[cursor.num_tokens:] if completion.logprobs is not None else None
    delta = _Delta(index, text[cursor.text_len:end], tokens, logprobs, finish, text_offset=cursor.text_len)
    cursor.text_len = max(cursor.text_len, end)
    cursor.num_tokens = len(completion.token_ids)
    cursor.finished = finish is not None or cursor.finished
    return delta


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
