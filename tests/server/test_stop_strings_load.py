"""Stop strings at the request caps (`MAX_STOP_STRINGS` strings of `MAX_STOP_CHARS` characters) cost little
where they are matched: the engine thread finds them in a window of each new token's text and holds back,
from each streamed delta, the tail of the text that may start one (engine/output_processor.py `append_token`,
`make_delta_output`: bounded per token, without a model); the event loop only forwards the deltas
(server/serving.py `stream_deltas`): streams with the capped stop strings are compared with the same streams
with one short stop string, by the event loop's CPU seconds per streamed token (read from /proc: scheduling
noise on a shared machine moves latencies, not a thread's own CPU time), and by /health's latency meanwhile."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from forkpoint.cache.hashing import PrefixHasher
from forkpoint.engine.output_processor import OutputProcessor
from forkpoint.engine.request import Request
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.config import ServerConfig
from forkpoint.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.server.conftest import RunningServer, serve

STREAMS = 2
MAX_TOKENS = 128  # ~600 characters: the old exact check cost ~(600 / 1,024)^2 of its worst a chunk, 5x+ the base
BASE_TOKENS = 64
HEALTH_BOUND_S = 0.25  # issue 27's bar for /health during a disturbance
MAX_COST_RATIO = 3.0  # event loop CPU per streamed token, capped stop strings / one short one
MAX_ENGINE_EXTRA_MS = 2.0  # the engine's search per token, capped stop strings less one short one

# never produced by the model (each stream must end by length)
CAPPED_STOPS = [f"\x07{i:03d}" + "\x07" * (MAX_STOP_CHARS - 4) for i in range(MAX_STOP_STRINGS)]


@dataclass
class Load:
    tokens: int  # streamed tokens, all streams
    loop_cpu_s: float  # the server's event loop thread
    health_s: list[float]  # /health latencies sampled meanwhile

    def per_token_ms(self, cpu_s: float) -> float:
        return 1e3 * cpu_s / self.tokens


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) that the thread `native_id` of this process has run."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stream(srv: RunningServer, stops: list[str], max_tokens: int, seed: int, finished: list) -> None:
    body = {"model": srv.model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 1.0, "seed": seed, "stop": stops,
            "stream_options": {"include_usage": True}}
    finish, tokens = None, 0
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                finish = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), finish)
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    finished.append((finish, tokens))


def _load(srv: RunningServer, stops: list[str], max_tokens: int) -> Load:
    """STREAMS streams of `max_tokens` tokens with `stops`, /health polled meanwhile."""
    finished: list = []
    streams = [threading.Thread(target=_stream, args=(srv, stops, max_tokens, seed, finished))
               for seed in range(STREAMS)]
    loop_cpu = _thread_cpu_s(srv.thread.native_id)
    for thread in streams:
        thread.start()
    health = []
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        while any(thread.is_alive() for thread in streams):
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.02)
    for thread in streams:
        thread.join()
    assert finished == [("length", max_tokens)] * STREAMS, finished  # no stop string matched
    return Load(STREAMS * max_tokens, _thread_cpu_s(srv.thread.native_id) - loop_cpu, health)


@pytest.fixture(scope="module")
def loads(spare_llm) -> tuple[Load, Load]:
    """(streams with one short stop string, streams with the capped stop strings), on one server."""
    with serve(spare_llm, ServerConfig(log_stats=False)) as srv:
        base = _load(srv, ["\x07"], BASE_TOKENS)
        capped = _load(srv, CAPPED_STOPS, MAX_TOKENS)
    return base, capped


def _append_ms(tokenizer, token_ids: list[int], stops: list[str]) -> list[float]:
    """Milliseconds of each `OutputProcessor.append_token` and the streamed delta after it (what the engine
    does per token of a streamed response) over `token_ids`, for one sequence with `stops`."""
    processor = OutputProcessor(tokenizer, eos_token_ids=(), max_model_len=1 << 20)
    params = SamplingParams(stop=stops, max_tokens=None, ignore_eos=True)
    request = Request("r", "r", 0, [0], (), params, 0.0, PrefixHasher([0], 16), None)
    times = []
    for token_id in token_ids:
        start = time.perf_counter()
        assert processor.append_token(request, token_id, None, 0.0) is None  # no stop string matched
        processor.make_delta_output("r", None, [0], [], [request])
        times.append(1e3 * (time.perf_counter() - start))
    return times


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_capped_stop_strings_cost_the_engine_little_per_token(spare_llm):
    """The engine thread looks for the stop strings in each new token's text and holds back a possible start
    of one from the streamed delta: with the capped ones, in a text past MAX_STOP_CHARS characters, that
    costs well under a millisecond a token more than one short one (the search is a window of the new text,
    not every prefix of every stop string)."""
    tokenizer = spare_llm.engine.tokenizer
    text = " ".join(f"word{i} and some more text, number {i * 7 % 13};" for i in range(120))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(text) > 4 * MAX_STOP_CHARS
    base = _mean(_append_ms(tokenizer, token_ids, ["\x07"]))
    times = _append_ms(tokenizer, token_ids, CAPPED_STOPS)
    assert _mean(times) - base < MAX_ENGINE_EXTRA_MS, (
        f"{_mean(times):.3f} ms per token with {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters, "
        f"{base:.3f} ms with one short one")


def test_capped_stop_strings_do_not_stall_the_event_loop(loads):
    # before serving.py held long stop strings back whole, the exact tail check sliced every prefix of every
    # stop string for each streamed chunk: 8.3x the loop's CPU per token (~61 ms a chunk at the caps)
    base, capped = loads
    ratio = capped.per_token_ms(capped.loop_cpu_s) / base.per_token_ms(base.loop_cpu_s)
    assert ratio < MAX_COST_RATIO and max(capped.health_s) < HEALTH_BOUND_S, (
        f"the event loop spent {capped.per_token_ms(capped.loop_cpu_s):.2f} ms per streamed token with "
        f"{MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters, "
        f"{base.per_token_ms(base.loop_cpu_s):.2f} ms with one short one; /health took up to "
        f"{max(capped.health_s) * 1e3:.0f} ms (with one short one: {max(base.health_s) * 1e3:.0f} ms)")
