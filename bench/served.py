"""`forkpoint serve` in a child process on a free local port, for the benchmarks that drive the HTTP
server as a client would (agent_sessions.py, hostile.py, server_load.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

import httpx


def start_server(options: Sequence[str], model: str | None, timeout_s: float, *, output: IO | None = None,
                 env: Mapping[str, str] | None = None, launcher: Sequence[str] | None = None,
                 ) -> tuple[subprocess.Popen, str]:
    """Start `forkpoint serve [model] --port P options...` (its output goes to `output`, default stderr;
    environment `env`, default this process's) and wait until `/health` answers 200. Returns (the
    process, its base URL); the caller stops the process. Raises RuntimeError, the process killed, when
    it exits or does not answer within `timeout_s`. launcher: the command that takes `serve ...`
    (default `python -m forkpoint.server.cli`; bench/step_trace.py wraps it with a per-step trace)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [*(launcher or (sys.executable, "-m", "forkpoint.server.cli")), "serve", "--port", str(port)]
    if model:
        command.append(model)
    output = sys.stderr if output is None else output
    process = subprocess.Popen(command + list(options), stdout=output, stderr=output,
                               env=None if env is None else dict(env))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.5)
