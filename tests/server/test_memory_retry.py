"""Through HTTP: a request that runs out of memory fails alone with a 400 naming memory, while the
requests that shared its steps finish with the text of a fault-free run (engine/memory_retry.py).
Out-of-memory errors are injected into the runner of `spare_llm`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve

BYSTANDERS = [[11 + i, 300 + i, 42, 7 + i, 1000 + 3 * i, 5] for i in range(3)]
BIG = [200 + (i * 37) % 3000 for i in range(200)]  # 200 tokens


@pytest.fixture
def out_of_memory_when(spare_llm, monkeypatch):
    """out_of_memory_when(predicate): the runner raises torch.OutOfMemoryError for a plan for which
    `predicate(plan)` holds; returns the list of plans it refused."""
    execute = spare_llm.engine.runner.execute

    def install(predicate):
        refused = []

        def faulty(plan, feed=None):
            if predicate(plan):
                refused.append(plan)
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            return execute(plan) if feed is None else execute(plan, feed=feed)

        monkeypatch.setattr(spare_llm.engine.runner, "execute", faulty)
        return refused

    return install


def _complete(srv, prompt: list[int], max_tokens: int):
    return srv.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})


def _run_together(srv, with_big: bool):
    """The bystanders (and BIG, sent while they run); returns their responses, BIG's last."""
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_complete, srv, prompt, 24) for prompt in BYSTANDERS]
        if with_big:
            futures.append(pool.submit(_complete, srv, BIG, 4))
        return [f.result() for f in futures]


def test_a_request_out_of_memory_alone_is_a_400_and_its_step_mates_finish(spare_llm, out_of_memory_when):
    with serve(spare_llm, ServerConfig()) as srv:
        expected = [r.json()["choices"][0]["text"] for r in _run_together(srv, with_big=False)]
        before = srv.wait_idle()
        refused = out_of_memory_when(lambda plan: any(s.end > 150 for s in plan.segments))  # only BIG reaches 150
        *bystanders, big = _run_together(srv, with_big=True)
        assert refused, "the injected fault never fired"
        assert [r.status_code for r in bystanders] == [200, 200, 200]
        assert [r.json()["choices"][0]["text"] for r in bystanders] == expected
        assert big.status_code == 400, big.text
        error = big.json()["error"]
        assert error["code"] == "out_of_memory" and error["type"] == "invalid_request_error"
        assert "ran out of memory" in error["message"] and "shorter prompt" in error["message"]
        metrics = srv.wait_idle()
        assert metrics["requests_failed_for_memory"] - before["requests_failed_for_memory"] == 1
        assert srv.metric("forkpoint_requests_failed_for_memory_total") == metrics["requests_failed_for_memory"]
        srv.engine_call(lambda engine: engine.check_integrity())


def test_a_request_too_big_for_one_step_is_answered_from_smaller_steps(spare_llm, out_of_memory_when):
    """Steps over 64 tokens run out of memory: BIG's 200-token prompt is computed in smaller steps
    and every answer is the fault-free one."""
    with serve(spare_llm, ServerConfig()) as srv:
        expected = [r.json()["choices"][0]["text"] for r in _run_together(srv, with_big=True)]
        before = srv.wait_idle()
        refused = out_of_memory_when(lambda plan: sum(s.end - s.start for s in plan.segments) > 64)
        answers = _run_together(srv, with_big=True)
        assert refused and [r.status_code for r in answers] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in answers] == expected
        metrics = srv.wait_idle()
        # one retry or more: the retry caps the failing chunk at a quarter (engine/memory_retry.py), so
        # BIG's 50-token chunks fit beside decodes; a second one only when the bystanders' prompts were
        # in the same steps (timing)
        assert metrics["steps_retried_for_memory"] - before["steps_retried_for_memory"] >= 1
        assert metrics["requests_failed_for_memory"] == before["requests_failed_for_memory"]
        srv.engine_call(lambda engine: engine.check_integrity())
