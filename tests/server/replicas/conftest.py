"""One local Ray instance per test module that needs it (few CPUs, no dashboard, quiet logs), and
the OpenAI app of a replica cluster on a loopback port."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi import FastAPI

from tests.server.conftest import uvicorn_thread


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
    with uvicorn_thread(app) as (url, _, _):
        yield url
