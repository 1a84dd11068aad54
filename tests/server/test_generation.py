"""Admission (server/generation.py): places counted in sequences (prompts x n), per request and
per client (the request's `user`), all given back; a request's time to first token by part."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from forkpoint.outputs import CompletionOutput, RequestMetrics, RequestOutput
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.errors import APIError
from forkpoint.server.generation import Admission, Generation
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import EnginePrompt


def test_n_takes_n_places_and_gives_them_back():
    admission = Admission(4, 1)
    admission.admit(1, n=3)
    with pytest.raises(APIError) as info:  # 3 + 2 > 4: full for now
        admission.admit(1, n=2)
    assert info.value.status == 503
    with pytest.raises(APIError) as info:  # 5 > 4: never fits
        admission.admit(1, n=5)
    assert info.value.status == 400 and info.value.param == "n"
    admission.first_token(3)
    assert (admission.waiting, admission.running) == (0, 3)
    admission.release("running", 3)
    assert (admission.waiting, admission.running, admission.waiting_by_client) == (0, 0, {})


def test_one_client_cannot_fill_the_queue_for_everyone():
    admission = Admission(10, 1, max_waiting_per_client=3)
    admission.admit(2, client="greedy")
    with pytest.raises(APIError) as info:
        admission.admit(1, n=2, client="greedy")
    assert info.value.status == 503 and "per client" in info.value.message
    admission.admit(3, client="polite")  # others are still admitted
    admission.admit(1, client="")  # requests without a user are one client
    admission.release("waiting", client="greedy")
    admission.admit(1, n=2, client="greedy")  # a place came back
    assert admission.waiting_by_client == {"greedy": 3, "polite": 3, "": 1} and admission.waiting == 7
    with pytest.raises(APIError) as info:  # more than one client may ever hold: never fits
        admission.admit(1, n=4, client="new")
    assert info.value.status == 400 and info.value.param == "n"


class _Worker:
    """add_many takes the prompt at `now`, and 20 ms later delivers one first-token output whose engine
    times (arrival, first scheduled, first token) are `engine_times(now)`."""

    def __init__(self, engine_times) -> None:
        self.engine_times = engine_times

    async def add_many(self, requests, sink) -> None:
        now = time.monotonic()
        await asyncio.sleep(0.02)
        times = RequestMetrics(*self.engine_times(now), queued_steps=2, prefill_steps=1)
        completion = CompletionOutput(0, "x", [7])
        sink.queue.put_nowait([RequestOutput(requests[0].request_id, None, [1, 2], [completion], metrics=times)])

    def abort(self, request_ids) -> None:
        pass


def _first_token_parts(engine_times, waited_before_handler: float | None = None) -> dict[str, float]:
    metrics = ServerMetrics(dict, lambda: 0, lambda: 0, endpoints=("chat",))

    async def run() -> None:
        received = time.monotonic() - 0.5
        arrived = None if waited_before_handler is None else received - waited_before_handler
        gen = Generation(_Worker(engine_times), Admission(4, 1), metrics, endpoint="chat", prompt_param="messages",
                         request_id="r", prompts=[EnginePrompt([1, 2], ())], params=SamplingParams(max_tokens=1),
                         received=received, arrived=arrived)
        await gen.start()
        async for _ in gen.outputs():
            break
        gen.close()

    asyncio.run(run())
    return {part: histogram._sum.get() for part, histogram in metrics.first_token_parts.items()}


def test_first_token_parts_add_up_on_the_engine_clock():
    parts = _first_token_parts(lambda now: (now, now + 0.005, now + 0.015))
    assert parts["prompt"] >= 0.5 and parts["queue"] == pytest.approx(0.005) and parts["prefill"] == pytest.approx(0.01)
    assert parts["handoff"] >= 0 and parts["delivery"] >= 0.005


def test_the_time_before_the_handler_is_the_request_part_of_the_time_to_first_token():
    """A request stamped 0.3 s before its handler started (its body read and validated meanwhile): the
    request part holds those 0.3 s, the prompt part only the handler's own time."""
    parts = _first_token_parts(lambda now: (now, now + 0.005, now + 0.015), waited_before_handler=0.3)
    assert parts["request"] == pytest.approx(0.3, abs=1e-6)
    assert 0.5 <= parts["prompt"] < 0.8
    assert _first_token_parts(lambda now: (now, now + 0.005, now + 0.015))["request"] == 0.0  # no stamp


def test_first_token_parts_are_left_out_for_an_engine_on_another_clock():
    """A replica's engine in another process: its monotonic times say nothing on this clock."""
    parts = _first_token_parts(lambda now: (now - 1000.0, now - 999.9, now - 999.8))
    assert all(value == 0 for value in parts.values())


def test_first_token_parts_log_the_steps_to_the_first_token(caplog):
    with caplog.at_level(logging.DEBUG, logger="forkpoint.server"):
        _first_token_parts(lambda now: (now, now + 0.005, now + 0.015))
    assert "queue 5.0 (2 steps), prefill 10.0 (1 steps), delivery" in caplog.text
