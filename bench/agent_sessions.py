"""Agent sessions through the HTTP server, as an agent framework drives it (issue 26's workload).

S sessions run concurrently, T turns each, through `/v1/chat/completions` (or `--api`'s endpoint; streaming,
the requests an OpenAI or Anthropic client sends, over httpx: the device has no `openai` package): a shared
system prompt, a per-session document, then per turn the assistant's reply sent back as text (with a tool
call) and a tool result. Phase A is the workload as is; phase B runs the same
shapes on the same server with a unique nonce opening every request, so nothing can be reused.

Per turn (over sessions): prompt tokens, cached tokens (`usage.prompt_tokens_details.cached_tokens`),
the tokens the turn shares with the session's previous turn (the longest common prefix of the rendered
prompts' token ids, from `/tokenize`, asked after the phase's wall time: an agent framework sends none;
turn 0: with the other sessions' first prompts), TTFT p50/p90 and
the miss reasons the server gave (`cache_miss_reason`); totals per phase, and the server's
`forkpoint_cache_misses_total` by reason. Per phase: the server's time to first token by part (mean ms per
request: the HTTP body read and validated before the handler, prompt rendered and tokenised, hand-off to
the engine thread, queue, prefill, delivery; the
`forkpoint_request_<part>_time_seconds` histograms; per turn, p50 and the steps queued behind, from the
server's debug lines with `--server-log FILE --server-log-level debug`), its wall time and the server's generation
throughput (`forkpoint_generation_tokens_total`, read every --poll-s) over the phase and per --window-s
window (10 s; the worst window is issue 32's measure). Each phase's table is printed, and the JSON so far
written, as soon as the phase ends; JSON + PNG under --out (bench/results/) at the end.

`--api` picks the endpoint; the conversation is the same, streamed, and so are the records:
  chat               `/v1/chat/completions` (the default).
  responses          `/v1/responses` as a store-less client (Codex) sends it: `store: false`, the system
                     prompt as `instructions`, the whole conversation as `input` items (per earlier turn the
                     reply as an assistant `output_text` message, the call as a `function_call` item, its
                     result as a `function_call_output` item), `reasoning.effort` "none" for thinking off.
  responses-chained  the same with `store: true`; a turn after the first sends `previous_response_id`, the
                     instructions and only the call and its result: the call joins the stored reply's assistant
                     message (responses_input.py), so the server renders the prompt `responses` sends whole.
  messages           `/v1/messages` (Anthropic): `system`, assistant turns as [text, tool_use] blocks, results as
                     a user message's tool_result block, `thinking: {"type": "disabled"}` for thinking off.
Responses and Messages have no `ignore_eos` / `min_tokens`: their replies may end before --reply-tokens (an
end-of-sequence token), so turns may differ in length from chat's. The `/tokenize` body is the chat messages the
server renders for the API's request (`rendered_messages`); each turn's row counts the requests whose `/tokenize`
count differs from the reported prompt tokens (`tokenize_mismatches`, 0 when the shared column is right).

`--restart` (started servers only): the server runs with `--checkpoint-dir` (a scratch directory);
after phase A it is stopped and started again on the same directory, and phase R sends the first
turn of new sessions (same system prompt, new documents): its cached tokens show what the restarted
server reused from disk (then phase B runs on the restarted server).

Usage:
    python bench/agent_sessions.py                                  # CPU, embedded default model, small
    python bench/agent_sessions.py --sessions 2 --turns 3 --system-words 60 --doc-words 40 --tool-words 20
    python bench/agent_sessions.py --shape qwen3.5-35b-a3b --sessions 32 --turns 6 --system-words 1400 \\
        --doc-words 800 --tool-words 160 --reply-tokens 64 --server-arg=--device=cuda   # H200, dummy weights
    python bench/agent_sessions.py --url http://127.0.0.1:8000      # a server already running
    python bench/agent_sessions.py --api messages                   # the same sessions through /v1/messages
    python bench/agent_sessions.py --restart                        # + the first turn after a restart
    python bench/agent_sessions.py --tool-seconds 1.0               # tools that take ~1 s: sessions drift apart
    python bench/agent_sessions.py --server-log-level debug --server-log /tmp/server.log   # + TTFT by part per turn
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import ssl
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_info import code_version, machine_info  # noqa: E402
from plots import write_results  # noqa: E402
from served import start_server  # noqa: E402

from forkpoint.inputs.turns import common_prefix_length  # noqa: E402
from forkpoint.server.bench_cli import percentile  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up in the archive.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
WORDS = ("river", "basin", "flood", "level", "spring", "report", "station", "gauge", "rain", "upstream", "dam",
         "valley", "north", "south", "meter", "daily", "peak", "record", "season", "storm", "bank", "city")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Session:
    """One agent's conversation: messages grow by (reply + tool call, tool result) per turn."""

    def __init__(self, index: int, system: str, document: str, tool_results: list[str]) -> None:
        self.index = index
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": f"Document {index}: {document}\nAnswer questions about it."}]
        self.tool_results = tool_results

    def add_turn(self, turn: int, reply: str) -> None:
        call = {"id": f"call-{self.index}-{turn}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": f"fact {turn}"})}}
        self.messages += [{"role": "assistant", "content": reply, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": self.tool_results[turn]}]


def build_sessions(args: argparse.Namespace, documents_seed: int | None = None) -> list[Session]:
    """The sessions of `args.seed`; with `documents_seed`, the same system prompt and new documents."""
    rng = random.Random(args.seed)
    system = "You are a careful research agent. " + text(rng, args.system_words)
    if documents_seed is not None:
        rng = random.Random(documents_seed)
    return [Session(s, system, text(rng, args.doc_words), [text(rng, args.tool_words) for _ in range(args.turns)])
            for s in range(args.sessions)]


WIRE_EVENTS = {  # httpcore trace events -> request log keys (connect_* only on a new connection)
    "connection.connect_tcp.started": "connect_at", "connection.connect_tcp.complete": "connected_at",
    "http11.send_request_headers.started": "write_at", "http11.send_request_body.complete": "written_at",
}
API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "responses-chained": "/v1/responses",
             "messages": "/v1/messages"}
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat shape
ANTHROPIC_TOOLS = [{"name": tool["function"]["name"], "description": tool["function"]["description"],
                    "input_schema": tool["function"]["parameters"]} for tool in TOOLS]


def template_kwargs(args: argparse.Namespace) -> dict:
    """The chat_template_kwargs of --thinking (empty for unset: the template's default)."""
    return {} if args.thinking == "unset" else {"enable_thinking": args.thinking == "on"}


def chat_body(messages: list[dict], args: argparse.Namespace) -> dict:
    """The /v1/chat/completions body (without `model`); ignore_eos and min_tokens make every reply
    --reply-tokens long."""
    return {"messages": messages, "tools": TOOLS, "chat_template_kwargs": template_kwargs(args),
            "max_tokens": args.reply_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": args.reply_tokens}


def responses_items(messages: list[dict]) -> list[dict]:
    """The Responses input items of chat messages (no system message), as a store-less client (Codex)
    sends a conversation: a user message item, per assistant message its text as an output_text message
    item and its calls as function_call items, per tool message a function_call_output item."""
    items = []
    for message in messages:
        if message["role"] == "user":
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": message["content"]}]})
        elif message["role"] == "assistant":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": message["content"]}]})
            items += [{"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]} for call in message["tool_calls"]]
        else:
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
    return items


def responses_body(messages: list[dict], args: argparse.Namespace, store: bool) -> dict:
    """The /v1/responses body (without `model`) of the whole conversation: the system message as
    `instructions`, the rest as input items. Thinking on is effort "medium" (any effort but none and
    minimal turns it on, responses_input.py)."""
    thinking = {} if args.thinking == "unset" else {"reasoning": {"effort": "medium" if args.thinking == "on"
                                                                 else "none"}}
    return {"instructions": messages[0]["content"], "input": responses_items(messages[1:]), "tools": RESPONSES_TOOLS,
            "max_output_tokens": args.reply_tokens, "temperature": 0.0, "stream": True, "store": store, **thinking}


def chained_body(messages: list[dict], args: argparse.Namespace, previous_id: str) -> dict:
    """The /v1/responses body of a turn after the first with `previous_response_id`: the instructions
    (a stored response does not carry them over) and only the turn's new items, the fabricated call and
    its result (`Session.add_turn`'s two messages; the reply is the stored response's output)."""
    new = [item for item in responses_items(messages[-2:]) if item["type"] != "message"]
    return {**responses_body(messages, args, store=True), "input": new, "previous_response_id": previous_id}


def anthropic_messages(messages: list[dict]) -> list[dict]:
    """The Messages API's messages of chat messages (no system message): a user message as it is, an
    assistant message as blocks [text (left out when empty: Anthropic refuses empty text blocks), tool_use
    per call], a tool message as a user message with one tool_result block."""
    result = []
    for message in messages:
        if message["role"] == "user":
            result.append(message)
        elif message["role"] == "assistant":
            text = [{"type": "text", "text": message["content"]}] if message["content"] else []
            calls = [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                      "input": json.loads(call["function"]["arguments"])} for call in message["tool_calls"]]
            result.append({"role": "assistant", "content": text + calls})
        else:
            result.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": message["tool_call_id"],
                                                        "content": message["content"]}]})
    return result


def messages_body(messages: list[dict], args: argparse.Namespace) -> dict:
    """The /v1/messages body (without `model`): the system message as `system`, the rest as Anthropic
    messages; thinking on is type "adaptive" (the template's switch on, no budget to give)."""
    thinking = {} if args.thinking == "unset" else {"thinking": {"type": "adaptive" if args.thinking == "on"
                                                                 else "disabled"}}
    return {"system": messages[0]["content"], "messages": anthropic_messages(messages[1:]), "tools": ANTHROPIC_TOOLS,
            "max_tokens": args.reply_tokens, "temperature": 0.0, "stream": True, **thinking}


def request_body(messages: list[dict], args: argparse.Namespace, previous_id: str | None) -> dict:
    """The body (without `model`) of --api's request for the chat `messages`; `previous_id`: the
    previous turn's response id (responses-chained after the first turn)."""
    if args.api == "chat":
        return chat_body(messages, args)
    if args.api == "messages":
        return messages_body(messages, args)
    if previous_id is not None:
        return chained_body(messages, args, previous_id)
    return responses_body(messages, args, store=args.api == "responses-chained")


def rendered_messages(api: str, messages: list[dict]) -> list[dict]:
    """The chat messages the server renders for --api's request of the chat `messages` (a new list), for
    `/tokenize`: messages_input.py makes an assistant's text a list of text parts (None without text);
    the Responses modes render the chat messages themselves (with previous_response_id too: the call sent
    after a stored reply joins it, responses_input.py)."""
    if api == "messages":
        return [{**m, "content": [{"type": "text", "text": m["content"]}] if m["content"] else None}
                if m["role"] == "assistant" else m for m in messages]
    return list(messages)


@dataclass(frozen=True)
class PromptUsage:
    """A response's prompt side: its tokens, those read from checkpoints, why reuse stopped short (None: it did not)."""

    prompt_tokens: int
    cached_tokens: int
    miss_reason: str | None


@dataclass
class StreamReading:
    """What a response's stream said so far: its id, when the first text or thought came, the reply
    text, and the usage (set by the event that carries it)."""

    response_id: str | None = None
    first_at: float | None = None
    usage: PromptUsage | None = None
    reply: list[str] = field(default_factory=list)

    def add(self, piece: str, reply: bool) -> None:
        """A streamed text (`reply`) or thought piece."""
        if piece and self.first_at is None:
            self.first_at = time.perf_counter()
        if reply:
            self.reply.append(piece)


def read_chat_event(chunk: dict, reading: StreamReading) -> None:
    """`reading` after one chat.completion.chunk."""
    if "error" in chunk:
        raise RuntimeError(f"the stream failed: {chunk['error']}")
    reading.response_id = chunk.get("id", reading.response_id)
    for choice in chunk["choices"]:
        delta = choice.get("delta", {})
        reading.add(delta.get("reasoning_content") or "", reply=False)
        reading.add(delta.get("content") or "", reply=True)
    if chunk.get("usage"):
        details = chunk["usage"].get("prompt_tokens_details") or {}
        reading.usage = PromptUsage(chunk["usage"]["prompt_tokens"], details.get("cached_tokens") or 0,
                                    details.get("cache_miss_reason"))


def read_responses_event(event: dict, reading: StreamReading) -> None:
    """`reading` after one Responses stream event (the delta events' text, the final event's usage)."""
    kind = event["type"]
    if kind in ("error", "response.failed"):
        raise RuntimeError(f"the stream failed: {event}")
    if kind == "response.created":
        reading.response_id = event["response"]["id"]
    elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
        reading.add(event["delta"], reply=kind == "response.output_text.delta")
    elif kind in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens ended it
        usage = event["response"]["usage"]
        details = usage["input_tokens_details"]
        reading.usage = PromptUsage(usage["input_tokens"], details["cached_tokens"], details.get("cache_miss_reason"))


def read_messages_event(event: dict, reading: StreamReading) -> None:
    """`reading` after one Messages stream event; Anthropic's usage counts the cached tokens apart: the
    prompt is input_tokens + cache_read_input_tokens."""
    kind = event["type"]
    if kind == "error":
        raise RuntimeError(f"the stream failed: {event}")
    if kind == "message_start":
        reading.response_id = event["message"]["id"]
    elif kind == "content_block_delta" and event["delta"]["type"] in ("text_delta", "thinking_delta"):
        delta = event["delta"]
        reading.add(delta.get("text") or delta.get("thinking") or "", reply=delta["type"] == "text_delta")
    elif kind == "message_delta":
        usage = event["usage"]
        reading.usage = PromptUsage(usage["input_tokens"] + usage["cache_read_input_tokens"],
                                    usage["cache_read_input_tokens"], usage.get("cache_miss_reason"))


READERS = {"chat": read_chat_event, "responses": read_responses_event, "responses-chained": read_responses_event,
           "messages": read_messages_event}


async def one_request(http: httpx.AsyncClient, model: str, messages: list[dict], args: argparse.Namespace,
                      previous_id: str | None = None) -> dict:
    """One streamed request of --api (the chat `messages` in that API's shape, `request_body`) as an
    OpenAI or Anthropic client sends it (plain httpx and SSE: the device has no `openai` package). The
    record keeps the `/tokenize` body of the prompt the server renders (`tokenize_body`): its token ids are
    asked after the phase (`tokenize_records`), not here: an agent framework sends no `/tokenize`, and at
    256 sessions in lock-step 256 of them between turns competed with the next turn's requests (asked
    before the request, it would also warm the server's token cache, inputs/segment_tokens.py)."""
    path = API_PATHS[args.api]
    request = {**request_body(messages, args, previous_id), "model": model}
    begin = time.perf_counter()
    reading = StreamReading()
    wire: dict[str, float] = {}

    async def trace(event: str, info: dict) -> None:  # httpcore's trace extension: when this request hit the wire
        if event in WIRE_EVENTS:
            wire[WIRE_EVENTS[event]] = time.perf_counter()

    async with http.stream("POST", path, json=request, extensions={"trace": trace}) as response:
        headers = time.perf_counter()  # the server answers with headers once the engine took the prompt
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                READERS[args.api](json.loads(line[len("data: "):]), reading)
    end = time.perf_counter()
    if reading.usage is None:
        raise RuntimeError(f"{path}'s stream ended without usage")
    return {"prompt_tokens": reading.usage.prompt_tokens, "cached_tokens": reading.usage.cached_tokens,
            "miss_reason": reading.usage.miss_reason, "ttft_s": (reading.first_at or end) - begin,
            "headers_s": headers - begin, "latency_s": end - begin, "reply": "".join(reading.reply),
            "id": reading.response_id, "sent_at": begin, "headers_at": headers, "first_at": reading.first_at,
            "end_at": end, **wire,
            "tokenize_body": {"messages": rendered_messages(args.api, messages), "tools": TOOLS,
                              "chat_template_kwargs": template_kwargs(args)}}


async def tokenize_records(http: httpx.AsyncClient, records: list[dict], concurrency: int = 16) -> None:
    """Each record's prompt token ids (`ids`) and their count (`tokenized_tokens`), from `/tokenize` with its
    request's body, after the phase."""
    gate = asyncio.Semaphore(concurrency)

    async def one(record: dict) -> None:
        async with gate:
            response = await http.post("/tokenize", json=record.pop("tokenize_body"))
        response.raise_for_status()
        record["ids"] = response.json()["tokens"]
        record["tokenized_tokens"] = len(record["ids"])

    await asyncio.gather(*(one(r) for r in records))


@dataclass(frozen=True)
class ServerSample:
    """What the poller reads from `/metrics` at one time: generated tokens so far, the KV pool's used
    fraction, and the evictions of a live session's newest checkpoint so far."""

    time: float
    generated: float
    kv_used_fraction: float
    evicted_session_latest: float


def server_sample(metrics_text: str, at: float) -> ServerSample:
    """A `ServerSample` from a `/metrics` page (`forkpoint_generation_tokens_total`,
    `forkpoint_pool_used/capacity{pool="kv_blocks"}`, `forkpoint_checkpoints_evicted_session_latest_total`;
    a series the server lacks counts 0, but the generated tokens must be there)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if family.name in ("forkpoint_pool_used", "forkpoint_pool_capacity"):
                if sample.labels.get("pool") == "kv_blocks":
                    totals[family.name] = sample.value
            elif sample.name.endswith("_total"):
                totals[family.name] = totals.get(family.name, 0.0) + sample.value
    if "forkpoint_generation_tokens" not in totals:
        raise RuntimeError("/metrics has no forkpoint_generation_tokens_total")
    capacity = totals.get("forkpoint_pool_capacity", 0.0)
    return ServerSample(at, totals["forkpoint_generation_tokens"],
                        totals.get("forkpoint_pool_used", 0.0) / capacity if capacity else 0.0,
                        totals.get("forkpoint_checkpoints_evicted_session_latest", 0.0))


def latest_evictions(samples: list[ServerSample], kv_threshold: float = 0.8) -> tuple[float, float]:
    """(evictions of a live session's newest checkpoint between the first and last sample, those of
    them in intervals whose both ends read the KV pool below `kv_threshold` full): issue 26 asks for
    none while KV is below 80%."""
    below = sum(b.evicted_session_latest - a.evicted_session_latest for a, b in zip(samples, samples[1:])
                if a.kv_used_fraction < kv_threshold and b.kv_used_fraction < kv_threshold)
    return samples[-1].evicted_session_latest - samples[0].evicted_session_latest, below


async def poll_server(url: str, samples: list[ServerSample], stop: asyncio.Event, interval_s: float) -> None:
    """Append a `ServerSample` every `interval_s` until `stop` is set, on a connection of its own (the
    sessions' pool never delays it)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                return
            except TimeoutError:
                samples.append(server_sample((await http.get("/metrics")).text, time.perf_counter()))


async def watch_loop_lag(lags: list[tuple[float, float]], stop: asyncio.Event, interval_s: float = 0.05) -> None:
    """Append (time, lag) whenever this client's event loop woke more than 20 ms after `interval_s`: a
    client too busy to send is told apart from a server slow to take the request."""
    while not stop.is_set():
        due = time.perf_counter() + interval_s
        await asyncio.sleep(interval_s)
        lag = time.perf_counter() - due
        if lag > 0.02:
            lags.append((due, lag))


def generation_windows(samples: list[tuple[float, float]], width_s: float) -> list[float]:
    """Generation tokens/s in consecutive windows of `width_s` seconds from the first sample, the
    counter read at each window edge by linear interpolation between the samples around it (samples:
    (time, counter), time ascending, at least 2). Only whole windows count; a phase shorter than one
    window is one window over all samples."""
    times = [t for t, _ in samples]
    counts = [c for _, c in samples]

    def at(t: float) -> float:
        i = max(j for j in range(len(times)) if times[j] <= t)
        if i == len(times) - 1:
            return counts[i]
        fraction = (t - times[i]) / (times[i + 1] - times[i])
        return counts[i] + fraction * (counts[i + 1] - counts[i])

    whole = int((times[-1] - times[0]) // width_s)
    if whole == 0:
        return [(counts[-1] - counts[0]) / max(times[-1] - times[0], 1e-9)]
    edges = [times[0] + k * width_s for k in range(whole + 1)]
    return [(at(b) - at(a)) / width_s for a, b in zip(edges, edges[1:])]


def max_shared_with_others(prompts: list[list[int]]) -> list[int]:
    """For each prompt, the longest prefix it shares with any other one: that other is always one of
    its neighbours in sorted order, so this costs a sort, not all pairs (256 sessions: 65k pairs)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    best = [0] * len(prompts)
    for a, b in zip(order, order[1:]):
        shared = common_prefix_length(prompts[a], prompts[b])
        best[a] = max(best[a], shared)
        best[b] = max(best[b], shared)
    return best


async def run_phase(url: str, model: str, args: argparse.Namespace, nonce: bool,
                    documents_seed: int | None = None) -> dict:
    """All sessions concurrently, each turn after the one before; returns per-request records, the
    wall time and the server's generation throughput per window (`/metrics`, polled)."""
    sessions = build_sessions(args, documents_seed)
    records: list[dict] = []
    samples: list[ServerSample] = []
    stop = asyncio.Event()
    # One client per session, as each agent holds its own: one client shared by hundreds of streams spends
    # its event loop in httpcore 1.0's pool bookkeeping (quadratic in its connections, and every request
    # arriving in one loop pass is first handed the same idle connection), which held requests 5-6 s (p50)
    # before they were written at 256 sessions (docs/server.md, session 18). The clients are made before the
    # phase starts, with one TLS context: each would otherwise load the CA bundle (~25 ms, 6.5 s for 256).
    tls = ssl.create_default_context()
    async with contextlib.AsyncExitStack() as clients, httpx.AsyncClient(base_url=url, timeout=60) as http:
        own = [await clients.enter_async_context(httpx.AsyncClient(base_url=url, timeout=3600, verify=tls))
               for _ in sessions]

        async def drive(session: Session, http: httpx.AsyncClient) -> None:
            previous = None
            tool_time = random.Random(args.seed * 7919 + session.index)  # the same delays in every phase
            for turn in range(args.turns):
                if turn and args.tool_seconds > 0:  # the tool runs before its result comes back
                    await asyncio.sleep(tool_time.expovariate(1 / args.tool_seconds))
                messages = session.messages
                if nonce:  # a unique first token run: nothing of this request was ever computed
                    first = messages[0]
                    messages = [{**first, "content": f"[{uuid.uuid4().hex}] " + first["content"]}, *messages[1:]]
                chained = args.api == "responses-chained" and previous is not None
                record = await one_request(http, model, messages, args, previous["id"] if chained else None)
                record.update(session=session.index, turn=turn, previous=previous)
                records.append(record)
                previous = record
                session.add_turn(turn, record["reply"])

        samples.append(server_sample((await http.get("/metrics")).text, time.perf_counter()))
        parts_before = await asyncio.to_thread(first_token_parts, url)
        poller = asyncio.create_task(poll_server(url, samples, stop, args.poll_s))
        lags: list[tuple[float, float]] = []
        watcher = asyncio.create_task(watch_loop_lag(lags, stop))
        start = time.perf_counter()
        try:
            await asyncio.gather(*(drive(s, c) for s, c in zip(sessions, own)))
        finally:
            wall = time.perf_counter() - start
            stop.set()
            await poller
            await watcher
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:  # after the last token of the phase
        samples.append(server_sample((await http.get("/metrics")).text, time.perf_counter()))
        await tokenize_records(http, records)
    first_records = [r for r in records if r["turn"] == 0]
    for r, shared in zip(first_records, max_shared_with_others([r["ids"] for r in first_records])):
        r["shared_tokens"] = shared
    for r in records:
        if r["previous"] is not None:
            r["shared_tokens"] = common_prefix_length(r["previous"]["ids"], r["ids"])
    windows = generation_windows([(x.time, x.generated) for x in samples], args.window_s)
    evicted_latest, evicted_latest_below = latest_evictions(samples)
    parts = mean_parts_ms(parts_before, first_token_parts(url))
    logged = logged_parts(args.server_log)
    for r in records:
        r["ttft_parts_ms"] = logged.get(r["id"])
    first, last = samples[0], samples[-1]
    return {"ttft_parts_mean_ms": parts, "wall_s": wall, "generated_tokens": last.generated - first.generated,
            "generation_tokens_per_s": (last.generated - first.generated) / (last.time - first.time),
            "evicted_session_latest": evicted_latest, "evicted_session_latest_kv_below_80": evicted_latest_below,
            "kv_used_fraction_max": max(x.kv_used_fraction for x in samples), "client_loop_lag": lags,
            "generation_windows_tokens_per_s": windows, "window_s": args.window_s,
            "requests": [{k: v for k, v in r.items() if k not in ("ids", "previous", "reply")} for r in records]}


def parts_p50(parts: list[dict[str, float]]) -> dict[str, float]:
    """The median of each part (and of the steps queued behind and to the first token) over requests, of
    the keys every request has (a server before the prefill steps were logged has none); empty without any."""
    return {key: percentile([p[key] for p in parts], 50) for key in parts[0]
            if all(key in p for p in parts)} if parts else {}


def logged_phase(args: argparse.Namespace, name: str, phase: dict) -> dict:
    """`phase`, its requests' times appended to --request-log (when given) as one JSON line each."""
    if args.request_log is not None:
        keys = ("id", "session", "turn", "sent_at", "headers_at", "first_at", "end_at", *WIRE_EVENTS.values())
        with open(args.request_log, "a") as log:
            for r in phase["requests"]:
                log.write(json.dumps({"phase": name, **{k: r[k] for k in keys if k in r}}) + "\n")
            for at, lag in phase["client_loop_lag"]:
                log.write(json.dumps({"phase": name, "client_loop_lag_s": lag, "at": at}) + "\n")
    return phase


def summarise(phase: dict, turns: int) -> dict:
    rows = []
    for turn in range(turns):
        rs = [r for r in phase["requests"] if r["turn"] == turn]
        shared = sum(r["shared_tokens"] for r in rs)
        reasons: dict[str, int] = {}
        for r in rs:
            key = r["miss_reason"] or "none"
            reasons[key] = reasons.get(key, 0) + 1
        rows.append({"turn": turn, "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                     "tokenize_mismatches": sum(r["tokenized_tokens"] != r["prompt_tokens"] for r in rs),
                     "cached_tokens": sum(r["cached_tokens"] for r in rs) / len(rs),
                     "shared_tokens": sum(r["shared_tokens"] for r in rs) / len(rs),
                     "cached_of_shared": sum(r["cached_tokens"] for r in rs) / max(shared, 1),
                     "ttft_p50_ms": 1000 * percentile([r["ttft_s"] for r in rs], 50),
                     "ttft_p90_ms": 1000 * percentile([r["ttft_s"] for r in rs], 90), "miss_reasons": reasons,
                     "headers_p50_ms": 1000 * percentile([r["headers_s"] for r in rs], 50),
                     "ttft_parts_p50_ms": parts_p50([r["ttft_parts_ms"] for r in rs if r.get("ttft_parts_ms")])})
    requests = phase["requests"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    windows = phase["generation_windows_tokens_per_s"]
    return {"turns": rows, "ttft_parts_mean_ms": phase["ttft_parts_mean_ms"], "wall_s": phase["wall_s"],
            "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "shared_tokens": sum(r["shared_tokens"] for r in requests),
            "generated_tokens": phase["generated_tokens"], "generation_tokens_per_s": phase["generation_tokens_per_s"],
            "window_s": phase["window_s"], "generation_windows_tokens_per_s": windows,
            "worst_window_tokens_per_s": min(windows), "evicted_session_latest": phase["evicted_session_latest"],
            "evicted_session_latest_kv_below_80": phase["evicted_session_latest_kv_below_80"],
            "kv_used_fraction_max": phase["kv_used_fraction_max"]}


def scrape_misses(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name == "forkpoint_cache_misses":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    values[sample.labels["reason"]] = sample.value
    return values


FIRST_TOKEN_PARTS = ("request", "prompt", "handoff", "queue", "prefill", "delivery")  # server/metrics.py


def first_token_parts(url: str) -> dict[str, tuple[float, float]]:
    """The server's time to first token by part so far: {part: (seconds summed, prompts)} from the
    `forkpoint_request_<part>_time_seconds` histograms (empty for a server without them)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        part = family.name.removeprefix("forkpoint_request_").removesuffix("_time_seconds")
        if part in FIRST_TOKEN_PARTS:
            samples = {sample.name.rsplit("_", 1)[-1]: sample.value for sample in family.samples}
            values[part] = (samples["sum"], samples["count"])
    return values


def mean_parts_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean milliseconds per prompt of each part between two `first_token_parts` readings."""
    means = {}
    for part, (seconds, count) in after.items():
        seconds_before, count_before = before.get(part, (0.0, 0.0))
        means[part] = 1000 * (seconds - seconds_before) / max(count - count_before, 1)
    return means


PARTS_LINE = re.compile(r"request (\S+)-0: first token after [\d.]+ ms: (?:request ([\d.]+), )?prompt ([\d.]+), "
                        r"hand-off ([\d.]+), queue ([\d.]+) \((\d+) steps\), prefill ([\d.]+)(?: \((\d+) steps\))?, "
                        r"delivery ([\d.]+) ms")
PARTS = ("request", "prompt", "handoff", "queue", "queued_steps", "prefill", "prefill_steps", "delivery")


def logged_parts(path: str | None) -> dict[str, dict[str, float]]:
    """Per response id, the time to first token by part (ms), the steps queued behind and the steps from its
    first scheduling to its first token (1: the step that first scheduled it sampled it; left out when the
    server did not log them), from the debug lines of a server log (`--server-log` with `--server-log-level
    debug`); empty without them."""
    if path is None or not os.path.exists(path):
        return {}
    parts = {}
    for match in map(PARTS_LINE.search, Path(path).read_text(errors="replace").splitlines()):
        if match:
            parts[match.group(1)] = {part: float(value) for part, value in zip(PARTS, match.groups()[1:])
                                     if value is not None}
    return parts


def server_options(args: argparse.Namespace) -> list[str]:
    return ["--log-level", args.server_log_level, "--max-waiting-requests", str(max(args.sessions * 4, 64)),
            *args.server_arg]


def traced(args: argparse.Namespace) -> dict:
    """start_server's launcher and environment for --step-trace (none without it)."""
    if args.step_trace is None:
        return {}
    return {"launcher": [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_trace.py")],
            "env": {**os.environ, "FORKPOINT_STEP_TRACE": args.step_trace, "FORKPOINT_STEP_TRACE_COMPACT": "1"}}


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM: the server shuts down gracefully (the disk tier's writer drains at exit)."""
    process.terminate()
    process.wait(timeout=120)


def model_dir_for(args: argparse.Namespace, scratch: Path) -> str | None:
    """--model, or for --shape a config directory served with dummy weights, or None (the embedded model)."""
    if args.shape == "default":
        return args.model
    from e2e_gpu import full_config, make_model_dir, tiny_config
    from e2e_gpu_shapes import with_fp8

    cfg = {"qwen3.5-35b-a3b": full_config, "qwen3.5-35b-a3b-fp8": lambda: with_fp8(full_config()),
           "qwen3.5-tiny": tiny_config}[args.shape]()
    args.server_arg = ["--load-format", "dummy", *args.server_arg]
    return str(make_model_dir(cfg, scratch / args.shape))


def table(name: str, summary: dict) -> str:
    lines = [f"{name}: {summary['wall_s']:.1f} s, prompt {summary['prompt_tokens']:,} tokens, cached "
             f"{summary['cached_tokens']:,}, computed {summary['computed_tokens']:,}; generated "
             f"{summary['generated_tokens']:,.0f} tokens, {summary['generation_tokens_per_s']:,.1f}/s (server), worst "
             f"{summary['window_s']:g}-s window {summary['worst_window_tokens_per_s']:,.1f}/s of "
             f"{len(summary['generation_windows_tokens_per_s'])}; a live session's newest checkpoint evicted "
             f"{summary['evicted_session_latest']:.0f} times ({summary['evicted_session_latest_kv_below_80']:.0f} "
             f"with KV below 80%, KV at most {100 * summary['kv_used_fraction_max']:.1f}% full)",
             f"{'turn':>4} {'prompt':>8} {'shared':>8} {'cached':>8} {'cached/shared':>13} {'TTFT p50':>9} "
             f"{'TTFT p90':>9}  miss reasons"]
    for row in summary["turns"]:
        lines.append(f"{row['turn']:>4} {row['prompt_tokens']:>8.0f} {row['shared_tokens']:>8.0f} "
                     f"{row['cached_tokens']:>8.0f} {100 * row['cached_of_shared']:>12.1f}% "
                     f"{row['ttft_p50_ms']:>7.0f}ms {row['ttft_p90_ms']:>7.0f}ms  "
                     + ", ".join(f"{k} {v}" for k, v in sorted(row["miss_reasons"].items())))
    mismatched = [row["turn"] for row in summary["turns"] if row["tokenize_mismatches"]]
    if mismatched:
        lines.append(f"/tokenize counted other than the server's prompt tokens at turns {mismatched}: the shared "
                     "column is not the rendered prompt's")
    for row in summary["turns"]:
        parts = row["ttft_parts_p50_ms"]
        if parts:
            lines.append(f"turn {row['turn']}: client's time to response headers p50 {row['headers_p50_ms']:.0f} ms; "
                         "time to first token by part (server log, p50 ms): "
                         + (f"request {parts['request']:.0f}, " if "request" in parts else "")
                         + f"prompt {parts['prompt']:.0f}, hand-off {parts['handoff']:.0f}, queue {parts['queue']:.0f} "
                         f"({parts['queued_steps']:.0f} steps), prefill {parts['prefill']:.0f}"
                         + (f" ({parts['prefill_steps']:.0f} steps)" if "prefill_steps" in parts else "")
                         + f", delivery {parts['delivery']:.0f}")
    if summary["ttft_parts_mean_ms"]:
        lines.append("time to first token by part (server, mean ms per request): " + ", ".join(
            f"{part} {ms:.1f}" for part, ms in summary["ttft_parts_mean_ms"].items()))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuse, none = res["reuse"]["turns"], res["no_reuse"]["turns"]
    turns = [r["turn"] for r in reuse]
    fig, (left, right, windows) = plt.subplots(1, 3, figsize=(16, 4))
    left.plot(turns, [r["ttft_p50_ms"] for r in reuse], "o-", label="reuse, p50")
    left.plot(turns, [r["ttft_p90_ms"] for r in reuse], "o--", label="reuse, p90")
    left.plot(turns, [r["ttft_p50_ms"] for r in none], "s-", label="no reuse (nonce), p50")
    left.set_xlabel("turn")
    left.set_ylabel("TTFT (ms)")
    left.legend()
    width = 0.4
    right.bar([t - width / 2 for t in turns], [r["shared_tokens"] for r in reuse], width, label="shared with previous")
    right.bar([t + width / 2 for t in turns], [r["cached_tokens"] for r in reuse], width, label="cached")
    right.plot(turns, [r["prompt_tokens"] for r in reuse], "k.-", label="prompt")
    right.set_xlabel("turn")
    right.set_ylabel("tokens per request (mean)")
    right.legend()
    for key, label, style in (("reuse", "reuse", "o-"), ("no_reuse", "no reuse (nonce)", "s-")):
        rates = res[key]["generation_windows_tokens_per_s"]
        width_s = res[key]["window_s"]
        windows.plot([width_s * (k + 0.5) for k in range(len(rates))], rates, style, label=label)
    windows.set_xlabel("time in the phase (s), window centres")
    windows.set_ylabel("generated tokens/s (server)")
    windows.set_ylim(bottom=0)
    windows.legend()
    fig.suptitle(f"agent sessions: {res['config']['sessions']} sessions x {res['config']['turns']} turns, "
                 f"{res['config']['shape']}, --api {res['config']['api']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model directory for the started server (default: embedded)")
    parser.add_argument("--shape", default="default",
                        choices=["default", "qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8", "qwen3.5-tiny"],
                        help="serve a config of these shapes with --load-format dummy (default: --model); "
                             "-fp8: the release's block-wise FP8 layout (fits an 80 GB card)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for `forkpoint serve`")
    parser.add_argument("--server-log-level", default="warning")
    parser.add_argument("--server-log", default=None,
                        help="the started server's output goes to this file (default: stderr); with --server-log-level "
                             "debug, each turn's time to first token by part (p50) is read from it (with --url: the "
                             "log of the running server)")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--step-trace", default=None,
                        help="the started server runs under bench/step_trace.py (compact lines: counts per step) and "
                             "appends one JSON line per step to this file")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300, help="shared system prompt length in words")
    parser.add_argument("--doc-words", type=int, default=150, help="per-session document length in words")
    parser.add_argument("--tool-words", type=int, default=60, help="tool result length in words")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens per assistant reply")
    parser.add_argument("--api", default="chat", choices=list(API_PATHS),
                        help="the endpoint the sessions speak (default: chat; see the module docstring)")
    parser.add_argument("--thinking", default="off", choices=["off", "on", "unset"],
                        help="chat_template_kwargs enable_thinking, or the API's switch (default: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-seconds", type=float, default=0.0,
                        help="mean seconds a tool runs before its result is sent (exponential, seeded per session, "
                             "the same in both phases; default 0: each turn follows the last reply at once, which "
                             "keeps sessions with equal replies in lock-step)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="agent_sessions", help="file name of the JSON and PNG (no suffix)")
    parser.add_argument("--window-s", type=float, default=10.0,
                        help="width of the windows of generation throughput (default: 10 s)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="how often /metrics is read (default: 0.5 s)")
    parser.add_argument("--request-log", default=None,
                        help="append one JSON line per request and phase to this file: ids, session, turn and the "
                             "client's send, headers, first-token and end times (time.perf_counter: on Linux the "
                             "clock of the server's time.monotonic, so they line up with --step-trace's times)")
    parser.add_argument("--phases", default="all", choices=["all", "reuse"],
                        help="reuse: stop after the reuse phase (and the restart's), no no-reuse phase")
    parser.add_argument("--restart", action="store_true",
                        help="serve with --checkpoint-dir, restart the server after phase A and send the first turn "
                             "of new sessions (same system prompt, new documents) before phase B")
    args = parser.parse_args(argv)
    if args.restart and args.url is not None:
        parser.error("--restart starts and restarts the server itself: leave out --url")

    res = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "url")},
           "machine": machine_info(), "code": code_version()}

    def phase_done(key: str, title: str, summary: dict) -> dict:
        """Print the phase's table at once and write the JSON so far: a run stopped later keeps it."""
        res[key] = summary
        print(table(f"{title}, --api {args.api}", summary), flush=True)
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"{args.name}.json").write_text(json.dumps(res, indent=1))
        return summary

    process = None
    server_log = open(args.server_log, "a") if args.server_log is not None and args.url is None else None  # noqa: SIM115
    with tempfile.TemporaryDirectory() as scratch:
        url = args.url
        model_dir = model_dir_for(args, Path(scratch)) if url is None else None
        if args.restart:
            args.server_arg = [*args.server_arg, "--checkpoint-dir", str(Path(scratch) / "checkpoints")]
        if url is None:
            process, url = start_server(server_options(args), model_dir, args.start_timeout, output=server_log,
                                        **traced(args))
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            before = scrape_misses(url)
            reuse = phase_done("reuse", "reuse", summarise(logged_phase(args, "reuse", asyncio.run(
                run_phase(url, model, args, nonce=False))), args.turns))
            after = scrape_misses(url)
            res["server_misses_reuse_phase"] = {k: after[k] - before.get(k, 0) for k in after}
            if args.restart:
                stop_server(process)
                process, url = start_server(server_options(args), model_dir, args.start_timeout, output=server_log,
                                            **traced(args))
                first_turn = argparse.Namespace(**{**vars(args), "turns": 1})
                phase_done("restart", "after a restart on the same --checkpoint-dir (first turn, new documents)",
                           summarise(logged_phase(args, "restart", asyncio.run(run_phase(
                               url, model, first_turn, nonce=False, documents_seed=args.seed + 1))), 1))
            if args.phases == "reuse":
                return res
            none = phase_done("no_reuse", "no reuse (a nonce opens every request)",
                              summarise(logged_phase(args, "no_reuse", asyncio.run(
                                  run_phase(url, model, args, nonce=True))), args.turns))
        finally:
            if process is not None:
                stop_server(process)
            if server_log is not None:
                server_log.close()
    print(f"computed prompt tokens: reuse {reuse['computed_tokens']:,} vs {none['computed_tokens']:,} "
          f"({none['computed_tokens'] / max(reuse['computed_tokens'], 1):.2f}x fewer); wall {reuse['wall_s']:.1f} s vs "
          f"{none['wall_s']:.1f} s ({reuse['wall_s'] / none['wall_s']:.2f}x); generation tokens/s: worst "
          f"{args.window_s:g}-s window {reuse['worst_window_tokens_per_s']:,.1f} vs "
          f"{none['worst_window_tokens_per_s']:,.1f}, phase {reuse['generation_tokens_per_s']:,.1f} vs "
          f"{none['generation_tokens_per_s']:,.1f}; server miss reasons (reuse phase): "
          f"{res['server_misses_reuse_phase']}")
    print("results:", write_results(res, args.out, args.name, plot))
    return res

if __name__ == "__main__":
    main()
