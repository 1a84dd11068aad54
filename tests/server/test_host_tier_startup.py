"""The server serves while its host tier is still being pinned ahead (server/app.py no longer waits for
it: a 31.6 GiB tier took 13.5-18.0 s to pin on the H200, issue 31): with the arena's pinning held back
by a gate, the server starts, answers a completion and stops."""

from __future__ import annotations

import threading
import time

import torch

from forkpoint.runner.host_arena import HostArena
from forkpoint.runner.host_copies import ArenaHostCopies
from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve


def test_the_server_serves_before_its_host_tier_is_pinned(spare_llm, monkeypatch):
    gate = threading.Event()

    def gated(num_bytes: int, pinned: bool) -> torch.Tensor:
        if not gate.wait(timeout=30):  # (a server that waited for the tier would start after 30 s)
            raise RuntimeError("the gate was never opened")
        return torch.empty(num_bytes, dtype=torch.uint8)

    storage = spare_llm.engine.runner.storage
    host = ArenaHostCopies(storage.host.pools, 1 << 20)
    host.arena = HostArena(host.arena.num_pages, host.arena.page_bytes, pinned=False,
                           chunk_bytes=4 * host.arena.page_bytes, ahead=True, allocate_chunk=gated)
    monkeypatch.setattr(storage, "host", host)
    began = time.monotonic()
    try:
        with serve(spare_llm, ServerConfig(served_model_name="pinning")) as running:
            assert time.monotonic() - began < 20
            completion = running.client().completions.create(model=running.model, prompt="Hello", max_tokens=3)
            assert completion.usage.completion_tokens == 3
            assert host.arena.allocated_bytes == 0  # still held at the gate while it served
            running.engine_call(lambda engine: engine.check_integrity())
    finally:
        gate.set()
        host.arena.close()
