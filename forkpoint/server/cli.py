"""The `forkpoint` command: `serve` (OpenAI-compatible server), `generate` (one-off prompts) and
`bench` (the 1-to-N checkpoint benchmark).

    forkpoint serve --port 8000                       # embedded default model
    forkpoint generate --max-tokens 8 "Hello" "Bonjour"
    forkpoint bench --n 1,4,16 --out bench/results

Heavy imports (torch, the engine) happen inside the subcommands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from forkpoint.server.bench_cli import add_bench_args, run_bench
from forkpoint.server.chat_args import add_chat_args, tool_call_formats
from forkpoint.server.config import (
    DEFAULT_MODEL_NAME,
    MIN_DEFAULT_REQUEST_OBJECTS,
    MIN_DEFAULT_REQUEST_VALUES,
    TOKENS_PER_DEFAULT_OBJECT,
    CorsPolicy,
    MarkerPolicy,
    ServerConfig,
    default_tokenizer_workers,
)
from forkpoint.server.engine_args import add_engine_args, check_engine_kwargs, engine_kwargs, server_engine_kwargs
from forkpoint.server.http_args import add_http_args, uvicorn_options

# An idle kept-alive connection's life on the server (seconds): longer than a client's own (httpx, and so the openai
# client, keep one 5 s; uvicorn's and vLLM's default is 5 s too, which races them: bench/agent_sessions.py at 256
# sessions, docs/server.md)
KEEP_ALIVE_S = 30.0
# --engine-process's GIL switch interval in both processes (ms): a message through the pipe passes four threads
# (event loop, sender; reader, engine thread on the way in; engine thread, outbox; reader, event loop on the way
# out), each of which waited up to CPython's 5 ms for the GIL behind the thread holding it (bench/pipe_crossing.py,
# docs/server.md "The pipe's crossings")
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forkpoint", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                description="Run the OpenAI-compatible HTTP server (one process, one engine thread; "
                                            "--engine-process: the engine in a process of its own).")
    add_engine_args(serve, positional_model=True)
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="model id in the API; with several (vLLM's rule), requests may name any of them and "
                           "responses carry the first (default: the Hub name as given, the model directory's name, "
                           f"or {DEFAULT_MODEL_NAME})")
    http.add_argument("--max-waiting-requests", type=int, default=ServerConfig.max_waiting_requests,
                      help="prompts allowed to wait for their first token; beyond it requests get 503 with "
                           f"Retry-After (default: {ServerConfig.max_waiting_requests})")
    http.add_argument("--max-num-seqs-per-request", type=int, default=ServerConfig.max_num_seqs_per_request,
                      help="most sequences (prompts x n) one request may ask for; more is a 400 (default: "
                           f"{ServerConfig.max_num_seqs_per_request})")
    http.add_argument("--max-waiting-per-user", type=int, default=None,
                      help="most sequences one client (the request's user field) may have waiting for a first "
                           "token; beyond it that client gets 503 while others are admitted (default: no bound)")
    http.add_argument("--tokenizer-workers", type=int, default=default_tokenizer_workers(),
                      help="threads that render and tokenise prompts, so one huge prompt does not hold up the "
                           "others (default: the CPU count, 2 to 8)")
    http.add_argument("--token-cache-mib", type=float, default=ServerConfig.token_cache_bytes / 2**20,
                      help="MiB of chat prompt pieces (turns) whose token ids the server keeps, so a session's "
                           "next turn tokenises only its new text (same ids); 0 tokenises every prompt whole "
                           f"(default: {ServerConfig.token_cache_bytes / 2**20:g})")
    http.add_argument("--responses-store-mib", type=float, default=ServerConfig.responses_store_bytes / 2**20,
                      help="MiB of finished /v1/responses responses kept for previous_response_id and GET "
                           "/v1/responses/{id}, least recently used dropped first; 0 keeps none (default: "
                           f"{ServerConfig.responses_store_bytes / 2**20:g})")
    http.add_argument("--marker-in-user-content", default=MarkerPolicy.ALLOW.value,
                      choices=[p.value for p in MarkerPolicy],
                      help="the marker string inside client text (messages, prompts): allow = it checkpoints; "
                           "strip = it is removed (structured controls still work); reject = 400 (default: allow)")
    http.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout_s,
                      help="seconds in-flight requests get to finish on shutdown before they are aborted "
                           f"(default: {ServerConfig.shutdown_timeout_s:g})")
    http.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                      help="seconds an idle HTTP/1.1 connection stays open for the client's next request (uvicorn's "
                           "option; default: %(default)g, longer than the 5 s clients such as httpx and the openai "
                           "client keep an idle connection, so the client closes it first: a server that closes "
                           "first can close a connection just as a client sends on it, which fails that request)")
    http.add_argument("--max-request-bytes", type=int, default=None,
                      help="request bodies above this many bytes get 413 before they are read (default: enough "
                           "for any one prompt that fits --max-model-len, written with the worst JSON escaping)")
    http.add_argument("--max-request-objects", type=int, default=None,
                      help="JSON objects a request body may hold (messages, content parts, tools and each object of "
                           "their schemas count one each); a body with more gets 400 before its fields are validated, "
                           "which for tens of thousands of objects holds the event loop and starves other requests "
                           f"(default: {MIN_DEFAULT_REQUEST_OBJECTS:,}, or one per {TOKENS_PER_DEFAULT_OBJECT} tokens "
                           "of --max-model-len if more)")
    http.add_argument("--max-request-values", type=int, default=None,
                      help="JSON values a request body may hold (token ids, strings, numbers: every array element "
                           "and field counts one); a body with more gets 400 before it is validated (default: "
                           f"{MIN_DEFAULT_REQUEST_VALUES:,}, or two token-id prompts of --max-model-len tokens if "
                           "more)")
    add_chat_args(http)
    add_http_args(http)
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="run chat templates that requests supply (chat_template_kwargs.chat_template) in a "
                           "sandboxed process with time, memory, loop and output limits; without it they get 400")
    http.add_argument("--cache-isolation", choices=("none", "user", "api-key"), default="none",
                      help="'user': a request without cache_salt is salted by its user field, so tenants share no "
                           "checkpoint or KV block and cached_tokens reveals nothing across them; 'api-key': by the "
                           "API key it presented (needs --api-key) (default: none)")
    http.add_argument("--allowed-origins", type=_json_strings, default=["*"], metavar="JSON",
                      help="browser origins that may call the API (CORS), a JSON list as vLLM's; '[]': none "
                           "(default: [\"*\"])")
    http.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                      help="HTTP methods a cross-origin request may use, a JSON list (default: [\"*\"])")
    http.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                      help="headers a cross-origin request may send, a JSON list (default: [\"*\"])")
    http.add_argument("--allow-credentials", action="store_true",
                      help="let cross-origin requests carry credentials (cookies, authorization) (default: off)")
    http.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer <KEY>' (any of the keys given) on every route but /health "
                           "and /metrics, else 401; each key is a client for admission and checkpoint shares "
                           "(default: $FORKPOINT_API_KEY, else no key)")
    http.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                      help="run the engine (model, scheduler, step loop) in a process of its own, as vLLM's engine "
                           "core: the HTTP handlers, chat templates and tokenisation stay here, and no request's "
                           "Python work takes the GIL the step loop needs (default: off, one process)")
    http.add_argument("--gil-switch-interval-ms", type=_positive_float, default=None, metavar="MS",
                      help="with --engine-process: the Python interpreter's GIL switch interval in both processes, "
                           "the longest a thread that wants the GIL waits for the thread holding it; every message "
                           "through the pipe waits for it at each thread it passes (default: "
                           f"{DEFAULT_GIL_SWITCH_INTERVAL_MS}; CPython's own: 5)")
    http.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic stats line (throughput, queues, pools, checkpoint reuse) in the log")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                      help="log level (default: info)")
    replicas = serve.add_argument_group("replicas (Ray Serve; pip install forkpoint[serve])")
    replicas.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                          help="engine replicas, each on its own GPU (or CPU process), behind this endpoint; requests "
                               "go to the replica holding their checkpoint (default: 1, no Ray)")
    replicas.add_argument("--ray-address", default=None,
                          help="join this Ray cluster for the replicas (default: start a local Ray instance)")
    serve.set_defaults(func=run_serve)

    generate = commands.add_parser("generate", help="generate for one-off prompts and print them with timings",
                                   description="Generate for the given prompts (offline, no server) and print "
                                               "each output with its reuse, then load and generation timings.")
    add_engine_args(generate, positional_model=False)
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (markers work as usual)")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default: 16)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    sampling.add_argument("--top-k", type=int, default=-1, help="-1 disables top-k (default: -1)")
    sampling.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (default: none)")
    sampling.add_argument("--chat", action="store_true",
                          help="send each prompt as a user message through the chat template")
    generate.set_defaults(func=run_generate)

    bench = commands.add_parser("bench", help="benchmark 1-to-N prefix sharing, checkpoints on vs off",
                                description="Run the 1-to-N workload (an anchor, a marker, N suffixes) offline or "
                                            "against a server; print a table and write JSON and a PNG plot.")
    add_engine_args(bench, positional_model=False, title="engine (offline runs; ignored with --url)")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)
    return parser


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (tokenizer, model, engine: ~380k tracked objects with the
    Qwen3.5 tokenizer) out of the garbage collector's reach. A full collection while serving would
    otherwise traverse them all with every thread stopped (measured on CPU: 250 ms, 0.003 ms frozen),
    stalling every stream at once; vLLM freezes its start-up heap the same way."""
    gc.collect()
    gc.freeze()


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, else $FORKPOINT_API_KEY (one key, as vLLM's VLLM_API_KEY; it keeps the key out of `ps`)."""
    if args.api_key:
        return tuple(args.api_key)
    from_env = os.environ.get("FORKPOINT_API_KEY", "")
    return (from_env,) if from_env else ()


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from `forkpoint serve`'s parsed arguments."""
    return ServerConfig(
        served_model_name=args.served_model_name[0] if args.served_model_name else _model_name(args.model),
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                        args.allow_credentials),
        max_waiting_requests=args.max_waiting_requests, marker_policy=MarkerPolicy(args.marker_in_user_content),
        shutdown_timeout_s=args.shutdown_timeout, max_request_bytes=args.max_request_bytes,
        max_request_objects=args.max_request_objects, max_request_values=args.max_request_values,
        log_stats=not args.disable_log_stats, trust_request_chat_template=args.trust_request_chat_template,
        cache_isolation=args.cache_isolation, max_num_seqs_per_request=args.max_num_seqs_per_request,
        max_waiting_per_user=args.max_waiting_per_user, tokenizer_workers=args.tokenizer_workers,
        api_keys=api_keys(args),
        token_cache_bytes=int(args.token_cache_mib * 2**20),
        responses_store_bytes=int(args.responses_store_mib * 2**20), chat_template=args.chat_template,
        tool_formats=tool_call_formats(args.tool_call_parser),
    )


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from forkpoint import LLM
    from forkpoint.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = server_config(args)
    check_engine_kwargs(server_engine_kwargs(args, replicas=True))
    http = uvicorn_options(args)  # before anything loads: a TLS key without its certificate is refused here
    if args.data_parallel_size != 1 or args.ray_address is not None:
        if args.engine_process:
            raise ValueError("--engine-process is for one engine; replicas (--data-parallel-size, --ray-address) "
                             "already run each engine in its own process: drop --engine-process")
        from forkpoint.server.replicas.launch import serve_replicas

        return serve_replicas(args, config, server_engine_kwargs(args, replicas=True), http)
    if args.gil_switch_interval_ms is not None and not args.engine_process:
        raise ValueError("--gil-switch-interval-ms sets the switch interval of --engine-process's two processes; a "
                         "one-process server keeps CPython's: add --engine-process, or drop --gil-switch-interval-ms")
    if args.engine_process:
        return _serve_engine_process(args, config, http)
    start = time.perf_counter()
    llm = LLM(**server_engine_kwargs(args))
    app = build_app(llm, config, load_time_s=time.perf_counter() - start)
    freeze_startup_heap()
    uvicorn.run(app, **http)
    return 0


def _serve_engine_process(args: argparse.Namespace, config: ServerConfig, http: dict) -> int:
    """`forkpoint serve --engine-process`: the engine in a spawned process, this one serving HTTP."""
    import uvicorn

    from forkpoint.server.app import build_process_app
    from forkpoint.server.process_worker import start_engine_process

    switch_ms = args.gil_switch_interval_ms or DEFAULT_GIL_SWITCH_INTERVAL_MS
    # this process's entry point sets its own interpreter's interval (the reader, the sender and the event loop
    # each wait up to one for the GIL on every crossing); the engine process sets its own at its entry point
    sys.setswitchinterval(switch_ms / 1e3)
    logging.getLogger("forkpoint.server").info("GIL switch interval %g ms in the server and engine processes",
                                               switch_ms)
    worker, front = start_engine_process(server_engine_kwargs(args), served_model_name=config.served_model_name,
                                         marker_policy=config.marker_policy, log_level=args.log_level,
                                         switch_interval_s=switch_ms / 1e3)
    try:
        app = build_process_app(worker, front, config)
        freeze_startup_heap()
        uvicorn.run(app, **http)
    finally:  # after the app's own shutdown this returns at once; else (the app never started) it stops the engine
        worker.shutdown(timeout_s=0.0)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from forkpoint import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    done = time.perf_counter()
    for prompt, output in zip(args.prompts, outputs):
        completion = output.outputs[0]
        print(f"prompt ({len(output.prompt_token_ids)} tokens, {output.num_cached_tokens} reused): {prompt!r}")
        print(f"output ({len(completion.token_ids)} tokens, {completion.finish_reason}): {completion.text!r}\n")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    elapsed = done - loaded
    print(f"load {loaded - start:.2f} s | generate {elapsed:.2f} s for {len(outputs)} prompt(s): "
          f"{prompt_tokens} prompt tokens, {generated} generated ({generated / elapsed:.1f} tokens/s)")
    metrics = llm.metrics()
    if metrics.get("spec_verifications"):
        print(f"speculative: mean acceptance length {metrics['spec_mean_acceptance_length']:.2f}, "
              f"{metrics['spec_accepted_tokens']} of {metrics['spec_draft_tokens']} draft tokens accepted")
    return 0


def _positive_float(text: str) -> float:
    """A number > 0, as an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's --allowed-origins form), as an argparse type."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): pass a list such as '[\"https://example.com\"]'") from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty strings, got {text}")
    return value


def _model_name(model: str | None) -> str:
    """The served name: a local directory's name, a Hub name as given (as vLLM serves it)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return (path.name or model) if path.exists() else model


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # configuration errors name the problem: no traceback needed
        print(f"forkpoint {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
