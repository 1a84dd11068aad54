"""Real servers for the server tests: uvicorn on a free loopback port, in a thread of the test
process (so tests can run checks on the engine thread through `app.state.worker`).

`server` is one session-wide server on the embedded default model. `spare_llm` is a second engine
for tests that need their own server configuration: they start short-lived servers on it with
`serve(spare_llm, ServerConfig(...))`, one at a time (each server owns the engine while it runs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from forkpoint import LLM
from forkpoint.server.app import build_app
from forkpoint.server.config import ServerConfig

MARKER = "<|mamba_checkpoint|>"
# small pools and context: fast to allocate, and "prompt too long" is cheap to provoke
# marker semantics are tested with automatic checkpoints off (tests/server/test_auto_checkpoints.py turns them on)
TEST_LLM_KWARGS = {"max_model_len": 4096, "num_kv_blocks": 2048, "checkpoint_pool_size": 32, "auto_checkpoints": False}


@dataclass
class RunningServer:
    """A server under test. `base_url` has no trailing slash and no /v1."""

    base_url: str
    app: FastAPI
    llm: LLM
    uvicorn_server: uvicorn.Server
    thread: threading.Thread

    @property
    def model(self) -> str:
        return self.app.state.config.served_model_name

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="test", max_retries=0,
                             timeout=kwargs.pop("timeout", 120), **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="test", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120), **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", timeout=kwargs.pop("timeout", 120), **kwargs)

    def engine_call(self, fn: Callable[[Any], Any], timeout: float = 60) -> Any:
        """Run `fn(engine)` on the server's engine thread and return its result."""
        return self.app.state.worker.call(fn).result(timeout=timeout)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Scrape /metrics: {(sample name, sorted labels): value}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Wait until the engine has no request and no slot in use; return its metrics."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.engine_call(lambda engine: (engine.has_unfinished_requests(), engine.metrics()))
            if not values[0] and values[1]["state_slots_used"] == 0:
                return values[1]
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout} s: {values[1]}")
            time.sleep(0.05)


@contextmanager
def uvicorn_thread(app, graceful_timeout_s: float = 5) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    """Serve `app` with uvicorn in a thread on a free 127.0.0.1 port until the block ends (or until
    the test sets the server's `should_exit`); yields (base URL, server, thread). uvicorn waits
    `graceful_timeout_s` for open requests when stopping."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_timeout_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


@contextmanager
def serve(llm: LLM, config: ServerConfig, graceful_timeout_s: float = 5,
          load_time_s: float | None = None) -> Iterator[RunningServer]:
    """Run `build_app(llm, config)` on a free 127.0.0.1 port until the block ends (or until the
    test sets `uvicorn_server.should_exit`); uvicorn waits `graceful_timeout_s` for open requests."""
    app = build_app(llm, config, load_time_s=load_time_s)
    with uvicorn_thread(app, graceful_timeout_s) as (url, server, thread):
        yield RunningServer(url, app, llm, server, thread)


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The session-wide server on the embedded default model (checkpoints on, marker allowed)."""
    with serve(LLM(**TEST_LLM_KWARGS), ServerConfig(served_model_name="forkpoint-test")) as running:
        yield running


@pytest.fixture(scope="session")
def spare_llm() -> LLM:
    """A second engine for short-lived servers with other configurations."""
    return LLM(**TEST_LLM_KWARGS)


@pytest.fixture
def anchor_text() -> Callable[[str], str]:
    """anchor_text(tag) -> a fresh shared prefix (~60 tokens), distinct per tag."""
    def make(tag: str) -> str:
        return f"Listing {tag}: " + " ".join(f"item-{tag}-{i} costs {i * 7 % 13} euros;" for i in range(8))
    return make


@dataclass
class ServeProcess:
    """`forkpoint serve` in a child process: `base_url` answers; `log` holds its output (stdout and stderr)."""

    process: subprocess.Popen
    base_url: str
    log: IO[str]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@contextmanager
def serve_process(args: Sequence[str], log_path: Path, start_timeout_s: float = 120,
                  command: Sequence[str] = ("-m", "forkpoint.server.cli", "serve"),
                  new_session: bool = False) -> Iterator[ServeProcess]:
    """`python <command> --port P args...` (default `-m forkpoint.server.cli serve`) on a free loopback
    port, once `/health` answers 200; the test fails with the log if the process exits or does not
    answer within `start_timeout_s`. A process still running at exit is killed (with `new_session`, it
    leads a process group of its own, as a terminal's job: the whole group is killed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w+") as log:
        process = subprocess.Popen([sys.executable, *command, "--port", str(port), *args],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                   start_new_session=new_session)
        running = ServeProcess(process, f"http://127.0.0.1:{port}", log)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    if httpx.get(f"{running.base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None and time.monotonic() < deadline, running.output()
                time.sleep(0.3)
            yield running
        finally:
            if new_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()
            process.wait()
