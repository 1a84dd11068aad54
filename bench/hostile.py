"""The hostile set (issue 27) against a live server: requests a careless or hostile client may send,
each run while a bystander streams, with what it did to the server.

Starts `forkpoint serve` (embedded default model unless --model; CPU when there is no GPU) on a
free loopback port, or uses --url (with --server-pid for the RSS columns). For every case:

    status       the HTTP status(es) of the case's request(s) (count x status)
    time         wall seconds of the case
    /health      the slowest and the 99th percentile of the /health probes sent every 100 ms while the
                 case ran, from a process of their own (bench/health_probe.py), and the slowest of the
                 same probes sent from the bench's own event loop ("bench loop": it measures that loop
                 too, busy with the case's requests and the bystander)
    RSS          the server's VmRSS before, its peak during (sampled every 50 ms) and 2 s after; kept =
                 after - before
    bystander    the largest gap between consecutive events (request start, then each streamed chunk) of
                 a client that keeps 8 streaming completions going while the case runs, and that gap
                 over the same client's gap during an idle interval (the baseline row); the JSON's
                 `extra` has its streamed chunks (one token each) during the case and their rate

The bystander's requests carry `user` "bystander" and the cases' "hostile" (two clients to the server's
per-client order, engine/fair_order.py); --anonymous sends none (every request its own client). The
bursts' notes have their requests' time p50 / p90 (1-token responses: their TTFT; disconnects_50: to
the first streamed chunk).

The issue's bar: no 500, /health under 250 ms, RSS kept under 200 MB, bystander gap within 2x of
its baseline. Writes bench/results/hostile_cpu.json and hostile_cpu.png.

Usage:
    python bench/hostile.py                                  # every case, embedded model
    python bench/hostile.py --cases baseline,prompt_logprobs_4k
    python bench/hostile.py --server-arg=--long-prefill-token-threshold --server-arg=512
    python bench/hostile.py --url http://127.0.0.1:8000 --server-pid 12345
    python bench/hostile.py --server-arg=--cache-isolation=user --server-arg=--marker-in-user-content=reject \
        --cases cross_tenant_user,marker_in_tool_description   # the notes' expectations follow these flags
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402
from served import start_server  # noqa: E402

MARKER = "<|mamba_checkpoint|>"
HEALTH_EVERY_S = 0.1
RSS_EVERY_S = 0.05
BYSTANDER_STREAMS = 8
BYSTANDER_TOKENS = 24
# the `user` fields (unless --anonymous): the bystander and the cases are two clients to the server
# (engine/fair_order.py orders a step's admissions by client)
BYSTANDER_USER, CASE_USER = "bystander", "hostile"
WARM_S = 3.0  # the bystander streams this long before a case starts
SETTLE_S = 2.0  # after a case, before the RSS "after" sample
LOOP_TEMPLATE = "{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
RANGE_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                  "{{ messages[0].content }}")
STR_TEMPLATE = "{{ 'a' * 3000000000 }}{{ messages[0].content }}"
MARKER_METRIC = 'forkpoint_checkpoints_created_by_kind_total{kind="marker"}'
LIMITS = {"health_ms": 250.0, "rss_kept_mib": 200.0, "gap_ratio": 2.0}


@dataclass
class Row:
    case: str
    what: str
    statuses: dict[str, int]
    time_s: float
    health_max_ms: float  # from the probe process
    health_p99_ms: float
    health_bench_loop_max_ms: float  # the same probes sent from the bench's event loop
    rss_before_mib: float | None
    rss_peak_mib: float | None
    rss_after_mib: float | None
    bystander_gap_s: float
    bystander_errors: int
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def rss_kept_mib(self) -> float | None:
        if self.rss_before_mib is None or self.rss_after_mib is None:
            return None
        return self.rss_after_mib - self.rss_before_mib


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------- probes
class Probes:
    """/health latency (from the bench's loop) and server RSS, sampled while a case runs."""

    def __init__(self, client: httpx.AsyncClient, pid: int | None) -> None:
        self.client, self.pid = client, pid
        self.health_ms: list[float] = []
        self.rss: list[float] = []

    async def health(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            begin = time.perf_counter()
            try:
                await self.client.get("/health", timeout=60)
            except httpx.HTTPError:
                pass
            self.health_ms.append(1000 * (time.perf_counter() - begin))
            await asyncio.sleep(HEALTH_EVERY_S)

    async def memory(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if (value := rss_mib(self.pid)) is not None:
                self.rss.append(value)
            await asyncio.sleep(RSS_EVERY_S)


class HealthProcess:
    """/health probes from a process of its own (bench/health_probe.py), sent while it runs."""

    def __init__(self, url: str) -> None:
        probe = Path(__file__).parent / "health_probe.py"
        self.process = subprocess.Popen([sys.executable, str(probe), url, str(HEALTH_EVERY_S)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def stop(self, start: float, end: float) -> list[float]:
        """Close the probe's stdin (its request in flight completes) and return the latencies (ms) of
        the probes in flight during [start, end) (time.monotonic())."""
        out, _ = await asyncio.to_thread(self.process.communicate, "", 120)  # "": closes its stdin
        samples = [line.split() for line in out.splitlines()]
        return [float(ms) for begin, ms, _ in samples if float(begin) < end and float(begin) + float(ms) / 1000 > start]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (nan for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Bystander:
    """Keeps `BYSTANDER_STREAMS` streaming completions going; records each stream's event times and
    counts its errors (a non-200 status, an in-band error event, a transport error)."""

    def __init__(self, client: httpx.AsyncClient, model: str, user: str | None) -> None:
        self.client, self.model, self.user = client, model, user
        self.gaps: list[tuple[float, float]] = []  # (from, to) between consecutive events of one stream
        self.errors = 0

    async def stream_forever(self, index: int, stop: asyncio.Event) -> None:
        body = {"model": self.model, "prompt": f"Bystander {index} tells a story:", "max_tokens": BYSTANDER_TOKENS,
                "temperature": 0.0, "stream": True, "ignore_eos": True, **_user(self.user)}
        while not stop.is_set():
            last = time.perf_counter()
            try:
                async with self.client.stream("POST", "/v1/completions", json=body, timeout=600) as response:
                    if response.status_code != 200:
                        self.errors += 1
                        await response.aread()
                        continue
                    async for line in response.aiter_lines():
                        if line.startswith('data: {"error"'):  # the stream ended in-band with an error
                            self.errors += 1
                        if line.startswith("data:"):
                            now = time.perf_counter()
                            self.gaps.append((last, now))
                            last = now
            except asyncio.CancelledError:
                self.gaps.append((last, time.perf_counter()))  # the gap still open when stopped
                raise
            except httpx.HTTPError:
                self.errors += 1

    def chunks(self, start: float, end: float) -> int:
        """Events (streamed chunks, one token each) that arrived within [start, end]."""
        return sum(1 for _, b in self.gaps if start <= b <= end)

    def largest_gap(self, start: float, end: float) -> float:
        """The largest gap that overlaps [start, end]."""
        return max((b - a for a, b in self.gaps if b > start and a < end), default=0.0)

    def largest_gap_span(self, start: float, end: float) -> list[float]:
        """(from, to) of that gap, time.perf_counter() (bench/step_trace.py logs steps on the same clock)."""
        return list(max(((a, b) for a, b in self.gaps if b > start and a < end), key=lambda g: g[1] - g[0],
                        default=(start, start)))


# ---------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """prepare(model) -> the payload, built before the clock starts (big bodies take the bench's own
    loop seconds to build); run(client, model, payload) -> (statuses, note)."""

    name: str
    what: str
    run: Callable[[httpx.AsyncClient, str, object], Awaitable[tuple[list[int], str]]]
    prepare: Callable[[str], object] = lambda model: None


def _ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, VOCAB_LIMIT) for _ in range(count)]


def _user(user: str | None) -> dict:
    """The `user` field of a request body (none when `user` is None: every request its own client)."""
    return {} if user is None else {"user": user}


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


async def _post(client: httpx.AsyncClient, path: str, body: bytes, timeout: float = 900) -> httpx.Response:
    return await client.post(path, content=body, headers={"content-type": "application/json"}, timeout=timeout)


def _error_message(response: httpx.Response) -> str:
    """`param=<the error's param>: <its message>` (the message cut to 90 characters)."""
    try:
        error = response.json().get("error", {})
        return f"param={error.get('param')}: {str(error.get('message', ''))[:90]}"
    except (ValueError, AttributeError):
        return response.text[:90]


def _one(name: str, what: str, path: str, body_of: Callable[[str], dict | bytes], note_usage: bool = False,
         user: str | None = None) -> Case:
    async def run(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
        response = await _post(client, path, payload)
        if response.status_code >= 400:
            return [response.status_code], _error_message(response)
        usage = response.json().get("usage", {}) if note_usage else {}
        return [response.status_code], f"{usage['prompt_tokens']} prompt tokens" if usage else ""

    def prepare(model: str) -> bytes:
        body = body_of(model)
        return body if isinstance(body, bytes) else _json({**body, **_user(user)})

    return Case(name, what, run, prepare)


def _many(name: str, what: str, count: int, path: str, body_of: Callable[[str, int], dict],
          user: str | None = None) -> Case:
    async def run(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
        async def timed(body: bytes) -> tuple[httpx.Response, float]:
            begin = time.perf_counter()
            response = await _post(client, path, body)
            return response, time.perf_counter() - begin

        done = await asyncio.gather(*(timed(body) for body in payload))
        responses = [r for r, _ in done]
        errors = sorted({_error_message(r) for r in responses if r.status_code >= 400})
        return [r.status_code for r in responses], "; ".join([_latencies([s for _, s in done]), *errors])[:120]

    return Case(name, what, run, lambda model: [_json({**body_of(model, i), **_user(user)}) for i in range(count)])


async def _idle(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
    await asyncio.sleep(6.0)
    return [], "nothing sent: the bystander's own gaps"


async def _disconnects(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
    """50 streams, each dropped after its first chunk (payload: the `user` fields, `_user`)."""
    async def one(i: int) -> tuple[int, float]:
        body = {"model": model, "prompt": f"drop me {i}", "max_tokens": 200, "stream": True, "ignore_eos": True,
                **payload}
        begin = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body, timeout=600) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
            return response.status_code, time.perf_counter() - begin
    done = await asyncio.gather(*(one(i) for i in range(50)))
    return [status for status, _ in done], f"{_latencies([s for _, s in done], 'first chunk')}; each closed after it"


def _latencies(seconds: list[float], what: str = "response") -> str:
    """p50 / p90 of a burst's request times (its TTFT: 1-token responses, or the first streamed chunk)."""
    return f"{what} p50 {percentile(seconds, 50):.2f} s, p90 {percentile(seconds, 90):.2f} s"


def _huge_text(mib: int) -> str:
    words = ("alpha", "beta", "gamma", "delta", "omega", "sigma")
    rng = random.Random(mib)
    return " ".join(rng.choice(words) for _ in range(mib * (1 << 20) // 6))


def _body_bytes(size: int, model: str) -> bytes:
    """A completion request body of exactly `size` bytes (a text prompt of repeated words)."""
    head, tail = b'{"model": "' + model.encode() + b'", "max_tokens": 1, "prompt": "', b'"}'
    fill = size - len(head) - len(tail)
    return head + (b"alpha beta gamma delta " * (fill // 23 + 1))[:fill] + tail


def _nonce() -> str:
    """Makes a case's prompt new to the server (another run on the same server reuses nothing)."""
    return os.urandom(4).hex()


def _server_option(server_args: list[str], flag: str, default: str) -> str:
    """The value of `flag` among the server's arguments (`--flag value` or `--flag=value`), else `default`."""
    value = default
    for i, arg in enumerate(server_args):
        if arg == flag and i + 1 < len(server_args):
            value = server_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _cross_tenant(name: str, what: str, tenant_a: dict, tenant_b: dict, expect_zero: bool | None) -> Case:
    """Issue 27 item 2, the cached-tokens oracle: tenant A sends a document, tenant B (`tenant_b`: another
    `user` and/or `cache_salt`) the same one, then A again. The note has B's
    usage.prompt_tokens_details.cached_tokens (above 0 tells B that someone sent that document) and A's
    on its repeat (the control: the cache does serve a tenant's own repeat, so B's 0 is not vacuous).
    expect_zero: B must see 0 (isolated: "LEAK" when not), B's cached tokens are the documented side
    channel (False: no isolation), or unknown (None)."""
    async def run(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
        statuses, cached, prompt_tokens = [], [], 0
        for body in payload:
            response = await _post(client, "/v1/completions", body)
            statuses.append(response.status_code)
            if response.status_code >= 400:
                return statuses, _error_message(response)
            usage = response.json()["usage"]
            prompt_tokens = usage["prompt_tokens"]
            cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if expect_zero is None:
            verdict = "isolation unknown"
        elif expect_zero:
            verdict = "isolated: expect B 0" + (" - LEAK" if cached[1] else "")
        else:
            verdict = "no isolation: the side channel"
        return statuses, f"B cached {cached[1]} of {prompt_tokens} tokens, A again {cached[2]}; {verdict}"

    def prepare(model: str) -> list[bytes]:
        document = (f"Memo {_nonce()}: the quarterly report of Example Corp says revenue grew by twelve percent "
                    "while costs fell, and the board approved the merger with Sample Holdings.")
        body = {"model": model, "prompt": document, "max_tokens": 1}
        return [_json({**body, **tenant}) for tenant in (tenant_a, tenant_b, tenant_a)]

    return Case(name, what, run, prepare)


async def _marker_checkpoints(client: httpx.AsyncClient) -> float:
    """The server's marker checkpoints created so far (/metrics)."""
    for line in (await client.get("/metrics", timeout=60)).text.splitlines():
        if line.startswith(MARKER_METRIC):
            return float(line.split()[-1])
    return 0.0


def _marker(name: str, what: str, body_of: Callable[[str, str], dict], policy: str, user: str | None) -> Case:
    """Issue 27 item 6: one chat request with the checkpoint marker in a field other than message text
    (body_of(model, nonce)); the note has the marker checkpoints it created (/metrics) and what the
    server's marker policy (--marker-in-user-content) expects."""
    expect = {"allow": "200, a checkpoint where the marker reaches the prompt", "strip": "200, +0",
              "reject": "400"}.get(policy, "?")

    async def run(client: httpx.AsyncClient, model: str, payload: object) -> tuple[list[int], str]:
        before = await _marker_checkpoints(client)
        response = await _post(client, "/v1/chat/completions", payload)
        made = await _marker_checkpoints(client) - before
        error = f"{_error_message(response)}; " if response.status_code >= 400 else ""
        return [response.status_code], f"{error}{made:+.0f} marker checkpoints; policy {policy}: expect {expect}"

    return Case(name, what, run, lambda model: _json({**body_of(model, _nonce()), **_user(user)}))


def _weather(nonce: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in Paris? ({nonce})"}]


_TEXT_PART = {"type": "text", "text": "x"}


def _nested_schema(depth: int) -> dict:
    """A JSON schema of `depth` objects, each the only property of the one around it."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema  # a chat content part and an Anthropic text block alike


def _tool(description: str, city: str = "the city") -> dict:
    return {"type": "function", "function": {"name": "weather", "description": description, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": city}}, "required": ["city"]}}}


def build_cases(max_model_len: int, user: str | None, server_args: list[str] | None = None) -> list[Case]:
    """Every case; their requests carry `user` (None: none, every request its own client). server_args:
    the server's arguments, for what the cross-tenant and marker cases expect (--cache-isolation,
    --marker-in-user-content; their defaults when not given)."""
    half = max_model_len // 2
    isolation = _server_option(server_args or [], "--cache-isolation", "none")
    policy = _server_option(server_args or [], "--marker-in-user-content", "allow")
    marker = partial(_marker, policy=policy, user=user)
    one, many = partial(_one, user=user), partial(_many, user=user)
    utility = partial(_one, user=None)  # /tokenize and /detokenize take no `user` (vLLM's neither): a 400 otherwise
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"]}
    return [
        Case("baseline", "idle 6 s (the bystander alone)", _idle),
        one("prompt_logprobs_4k", "4,096-token prompt, prompt_logprobs=5", "/v1/completions",
             lambda m: {"model": m, "prompt": _ids(4096, 1), "max_tokens": 1, "prompt_logprobs": 5}, True),
        one("echo_logprobs_8k", "8,192-token prompt, echo + logprobs=5, max_tokens 0", "/v1/completions",
             lambda m: {"model": m, "prompt": _ids(8192, 2), "max_tokens": 0, "echo": True, "logprobs": 5}, True),
        one("long_prompt_half_ctx", f"{half:,}-token prompt (half of max_model_len), 1 token", "/v1/completions",
             lambda m: {"model": m, "prompt": _ids(half, 3), "max_tokens": 1}, True),
        one("huge_body_8mib", "8 MiB text prompt (~1.4M tokens: too long)", "/v1/completions",
             lambda m: {"model": m, "prompt": _huge_text(8), "max_tokens": 1}),
        one("huge_body_50mb", "50,000,000-byte body (under the default size limit)", "/v1/completions",
             partial(_body_bytes, 50_000_000)),
        one("huge_body_50mib", "50 MiB body (over the default size limit)", "/v1/completions",
             partial(_body_bytes, 50 << 20)),
        utility("tokenize_8mib", "8 MiB text to /tokenize (~1.4M tokens)", "/tokenize",
             lambda m: {"model": m, "prompt": _huge_text(8)}),
        utility("detokenize_1m_ids", "1,000,000 token ids to /detokenize", "/detokenize",
             lambda m: {"model": m, "tokens": _ids(1_000_000, 4)}),
        one("n_128", "one prompt, n=128, 16 tokens each", "/v1/completions",
             lambda m: {"model": m, "prompt": "many", "n": 128, "max_tokens": 16, "ignore_eos": True}),
        one("16_prompts_n_128", "16 prompts x n=128 (2,048 sequences)", "/v1/completions",
             lambda m: {"model": m, "prompt": [f"p{i}" for i in range(16)], "n": 128, "max_tokens": 16}),
        one("64_prompts_n_128", "64 prompts x n=128 (8,192 sequences)", "/v1/completions",
             lambda m: {"model": m, "prompt": [f"p{i}" for i in range(64)], "n": 128, "max_tokens": 16}),
        one("stop_strings_1e5", "100,000 stop strings", "/v1/completions",
             lambda m: {"model": m, "prompt": "stop", "max_tokens": 8, "stop": [f"s{i}x" for i in range(100_000)]}),
        one("first_json_schema", "first constrained request (json_schema)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 16, "messages": [{"role": "user", "content": "json"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}}),
        one("request_template", "chat_template_kwargs.chat_template with a 2000x2000 loop", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}}),
        one("request_template_range_1e5", "chat_template_kwargs.chat_template, nested range(100000) loops",
             "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"chat_template": RANGE_TEMPLATE}}),
        one("request_template_str_3e9", "chat_template_kwargs.chat_template, 'a' * 3,000,000,000",
             "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"chat_template": STR_TEMPLATE}}),
        many("marker_flood_80", "80 prompts with distinct checkpoint markers", 80, "/v1/completions",
              lambda m, i: {"model": m, "prompt": f"flood {i} " * 12 + MARKER + " q", "max_tokens": 1}),
        marker("marker_in_tool_description", "the marker in a tool's description",
               lambda m, nonce: {"model": m, "max_tokens": 1, "messages": _weather(nonce),
                                 "tools": [_tool(f"Weather for a city. {MARKER}")]}),
        marker("marker_in_tool_schema", "the marker in a tool's parameter schema",
               lambda m, nonce: {"model": m, "max_tokens": 1, "messages": _weather(nonce),
                                 "tools": [_tool("Weather for a city.", f"the city {MARKER}")]}),
        marker("marker_in_tool_call_args", "the marker in an assistant tool_calls' arguments",
               lambda m, nonce: {"model": m, "max_tokens": 1, "tools": [_tool("Weather for a city.")],
                                 "messages": [*_weather(nonce), {"role": "assistant", "content": None, "tool_calls": [
                                     {"id": "call_1", "type": "function", "function": {
                                         "name": "weather", "arguments": json.dumps({"city": f"Paris {MARKER}"})}}]},
                                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}),
        marker("marker_in_template_kwargs", "the marker in chat_template_kwargs",
               lambda m, nonce: {"model": m, "max_tokens": 1, "messages": _weather(nonce),
                                 "chat_template_kwargs": {"enable_thinking": False, "note": MARKER}}),
        many("burst_64", "64 concurrent 1-token requests", 64, "/v1/completions",
              lambda m, i: {"model": m, "prompt": f"burst {i}", "max_tokens": 1}),
        Case("disconnects_50", "50 streams dropped after the first chunk", _disconnects, lambda model: _user(user)),
        one("lone_surrogate", "a lone surrogate in the prompt", "/v1/completions",
             lambda m: b'{"model": "' + m.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 1}'),
        one("deep_json", "a prompt nested 100,000 lists deep", "/v1/completions",
             lambda m: b'{"model": "' + m.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        one("json_schema_400_deep", "a response_format json_schema 400 objects deep (a 500 before session 21)",
             "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": _nested_schema(400)}}}),
        one("grammar_500_deep", "a GBNF grammar of 500 nested groups (a 500 before session 21)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "structured_outputs": {"grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500}}),
        one("choice_100k", "structured_outputs.choice of 100,000 strings (held the engine thread 32 s before "
            "session 21)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}),
        one("cesu8_body", "CESU-8 bytes (a surrogate pair as 6 UTF-8 bytes) in the prompt", "/v1/completions",
             lambda m: b'{"model": "' + m.encode() + b'", "prompt": "a\xed\xa0\xbd\xed\xb8\x80b", "max_tokens": 1}'),
        one("lone_surrogate_bad_words", "a lone surrogate in bad_words", "/v1/completions",
             lambda m: b'{"model": "' + m.encode() + b'", "prompt": "hi", "max_tokens": 1, "bad_words": ["a\\ud800"]}'),
        utility("lone_surrogate_tokenize", "a lone surrogate in a /tokenize prompt", "/tokenize",
                lambda m: b'{"model": "' + m.encode() + b'", "prompt": "a\\ud800b"}'),
        one("template_kwargs_clash", "chat_template_kwargs sets add_generation_prompt and messages",
             "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"add_generation_prompt": False,
                                                 "messages": [{"role": "user", "content": "other"}]}}),
        one("bool_token_ids_prompt", "booleans as prompt token ids", "/v1/completions",
             lambda m: {"model": m, "max_tokens": 1, "prompt": [True, False, 1]}),
        one("bool_token_ids_allowed", "booleans in allowed_token_ids", "/v1/completions",
             lambda m: {"model": m, "max_tokens": 1, "prompt": "hi", "allowed_token_ids": [True, False]}),
        one("unknown_role", "a message with role 'hacker'", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "hacker", "content": "hi"}]}),
        one("chat_20k_messages", "20,000 one-word messages (0.77 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": f"w{i}"}
                                                                  for i in range(20_000)]}),
        one("chat_50k_parts", "one message of 50,000 one-letter text parts (1.55 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": [_TEXT_PART] * 50_000}]}),
        one("chat_500k_parts", "one message of 500,000 one-letter text parts (15.5 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1,
                        "messages": [{"role": "user", "content": [_TEXT_PART] * 500_000}]}),
        one("chat_200k_messages", "200,000 one-word messages (8 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": f"w{i}"}
                                                                  for i in range(200_000)]}),
        one("chat_8k_messages", "8,000 one-word messages (under --max-request-objects' 8,192: validated, "
            "rendered, tokenised)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": f"w{i}"}
                                                                  for i in range(8_000)]}),
        one("completions_8m_ids", "a prompt of 8,000,000 token ids (24 MB)", "/v1/completions",
             lambda m: {"model": m, "max_tokens": 1, "prompt": [1] * 8_000_000}),
        one("completions_250k_ids", "a prompt of 250,000 token ids (0.75 MB; under --max-request-values' default "
            "2^18: decoded and validated)", "/v1/completions",
             lambda m: {"model": m, "max_tokens": 1, "prompt": [1] * 250_000}),
        one("chat_4m_stop_ids", "4,000,000 stop_token_ids (12 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "stop_token_ids": [1] * 4_000_000}),
        one("chat_4m_stop_strings", "4,000,000 one-letter stop strings (20 MB)", "/v1/chat/completions",
             lambda m: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "stop": ["a"] * 4_000_000}),
        one("responses_50k_parts", "/v1/responses: one input message of 50,000 text parts", "/v1/responses",
             lambda m: {"model": m, "max_output_tokens": 1, "input": [
                 {"role": "user", "content": [{"type": "input_text", "text": "x"}] * 50_000}]}),
        # Anthropic's body has no `user` (metadata.user_id): sent without one
        partial(_one, user=None)("messages_50k_blocks", "/v1/messages: one message of 50,000 text blocks",
                                 "/v1/messages", lambda m: {"model": m, "max_tokens": 1, "messages": [
                                     {"role": "user", "content": [_TEXT_PART] * 50_000}]}),
        _cross_tenant("cross_tenant_user", "tenant B (another user) sends tenant A's document",
                      {"user": "tenant_a"}, {"user": "tenant_b"}, {"user": True, "none": False}.get(isolation)),
        _cross_tenant("cross_tenant_salt", "tenant B (another user and cache_salt) sends tenant A's document",
                      {"user": "tenant_a", "cache_salt": "salt_a"}, {"user": "tenant_b", "cache_salt": "salt_b"}, True),
    ]


async def run_case(case: Case, client: httpx.AsyncClient, url: str, model: str, pid: int | None,
                   bystander_user: str | None) -> Row:
    payload = case.prepare(model)
    probes, bystander, stop = Probes(client, pid), Bystander(client, model, bystander_user), asyncio.Event()
    health = HealthProcess(url)  # started now: a Python process takes a while to send its first probe
    streams = [asyncio.ensure_future(bystander.stream_forever(i, stop)) for i in range(BYSTANDER_STREAMS)]
    await asyncio.sleep(WARM_S)  # the bystander is streaming before the case starts
    rss_before = rss_mib(pid)
    watchers = [asyncio.ensure_future(probes.health(stop)), asyncio.ensure_future(probes.memory(stop))]
    start, start_monotonic = time.perf_counter(), time.monotonic()
    try:
        statuses, note = await case.run(client, model, payload)
    except Exception as exc:  # a case that cannot complete is a row, not the end of the run
        statuses, note = [0], f"client error: {type(exc).__name__}: {str(exc)[:80]}"
    end, end_monotonic = time.perf_counter(), time.monotonic()
    stop.set()
    await asyncio.gather(*watchers)
    health_ms = await health.stop(start_monotonic, end_monotonic)
    await asyncio.sleep(0.5)  # let the streams' open gaps close
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    gap = bystander.largest_gap(start, end)
    streamed = bystander.chunks(start, end)
    await asyncio.sleep(SETTLE_S)
    rss_after = rss_mib(pid)
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return Row(case.name, case.what, counts, end - start, max(health_ms, default=float("nan")),
               percentile(health_ms, 99), max(probes.health_ms, default=float("nan")), rss_before,
               max(probes.rss, default=rss_before), rss_after, gap, bystander.errors, note,
               {"bystander_chunks": streamed, "bystander_chunks_per_s": streamed / max(end - start, 1e-9),
                "bystander_gap_span": bystander.largest_gap_span(start, end), "case_span": [start, end]})


async def run_all(args: argparse.Namespace, url: str, pid: int | None, code: dict) -> dict:
    """code: `code_version()` when the server started (not the checkout at the end of a long run)."""
    machine = machine_info()  # the load average before the cases
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        info = (await client.get("/v1/models")).json()["data"][0]
        model, max_model_len = info["id"], info["max_model_len"]
        await _post(client, "/v1/completions", _json({"model": model, "prompt": "warm up", "max_tokens": 2}))
        cases = build_cases(max_model_len, None if args.anonymous else CASE_USER, args.server_arg)
        wanted = set(args.cases.split(",")) if args.cases else {c.name for c in cases}
        unknown = wanted - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; known: {[c.name for c in cases]}")
        rows = []
        for case in cases:
            if case.name not in wanted:
                continue
            row = await run_case(case, client, url, model, pid, None if args.anonymous else BYSTANDER_USER)
            print(format_row(row, rows[0].bystander_gap_s if rows and rows[0].case == "baseline" else None),
                  flush=True)
            rows.append(row)
    return {"url": url, "model": model, "max_model_len": max_model_len, "server_args": args.server_arg,
            "users": None if args.anonymous else {"bystander": BYSTANDER_USER, "cases": CASE_USER},
            "limits": LIMITS, "code": code, "machine": machine, "rows": [asdict(r) for r in rows]}


# ---------------------------------------------------------------------------------------- output
HEADER = (f"{'case':<22} {'status':<14} {'time s':>7} {'/health max ms':>14} {'p99':>5} {'bench loop':>10} "
          f"{'RSS before':>10} {'peak':>7} "
          f"{'after':>7} {'kept':>6} {'bystander gap s':>15} {'x base':>6} {'tok/s':>6}  note")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_row(row: Row, baseline_gap: float | None) -> str:
    status = " ".join(f"{n}x{s}" if n > 1 else s for s, n in sorted(row.statuses.items())) or "-"
    ratio = f"{row.bystander_gap_s / baseline_gap:.1f}" if baseline_gap else "-"
    kept = "-" if row.rss_kept_mib is None else f"{row.rss_kept_mib:+.0f}"
    return (f"{row.case:<22} {status:<14} {row.time_s:>7.1f} {row.health_max_ms:>14.0f} {row.health_p99_ms:>5.0f} "
            f"{row.health_bench_loop_max_ms:>10.0f} {_mib(row.rss_before_mib):>10} "
            f"{_mib(row.rss_peak_mib):>7} {_mib(row.rss_after_mib):>7} {kept:>6} {row.bystander_gap_s:>15.2f} "
            f"{ratio:>6} {row.extra.get('bystander_chunks_per_s', 0.0):>6.1f}  {row.note}")


def markdown_table(result: dict) -> str:
    rows = result["rows"]
    base = next((r["bystander_gap_s"] for r in rows if r["case"] == "baseline"), None)
    lines = ["| case | request | status | time (s) | /health max / p99 (ms) | /health max, bench loop (ms) "
             "| RSS before / peak / after (MiB) | kept (MiB) | bystander largest gap (s) | x baseline | note |",
             "|" + "---|" * 11]
    for r in rows:
        status = ", ".join(f"{n} x {s}" for s, n in sorted(r["statuses"].items())) or "-"
        kept = (r["rss_after_mib"] - r["rss_before_mib"]) if r["rss_after_mib"] is not None else None
        ratio = f"{r['bystander_gap_s'] / base:.1f}" if base else "-"
        lines.append(f"| {r['case']} | {r['what']} | {status} | {r['time_s']:.1f} | "
                     f"{r['health_max_ms']:.0f} / {r['health_p99_ms']:.0f} | "
                     f"{r['health_bench_loop_max_ms']:.0f} | "
                     f"{_mib(r['rss_before_mib'])} / {_mib(r['rss_peak_mib'])} / {_mib(r['rss_after_mib'])} | "
                     f"{'-' if kept is None else f'{kept:+.0f}'} | {r['bystander_gap_s']:.2f} | {ratio} | "
                     f"{r['note'].replace('|', '/')} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["case"] for r in rows]
    base = next((r["bystander_gap_s"] for r in rows if r["case"] == "baseline"), None)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    panels = [
        ([r["health_max_ms"] for r in rows], "/health max (ms)", LIMITS["health_ms"]),
        ([(r["rss_after_mib"] or 0) - (r["rss_before_mib"] or 0) for r in rows], "RSS kept (MiB)",
         LIMITS["rss_kept_mib"]),
        ([r["bystander_gap_s"] for r in rows], "bystander largest token gap (s)",
         LIMITS["gap_ratio"] * base if base else None),
    ]
    for ax, (values, label, limit) in zip(axes, panels):
        ax.barh(names, values)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", label="issue 27 bar")
            ax.legend()
        ax.set_xlabel(label)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle(f"hostile set against forkpoint serve ({result['model']}, commit {str(result['code']['commit'])[:7]})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one on loopback)")
    parser.add_argument("--server-pid", type=int, default=None, help="pid of the --url server, for RSS")
    parser.add_argument("--model", default=None, help="model directory for the started server (default: embedded)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for the started `forkpoint serve` (repeatable); with --url, the "
                             "arguments that server runs with (the cross-tenant and marker cases' expectations)")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--anonymous", action="store_true",
                        help="send no `user` (default: the bystander's requests say 'bystander', the cases' 'hostile')")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output directory")
    parser.add_argument("--name", default="hostile_cpu", help="output file stem (default: hostile_cpu)")
    args = parser.parse_args(argv)

    process = None
    url, pid = args.url, args.server_pid
    code = code_version()
    if url is None:
        process, url = start_server(["--log-level", "warning", *args.server_arg], args.model, 600)
        pid = process.pid
    print(HEADER, flush=True)
    try:
        result = asyncio.run(run_all(args, url, pid, code))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    print(machine_line(result["machine"]))
    print(f"commit {result['code']['commit']} (forkpoint modified: {result['code']['forkpoint_modified']})")
    path = write_results(result, args.out, args.name, plot)
    print(markdown_table(result))
    print(f"wrote {path} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
