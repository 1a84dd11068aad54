"""The FastAPI app of the OpenAI-compatible server: `build_app(llm, config)`, or
`build_process_app(worker, front, config)` for an engine in its own process (`--engine-process`).

One engine thread (`EngineWorker`, started and stopped with the app's lifespan), in this process or in
the engine process (process_worker.py: each process then has its own GIL); handlers run on the event
loop and never touch the engine directly. Tokenisation and prompt
building run in a pool of `--tokenizer-workers` threads (the fast tokenizer is only read, and its
Rust encode releases the GIL), so one huge prompt holds up no other request's prompt; a request's
structured-output constraint is compiled in threads of its own (`grammar_threads.py`) before the request
reaches the engine thread, which then only copies the compiled grammar; request bodies over
--max-request-bytes are refused before they are read (`limits.RequestSizeLimit`), and the lifespan logs
a start-up summary and a periodic stats line (`stats.py`).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses (with GET and DELETE /v1/responses/{id}), POST /v1/messages (Anthropic's, with
POST /v1/messages/count_tokens), POST /tokenize, POST /detokenize, GET /metrics (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Scope
from transformers import PreTrainedTokenizerBase

from forkpoint import __version__ as forkpoint_version
from forkpoint.inputs.markers import validate_token_ids
from forkpoint.inputs.processor import InputProcessor
from forkpoint.inputs.segment_tokens import SegmentEncoder
from forkpoint.inputs.template_sandbox import TemplateLimits, TemplateSandbox
from forkpoint.llm import LLM
from forkpoint.server.arrival import ArrivalTime
from forkpoint.server.auth import APIKeyAuth
from forkpoint.server.config import (
    CorsPolicy,
    ServerConfig,
    default_max_request_objects,
    default_max_request_values,
)
from forkpoint.server.engine_front import EngineFront
from forkpoint.server.errors import (
    CLIENT_CLOSED_REQUEST,
    RequestTooLarge,
    install_error_handlers,
    invalid_request,
    log_error_response,
)
from forkpoint.server.gc_pauses import GcPauses
from forkpoint.server.generation import Admission
from forkpoint.server.grammar_threads import GrammarThreads
from forkpoint.server.json_body import BodyLimits, off_loop_json_route
from forkpoint.server.limits import RequestSizeLimit, default_max_request_bytes
from forkpoint.server.messages_errors import error_body_for
from forkpoint.server.messages_protocol import CountTokensRequest, MessagesRequest
from forkpoint.server.messages_serving import AnthropicMessages
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.process_worker import ProcessWorker
from forkpoint.server.prompt_threads import PromptThreads
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from forkpoint.server.request_params import reject_unencodable_text, template_kwargs
from forkpoint.server.response_store import ResponseStore
from forkpoint.server.responses_protocol import ResponsesRequest
from forkpoint.server.responses_serving import OpenAIResponses
from forkpoint.server.serving import OpenAIServing
from forkpoint.server.stats import engine_summary, log_stats_forever, server_summary
from forkpoint.server.worker import EngineWorker

logger = logging.getLogger("forkpoint.server")

# paths whose failures count in forkpoint_requests_total, with their endpoint label
GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
                        "/v1/messages": "messages"}
ERROR_OUTCOMES = {400: "invalid_request", 404: "invalid_request", 413: "invalid_request", 422: "invalid_request",
                  503: "rejected", CLIENT_CLOSED_REQUEST: "aborted"}
# bodies above this have their strings checked for lone surrogates off the event loop (below it, at most a
# few thousand strings: a few milliseconds inline, where a thread hop would queue behind prompt renders)
OFF_LOOP_CHECK_BYTES = 64 << 10


@dataclass(frozen=True)
class _ServedEngine:
    """What the app serves, from an engine in this process (`build_app`) or in its own (`build_process_app`).

    worker: the engine's worker (its thread here, or the engine process's `ProcessWorker`); front: the
    prompt settings; tokenizer / inputs: the engine's, for prompts built in this process; grammars: where
    constraints compile (threads here, or the engine process); startup_lines: the engine's start-up lines;
    before_serving: blocking work before the first request (run in a thread); close_grammars: at the end."""

    worker: EngineWorker | ProcessWorker
    front: EngineFront
    tokenizer: PreTrainedTokenizerBase
    inputs: InputProcessor
    grammars: GrammarThreads | ProcessWorker
    startup_lines: Callable[[], list[str]]
    before_serving: Callable[[], None]
    close_grammars: Callable[[], None]


def build_app(llm: LLM, config: ServerConfig, *, load_time_s: float | None = None) -> FastAPI:
    """An app serving `llm`. It takes over `llm.engine`: from the app's startup to its shutdown
    only the app's engine thread may use it (`app.state.worker.call(fn)` runs `fn(engine)` there).
    load_time_s: how long building `llm` took, for the start-up summary.
    """
    engine = llm.engine
    grammars = GrammarThreads(engine.grammars)  # constraints compile here, not on the engine thread

    def before_serving() -> None:
        # structured outputs' vocabulary view, built here and not on the first constrained request (which
        # held the engine thread and the GIL for seconds: every stream and /health stalled)
        try:
            engine.grammars.prepare()
        except ValueError as err:  # a slow tokenizer: constrained requests get this error as a 400
            logger.info("structured outputs unavailable: %s", err)
        # a host tier pinned ahead is still being pinned: wait for it here, not beside the first steps
        began = time.perf_counter()
        engine.wait_for_host_tier()
        if time.perf_counter() - began > 0.5:
            logger.info("waited %.1f s for the host tier's pinned memory before serving", time.perf_counter() - began)

    served = _ServedEngine(
        worker=EngineWorker(engine), front=EngineFront.of(llm, []), tokenizer=llm.get_tokenizer(),
        inputs=engine.inputs, grammars=grammars,
        startup_lines=lambda: engine_summary(llm, config.served_model_name, config.marker_policy, load_time_s),
        before_serving=before_serving, close_grammars=grammars.shutdown)
    return _build(served, config)


def build_process_app(worker: ProcessWorker, front: EngineFront, config: ServerConfig) -> FastAPI:
    """An app serving the engine process behind `worker` (process_worker.py; `front`: what it sent when it
    was ready): prompts are rendered, tokenised and checked here, constraints compile and the engine
    steps there, each process with its own GIL. The app's lifespan starts the worker and shuts the engine
    process down."""
    tokenizer = front.load_tokenizer()
    served = _ServedEngine(
        worker=worker, front=front, tokenizer=tokenizer, inputs=front.input_processor(tokenizer), grammars=worker,
        startup_lines=lambda: list(front.summary), before_serving=lambda: None, close_grammars=lambda: None)
    return _build(served, config)


def _build(served: _ServedEngine, config: ServerConfig) -> FastAPI:
    worker, front, tokenizer = served.worker, served.front, served.tokenizer
    gc_pauses = GcPauses()

    def snapshot() -> dict[str, float]:
        """The engine's metrics and this process's garbage collections."""
        return {**worker.metrics_snapshot(), **gc_pauses.values()}

    admission = Admission(config.max_waiting_requests, config.retry_after_s,
                          max_per_request=config.max_num_seqs_per_request,
                          max_waiting_per_client=config.max_waiting_per_user)
    metrics = ServerMetrics(snapshot, lambda: admission.waiting, lambda: admission.running,
                            endpoints=tuple(GENERATION_ENDPOINTS.values()))
    takes_images = front.takes_images
    # the fast tokenizer is safe to share: encode, decode and template rendering only read it; daemon threads,
    # so a prompt still tokenising does not hold the process past the shutdown timeout (prompt_threads.py)
    tokenizer_pool = PromptThreads(config.tokenizer_workers, "forkpoint-tokenizer")
    prompts = PromptBuilder(
        tokenizer, checkpoint_token=front.checkpoint_token, checkpoint_token_id=front.checkpoint_token_id,
        max_checkpoints=front.max_checkpoints_per_request, policy=config.marker_policy,
        images=front.images if takes_images else None, executor=tokenizer_pool,
        processor=served.inputs, turn_boundaries=front.turn_boundaries,
        segments=SegmentEncoder(tokenizer, config.token_cache_bytes) if config.token_cache_bytes > 0 else None,
        chat_template=config.chat_template,
    )
    max_request_bytes = (config.max_request_bytes if config.max_request_bytes is not None else
                         default_max_request_bytes(tokenizer, front.max_model_len, takes_images=takes_images))
    limits = body_limits(config, front.max_model_len)
    # request-supplied chat templates run in a child process with limits (the rendered prompt may be as
    # long as a request body), only when the operator trusts them
    sandbox = (TemplateSandbox(TemplateLimits(max_output_chars=max_request_bytes))
               if config.trust_request_chat_template else None)
    serving = OpenAIServing(model_name=config.served_model_name, model_aliases=config.served_model_aliases,
                            max_model_len=front.max_model_len,
                            prompts=prompts, worker=worker, admission=admission, metrics=metrics,
                            default_max_tokens=front.default_max_tokens, template_sandbox=sandbox,
                            cache_isolation=config.cache_isolation, grammars=served.grammars,
                            tool_formats=config.tool_formats)
    created = int(time.time())
    response_store = ResponseStore(config.responses_store_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for line in served.startup_lines() + server_summary(config, max_request_bytes, limits):
            logger.info("%s", line)
        await asyncio.to_thread(served.before_serving)
        gc_pauses.install()
        worker.start()
        stats = (asyncio.create_task(log_stats_forever(snapshot, config.log_stats_interval_s))
                 if config.log_stats else None)
        # `forkpoint serve` (uvicorn on the main thread) exits when the engine ends on its own; an app
        # embedded in another program's thread (the tests' servers) answers /health 503 and leaves that to it
        watchdog = (asyncio.create_task(exit_when_engine_ends(worker))
                    if threading.current_thread() is threading.main_thread() else None)
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            gc_pauses.uninstall()
            if stats is not None:
                stats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats
            await asyncio.to_thread(worker.shutdown, config.shutdown_timeout_s)
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            served.close_grammars()
            if sandbox is not None:
                sandbox.close()

    app = FastAPI(title="forkpoint", summary="OpenAI-compatible server with prefix checkpoints", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.config = config
    app.state.tokenizer_pool = tokenizer_pool
    app.state.prompts = prompts
    app.state.max_request_bytes = max_request_bytes
    app.state.response_store = response_store

    install_request_guards(app, metrics, max_request_bytes, limits, config.api_keys, config.cors)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine runs, 503 otherwise."""
        if worker.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the probe

    add_openai_routes(app, serving=serving, prompts=prompts, tokenizer=tokenizer, metrics=metrics,
                      model_root=front.model_path, max_model_len=front.max_model_len,
                      served_model_names=config.served_model_names, created=created,
                      response_store=response_store)
    return app


async def exit_when_engine_ends(worker: EngineWorker | ProcessWorker, poll_s: float = 0.2,
                                grace_s: float = 1.0) -> None:
    """Wait for the engine thread to end on its own (a failure no later step can run past, such as an
    unusable runner: worker.py), then, `grace_s` later (the failed requests' errors go out; /health
    answers 503 meanwhile), end the server process with exit status 1 for its supervisor to restart it.
    Cancelled when the server shuts down."""
    while worker.is_alive():
        await asyncio.sleep(poll_s)
    logger.critical("the engine thread has ended and the engine cannot serve: exiting with status 1 so that "
                    "a supervisor restarts the server")
    await asyncio.sleep(grace_s)
    raise SystemExit(1)  # out of the event loop and uvicorn.run: the process exits 1


def body_limits(config: ServerConfig, max_model_len: int) -> BodyLimits:
    """The JSON object and value limits of request bodies (--max-request-objects, --max-request-values)."""
    objects = (config.max_request_objects if config.max_request_objects is not None
               else default_max_request_objects(max_model_len))
    values = (config.max_request_values if config.max_request_values is not None
              else default_max_request_values(max_model_len))
    return BodyLimits(objects, values)


def install_request_guards(app: FastAPI, metrics: ServerMetrics, max_request_bytes: int, body_limits: BodyLimits,
                           api_keys: tuple[str, ...] = (), cors: CorsPolicy | None = None) -> None:
    """The error handlers (OpenAI-shaped error bodies, Anthropic-shaped on the /v1/messages routes, each
    counted under its endpoint's outcome), the request-size limit (413 before the body is read when
    Content-Length says so), the JSON object and value limits of the routes added after this (400 before
    the body is validated, server/json_body.py), with `api_keys` the key check (401 before anything else;
    server/auth.py), and with `cors` origins the cross-origin headers (outside the key check: a browser's preflight
    carries no key), that every front end shares (one engine's app, the replicas' ingress)."""

    def on_error(request: Request, status: int) -> None:
        endpoint = GENERATION_ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            metrics.count(endpoint, ERROR_OUTCOMES.get(status, "error"))

    def on_too_large(scope: Scope, message: str, answered_here: bool) -> None:
        """A body over the limit; when the middleware answers it (Content-Length), log and count it
        here: otherwise the error handlers do."""
        if not answered_here:
            return
        endpoint = GENERATION_ENDPOINTS.get(scope["path"])
        if endpoint is not None:
            metrics.count(endpoint, "invalid_request")
        log_error_response(scope["method"], scope["path"], 413, RequestTooLarge(message).body())

    install_error_handlers(app, on_error, error_body_for)
    app.router.route_class = off_loop_json_route(body_limits)  # routes added after this use it
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes, on_reject=on_too_large,
                       body_for=error_body_for)
    if api_keys:  # added late: outside the size limit, so a request without a valid key gets no further
        app.add_middleware(APIKeyAuth, keys=api_keys)
    if cors is not None and cors.origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    app.add_middleware(ArrivalTime)  # added last: the outermost, it stamps the request before any other work


def _decode(tokenizer, token_ids: list[int]) -> str:
    """`token_ids` decoded, or a 400 naming the field when one is no token of the vocabulary."""
    try:
        validate_token_ids(token_ids, len(tokenizer))
    except ValueError as err:
        raise invalid_request(str(err), param="tokens") from None
    return tokenizer.decode(token_ids)


def add_openai_routes(app: FastAPI, *, serving: OpenAIServing, prompts: PromptBuilder, tokenizer,
                      metrics: ServerMetrics, model_root: str, max_model_len: int,
                      served_model_names: Sequence[str], created: int, response_store: ResponseStore) -> None:
    """The OpenAI-compatible routes every front end shares (one engine's app, the replicas' ingress):
    /version, /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (finished ones kept in
    `response_store`), Anthropic's /v1/messages and /v1/messages/count_tokens, /tokenize, /detokenize,
    /metrics."""
    responses = OpenAIResponses(serving, response_store)
    messages = AnthropicMessages(serving)

    async def reject_unencodable(body: BaseModel, request: Request) -> None:
        """`reject_unencodable_text(body)`: inline for a small body, in the tokenizer pool for one over
        OFF_LOOP_CHECK_BYTES, whose walk over thousands of strings (pure Python) would hold the event
        loop for tens of milliseconds; in a thread it yields the GIL every switch interval. (The body
        limits bound the walk: at most --max-request-objects models and --max-request-values strings.)"""
        if len(await request.body()) > OFF_LOOP_CHECK_BYTES:
            await prompts.run(reject_unencodable_text, body)
        else:
            reject_unencodable_text(body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": forkpoint_version}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "forkpoint",
            "root": model_root, "max_model_len": max_model_len,
        } for name in served_model_names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        await reject_unencodable(body, request)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        await reject_unencodable(body, request)
        return await serving.chat(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        await reject_unencodable(body, request)
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request, cache_salt: str | None = None,
                           user: str | None = None) -> Response:
        """A stored response, to its tenant (`cache_salt` and `user` as query parameters: the body's rule)."""
        return responses.retrieve(response_id, cache_salt, user, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request, cache_salt: str | None = None,
                              user: str | None = None) -> Response:
        return responses.delete(response_id, cache_salt, user, request)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        await reject_unencodable(body, request)
        return await messages.create(body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest, request: Request) -> Response:
        await reject_unencodable(body, request)
        return await messages.count_tokens(body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        """Token ids as the engine will see them (markers removed) and the checkpoint positions
        the markers and flags stand for: send both back as a token-id prompt for the same effect.
        Built in the tokenizer pool; a text that cannot fit max_model_len is a 400
        (context_length_exceeded) after little more than max_model_len tokens of it were counted
        (prompt_length.py), where counting all of a body-limit text would hold a pool thread for
        tens of seconds."""
        serving.check_model(body.model)
        await reject_unencodable(body, request)
        if body.prompt is not None:
            prompt = await prompts.run(prompts.from_text, body.prompt, process=False)
        else:
            prompt = await prompts.from_messages_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                       template_kwargs=template_kwargs(body, serving.template_sandbox),
                                                       process=False)
        return {"count": len(prompt.token_ids), "max_model_len": max_model_len,
                "tokens": prompt.token_ids, "checkpoint_positions": list(prompt.checkpoint_positions)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """The text of `tokens`, checked and decoded in the tokenizer pool. At most max_model_len ids:
        no prompt and output of this model is longer, and more would only hold a pool thread."""
        serving.check_model(body.model)
        if len(body.tokens) > max_model_len:
            raise invalid_request(f"tokens has {len(body.tokens)} ids, but one request decodes at most max_model_len "
                                  f"= {max_model_len}: split them over several requests", param="tokens")
        return {"prompt": await prompts.run(_decode, tokenizer, body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
