"""One local Ray instance per test module that needs it (few CPUs, no dashboard, quiet logs), and
the OpenAI app of a replica cluster on a loopback port."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """Ray with 4 logical CPUs (two clusters of two 1-CPU replicas on the CI's 2 cores), shut down
    with Serve at the end of the module."""
    import ray
    from ray import serve

    from forkpoint.server.replicas.launch import start_serve

    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    start_serve()
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_app(app: FastAPI) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free 127.0.0.1 port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-replicas", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"
