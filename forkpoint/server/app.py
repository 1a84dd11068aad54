"""The FastAPI app of the OpenAI-compatible server: `build_app(llm, config)`.

One process, one engine thread (`EngineWorker`, started and stopped with the app's lifespan);
handlers run on the event loop and never touch the engine directly.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, POST /detokenize, GET /metrics (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from forkpoint.inputs.markers import validate_token_ids
from forkpoint.llm import LLM
from forkpoint.server.config import ServerConfig
from forkpoint.server.errors import install_error_handlers, invalid_request
from forkpoint.server.generation import Admission
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from forkpoint.server.serving import OpenAIServing
from forkpoint.server.worker import EngineWorker

# paths whose failures count in forkpoint_requests_total, with their endpoint label
GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
ERROR_OUTCOMES = {400: "invalid_request", 422: "invalid_request", 503: "rejected"}


def build_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """An app serving `llm`. It takes over `llm.engine`: from the app's startup to its shutdown
    only the app's engine thread may use it (`app.state.worker.call(fn)` runs `fn(engine)` there).
    """
    engine = llm.engine
    worker = EngineWorker(engine)
    admission = Admission(config.max_waiting_requests, config.retry_after_s)
    metrics = ServerMetrics(worker.metrics_snapshot, lambda: admission.waiting, lambda: admission.running,
                            endpoints=tuple(GENERATION_ENDPOINTS.values()))
    tokenizer = llm.get_tokenizer()
    prompts = PromptBuilder(
        tokenizer, checkpoint_token=engine.config.checkpoint_token, checkpoint_token_id=llm.checkpoint_token_id,
        max_checkpoints=engine.config.max_checkpoints_per_request, policy=config.marker_policy,
        images=engine.images if engine.images.processor is not None else None,
    )
    serving = OpenAIServing(model_name=config.served_model_name, max_model_len=engine.max_model_len,
                            prompts=prompts, worker=worker, admission=admission, metrics=metrics,
                            default_max_tokens=engine.generation_defaults.max_new_tokens)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.shutdown, config.shutdown_timeout_s)

    app = FastAPI(title="forkpoint", summary="OpenAI-compatible server with prefix checkpoints", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.config = config

    def on_error(request: Request, status: int) -> None:
        endpoint = GENERATION_ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            metrics.count(endpoint, ERROR_OUTCOMES.get(status, "error"))

    install_error_handlers(app, on_error)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread runs, 503 otherwise."""
        if worker.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": created, "owned_by": "forkpoint",
            "root": str(engine.model_path), "max_model_len": engine.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids as the engine will see them (markers removed) and the checkpoint positions
        the markers and flags stand for: send both back as a token-id prompt for the same effect."""
        serving.check_model(body.model)
        if body.prompt is not None:
            prompt = prompts.from_text(body.prompt)
        else:
            kwargs = dict(body.chat_template_kwargs or {})
            if body.tools is not None:
                kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
            prompt = await prompts.from_messages_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                       template_kwargs=kwargs)
        return {"count": len(prompt.token_ids), "max_model_len": engine.max_model_len,
                "tokens": prompt.token_ids, "checkpoint_positions": list(prompt.checkpoint_positions)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        try:
            validate_token_ids(body.tokens, len(tokenizer))
        except ValueError as err:
            raise invalid_request(str(err), param="tokens") from None
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
