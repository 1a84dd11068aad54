"""A fault inside the engine's step, seen through HTTP: a raise in the scheduler's planning or commit,
or in the output work, fails the request in that step with a 500 and the server serves the next
request as before; a runner that can no longer step ends the engine thread, /health answers 503, and
`forkpoint serve` exits with status 1 for its supervisor to restart it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from forkpoint.runner.errors import RunnerUnusable
from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve, serve_process


def raise_once_when_armed(monkeypatch, owner, name: str) -> Callable[[], None]:
    """Wrap `owner.<name>`; returns `arm()`, after which its next call raises RuntimeError instead of running."""
    original = getattr(owner, name)
    armed: list[bool] = []

    def method(*args, **kwargs):
        if armed:
            armed.clear()
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, method)
    return lambda: armed.append(True)


@pytest.mark.parametrize("part, name", [("scheduler", "commit"), ("scheduler", "schedule"),
                                        ("output_processor", "append_token")])
def test_a_fault_in_the_step_fails_its_request_and_the_server_serves_on(spare_llm, monkeypatch, part, name):
    arm = raise_once_when_armed(monkeypatch, getattr(spare_llm.engine, part), name)
    with serve(spare_llm, ServerConfig()) as srv:
        body = {"model": srv.model, "prompt": "a fault in the step", "max_tokens": 4, "temperature": 0}
        expected = srv.post("/v1/completions", json=body)
        assert expected.status_code == 200, expected.text
        arm()
        failed = srv.post("/v1/completions", json=body)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "server_error" and f"injected fault in {name}" in error["message"]
        srv.wait_idle()
        srv.engine_call(lambda engine: engine.check_integrity())
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        again = srv.post("/v1/completions", json=body)  # not "a step is still in flight"
        assert again.status_code == 200, again.text
        assert again.json()["choices"] == expected.json()["choices"]
        srv.engine_call(lambda engine: engine.check_integrity())
        assert srv.metric("forkpoint_requests_total", endpoint="completions", outcome="error") == 1


def test_an_unusable_runner_ends_the_engine_and_health_says_so(spare_llm, monkeypatch):
    """In-process (uvicorn off the main thread): the thread ends, its request is a 500, /health a 503
    and later requests a 503; the server itself keeps answering (its host decides when to stop it)."""
    def unusable(*args, **kwargs):
        raise RunnerUnusable("injected: rank 1 died")

    with serve(spare_llm, ServerConfig()) as srv:
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        monkeypatch.setattr(spare_llm.engine.runner, "execute", unusable)
        failed = srv.post("/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 2})
        assert failed.status_code == 500 and "rank 1 died" in failed.json()["error"]["message"], failed.text
        health = httpx.get(f"{srv.base_url}/health")
        assert health.status_code == 503 and health.json() == {"status": "engine not running"}
        later = srv.post("/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 2})
        assert later.status_code == 503, later.text
    monkeypatch.undo()
    spare_llm.engine.check_integrity()
    assert not spare_llm.engine.has_unfinished_requests()


# `forkpoint serve` whose runner becomes unusable at the first step of an HTTP request (ids "cmpl-...")
UNUSABLE_SERVE = """
import sys
from forkpoint.runner.errors import RunnerUnusable
from forkpoint.runner.model_runner import ModelRunner
execute = ModelRunner.execute
def unusable(self, plan, *args, **kwargs):
    if any(s.request_id.startswith("cmpl-") for s in plan.segments):
        raise RunnerUnusable("injected: rank 1 died")
    return execute(self, plan, *args, **kwargs)
ModelRunner.execute = unusable
from forkpoint.server.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_serve_exits_nonzero_once_the_engine_cannot_serve(tiny_model_factory, tmp_path: Path):
    # the tiny word-level model: what is under test is the process's exit, and it starts in a third of
    # the embedded model's time (no 248k-token vocabulary to load and to prepare for structured outputs)
    model_dir, _ = tiny_model_factory("qwen3_5_text")
    args = [str(model_dir), "--max-model-len", "2048", "--served-model-name", "faults", "--log-level", "warning"]
    with serve_process(args, tmp_path / "serve.log", command=("-c", UNUSABLE_SERVE)) as running:
        failed = httpx.post(f"{running.base_url}/v1/completions", timeout=60,
                            json={"model": "faults", "prompt": "w1 w2", "max_tokens": 2})
        assert failed.status_code == 500 and "rank 1 died" in failed.text, failed.text
        try:  # 503 until the process is gone
            assert httpx.get(f"{running.base_url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        assert running.process.wait(timeout=60) == 1, running.output()
