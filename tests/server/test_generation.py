"""Admission (server/generation.py): places counted in sequences (prompts x n), per request and
per client (the request's `user`), all given back; a request's time to first token by part; a
constrained request's grammar compiled before its prompts go to the engine thread."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from forkpoint.outputs import CompletionOutput, RequestMetrics, RequestOutput
from forkpoint.sampling_params import SamplingParams, StructuredOutputsParams
from forkpoint.server.errors import APIError
from forkpoint.server.generation import Admission, Generation
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import EnginePrompt
from forkpoint.server.worker import ServerShuttingDown


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


class _RecordingWorker:
    """An engine thread that takes every prompt and records what it was given."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def add_many(self, requests, sink) -> None:
        self.added += [r.request_id for r in requests]

    def abort(self, request_ids) -> None:
        self.aborted += list(request_ids)


class _Grammars:
    """`compile` raises `error`, or (without one) waits until it is cancelled."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.compiling: list[StructuredOutputsParams] = []

    async def compile(self, spec: StructuredOutputsParams) -> None:
        self.compiling.append(spec)
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()


CONSTRAINED = SamplingParams(max_tokens=1, n=2, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))


def _constrained_generation(worker, admission: Admission, grammars: _Grammars,
                            constraint_param: str | None = None) -> Generation:
    return Generation(worker, admission, ServerMetrics(dict, lambda: 0, lambda: 0, endpoints=("chat",)),
                      endpoint="chat", prompt_param="messages", request_id="g", prompts=[EnginePrompt([1, 2], ())],
                      params=CONSTRAINED, client="u", grammars=grammars, constraint_param=constraint_param)


@pytest.mark.parametrize("error,constraint_param,status,param", [
    (ValueError("structured_outputs.regex does not compile: nope"), "response_format", 400, "response_format"),
    (ValueError("structured_outputs.regex does not compile: nope"), None, 400, "messages"),
    (ServerShuttingDown("the server is shutting down"), "response_format", 503, None)])
def test_a_constraint_that_cannot_compile_is_refused_before_the_engine(error, constraint_param, status, param):
    """A 400 naming the field that carried the constraint (the prompt field when none is known), a 503 shutting
    down, with the places given back and nothing handed to the engine thread."""
    admission, worker, grammars = Admission(4, 1), _RecordingWorker(), _Grammars(error)
    gen = _constrained_generation(worker, admission, grammars, constraint_param)
    with pytest.raises(APIError) as info:
        asyncio.run(gen.start())
    assert (info.value.status, info.value.param) == (status, param) and str(error) in info.value.message
    assert grammars.compiling == [CONSTRAINED.structured_outputs]
    assert (admission.waiting, admission.waiting_by_client, worker.added) == (0, {}, [])


def test_a_request_cancelled_while_its_grammar_compiles_leaves_nothing():
    """A request whose wait for its grammar is cancelled gives its places back and never reaches the engine."""
    admission, worker, grammars = Admission(4, 1), _RecordingWorker(), _Grammars()
    gen = _constrained_generation(worker, admission, grammars)

    async def run() -> None:
        start = asyncio.ensure_future(gen.start())
        while not grammars.compiling:
            await asyncio.sleep(0)
        assert admission.waiting == 2  # n=2: two places while it compiles
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        gen.close()

    asyncio.run(run())
    assert (admission.waiting, admission.running, admission.waiting_by_client) == (0, 0, {})
    assert worker.added == [] and worker.aborted == []


def test_a_request_without_a_constraint_is_not_held_for_grammars():
    admission, worker, grammars = Admission(4, 1), _RecordingWorker(), _Grammars()
    gen = Generation(worker, admission, ServerMetrics(dict, lambda: 0, lambda: 0, endpoints=("chat",)),
                     endpoint="chat", prompt_param="messages", request_id="p", prompts=[EnginePrompt([1, 2], ())],
                     params=SamplingParams(max_tokens=1), grammars=grammars)
    asyncio.run(gen.start())
    assert grammars.compiling == [] and worker.added == ["p-0"]


def test_a_response_that_does_not_stream_is_built_twice_not_every_step(server):
    """The engine builds a cumulative output (every token id and the whole text, copied) for a prompt that
    streams each step; for one that does not, only at its first token (admission, time to first token) and
    when it finishes, with the same text."""
    built: list[str] = []

    def spy(engine) -> None:
        make = engine._make_output

        def recording(group):
            built.append(group.request_id)
            return make(group)

        engine._make_output = recording

    def unspy(engine) -> None:
        del engine._make_output

    client = server.client()
    fields = dict(model=server.model, messages=[{"role": "user", "content": "count the rivers"}], max_tokens=9,
                  temperature=0.0, extra_body={"ignore_eos": True})
    server.engine_call(spy)
    try:
        whole = client.chat.completions.create(**fields)
        chunks = list(client.chat.completions.create(stream=True, **fields))
    finally:
        server.engine_call(unspy)
    assert built.count(f"{whole.id}-0") == 2 and whole.usage.completion_tokens == 9
    assert built.count(f"{chunks[0].id}-0") == 9  # one per sampled token
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    server.engine_call(lambda engine: engine.check_integrity())
