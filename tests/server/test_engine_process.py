"""`--engine-process`: the engine in a process of its own behind the same HTTP server. Outputs equal the
one-process server's, errors keep their codes, a client that goes away leaves nothing behind, a dead
engine process fails what was in flight and /health says so, a stop while streams run ends the engine
process at once, and Ctrl-C stops both processes. The tests of the processes around the engine run the
tiny word-level model (`tiny_engine`): it starts in a fraction of the embedded model's time."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from forkpoint.server.app import build_process_app
from forkpoint.server.cli import main
from forkpoint.server.config import MarkerPolicy, ServerConfig
from forkpoint.server.engine_messages import Failure
from forkpoint.server.process_worker import ProcessWorker, start_engine_process
from forkpoint.server.worker import EngineFailure, RequestOutOfMemory, ServerShuttingDown
from tests.server.conftest import MARKER, TEST_LLM_KWARGS, RunningServer, serve_process, uvicorn_thread
from tests.server.test_image_prompts import data_url, messages
from tests.tiny_models import random_image


@pytest.fixture
def tiny_engine(tiny_model_factory) -> dict:
    """`LLM` arguments of the tiny word-level model (prompts are words "w0".."w151": tiny_models.words)."""
    directory, _ = tiny_model_factory("qwen3_5_text")
    return {"model": str(directory), "max_model_len": 2048, "num_kv_blocks": 512, "max_num_seqs": 32}


def engine_state(engine) -> tuple[bool, float]:
    """(has unfinished requests, state slots in use) after the pools' integrity check (engine thread)."""
    engine.check_integrity()
    return engine.has_unfinished_requests(), engine.metrics()["state_slots_used"]


def engine_metrics(engine) -> dict[str, float]:
    return engine.metrics()


@contextmanager
def process_server(config: ServerConfig, graceful_timeout_s: float = 5,
                   engine_kwargs: dict | None = None) -> Iterator[tuple[RunningServer, ProcessWorker]]:
    worker, front = start_engine_process(engine_kwargs or dict(TEST_LLM_KWARGS),
                                         served_model_name=config.served_model_name,
                                         marker_policy=config.marker_policy, log_level="warning")
    try:
        assert worker.metrics_snapshot()["kv_blocks_total"] > 0  # /metrics and the stats line have them at once
        app = build_process_app(worker, front, config)
        with uvicorn_thread(app, graceful_timeout_s) as (url, server, thread):
            yield RunningServer(url, app, None, server, thread), worker
    finally:
        worker.shutdown(timeout_s=0.0)


@pytest.fixture(scope="module")
def remote():
    with process_server(ServerConfig(served_model_name="forkpoint-test")) as (running, worker):
        yield running, worker
    assert worker._process.exitcode == 0  # stopped by its Stop, not killed


def wait_idle(worker: ProcessWorker, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while worker.call(engine_state).result(timeout=60) != (False, 0):
        assert time.monotonic() < deadline, "the engine process still holds requests or state slots"
        time.sleep(0.05)


def test_outputs_equal_the_one_process_server(server, remote):
    """Greedy chat with logprobs (whole and streamed), seeded sampling with n = 2, and a constraint: the
    same tokens, text and logprobs as the one-process server on the same model."""
    there = remote[0].client()
    here = server.client()
    chat = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    a = there.chat.completions.create(model=remote[0].model, **chat)
    b = here.chat.completions.create(model=server.model, **chat)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].logprobs.model_dump() == b.choices[0].logprobs.model_dump()
    assert a.usage.completion_tokens == 12
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in there.chat.completions.create(
        model=remote[0].model, stream=True, **chat) if chunk.choices)
    assert streamed == a.choices[0].message.content
    sampled = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "n": 2, "seed": 7}
    assert ([c.text for c in there.completions.create(model=remote[0].model, **sampled).choices]
            == [c.text for c in here.completions.create(model=server.model, **sampled).choices])
    constrained = {"prompt": "Yes or no?", "max_tokens": 5,
                   "extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}
    text = there.completions.create(model=remote[0].model, **constrained).choices[0].text
    assert text in ("yes", "no") and text == here.completions.create(model=server.model, **constrained).choices[0].text
    wait_idle(remote[1])


def test_checkpoints_are_reused_and_metrics_come_from_the_engine_process(remote, anchor_text):
    running, worker = remote
    client = running.client()
    prompt = anchor_text("engine-process") + MARKER
    first = client.completions.create(model=running.model, prompt=prompt + " first", max_tokens=2)
    second = client.completions.create(model=running.model, prompt=prompt + " second", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    deadline = time.monotonic() + 10  # the engine process sends its metrics when they change
    while running.metric("forkpoint_checkpoint_hits_total") < 1:
        assert time.monotonic() < deadline, "the checkpoint hit never reached /metrics"
        time.sleep(0.05)
    wait_idle(worker)


def test_errors_keep_their_codes(remote):
    running, _ = remote
    client = running.client()
    with pytest.raises(openai.BadRequestError) as bad:  # compiled in the engine process
        client.completions.create(model=running.model, prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": {"regex": "("}})
    assert bad.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=running.model, prompt=[1] * 5000, max_tokens=2)
    assert long.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("error", [ValueError("bad prompt"), ServerShuttingDown("bye"), EngineFailure("step"),
                                   RequestOutOfMemory("too big")])
def test_a_failure_crosses_the_pipe_as_its_own_kind(error):
    again = Failure.of(error).error()
    assert type(again) is type(error) and str(again) == str(error)


def test_any_other_failure_arrives_as_an_engine_failure_naming_it():
    again = Failure.of(KeyError("slot")).error()
    assert isinstance(again, EngineFailure) and "KeyError" in str(again)


def test_a_call_must_be_a_module_level_function(remote):
    with pytest.raises(ValueError, match="module-level function"):
        remote[1].call(lambda engine: engine.metrics())


def engine_lock(engine) -> threading.Lock:
    """A call's result that does not pickle."""
    return threading.Lock()


def test_a_result_that_does_not_pickle_fails_its_call_only(remote):
    _, worker = remote
    with pytest.raises(EngineFailure, match="TypeError.*did not pickle"):
        worker.call(engine_lock).result(timeout=60)
    assert worker.is_alive() and "requests_aborted" in worker.call(engine_metrics).result(timeout=60)


def test_a_client_that_goes_away_leaves_nothing_behind(remote):
    running, worker = remote
    body = {"model": running.model, "prompt": "go on and on", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    wait_idle(worker)
    aborted = worker.call(engine_metrics).result(timeout=60)["requests_aborted"]
    assert aborted >= 1
    deadline = time.monotonic() + 10  # the engine process sends its metrics when they change
    while worker.metrics_snapshot()["requests_aborted"] != aborted:
        assert time.monotonic() < deadline, "the abort never reached the server process's metrics"
        time.sleep(0.05)


def test_a_dead_engine_process_fails_the_requests_in_flight_and_health(tiny_engine):
    with process_server(ServerConfig(served_model_name="m"), engine_kwargs=tiny_engine) as (running, worker):
        errors: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line.startswith("data: ") and line != "data: [DONE]" and "error" in json.loads(line[6:]):
                        errors.append(json.loads(line[6:])["error"]["message"])

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert started.wait(60)
        worker._process.kill()
        thread.join(60)
        assert errors and "engine process exited" in errors[0]
        assert httpx.get(f"{running.base_url}/health", timeout=10).status_code == 503
        assert not worker.is_alive()
        with pytest.raises(openai.APIStatusError) as refused:
            running.client().completions.create(model="m", prompt="w4", max_tokens=2)
        assert refused.value.status_code == 503


def test_a_stop_while_streams_run_ends_the_engine_process_at_once(tiny_engine, monkeypatch, caplog):
    """Shutdown while 16 streams are mid-flight and a /health probe asks `is_alive()` meanwhile: the engine
    process exits 0 within 5 s, shutdown logs no error and raises nothing, and every stream ends
    with the shutdown's error event. The interleaving that made shutdown kill an engine process that had already
    exited (2 of ~8 benchmark runs on a loaded machine) is forced here: another thread of the server (the probe,
    or the reader thread at the events pipe's end) reaps the exited process first and is descheduled before it
    records the exit code; a shutdown that then reads the process as running logs 'did not stop' and signals a
    pid that no longer exists (ProcessLookupError)."""
    with process_server(ServerConfig(served_model_name="m"), engine_kwargs=tiny_engine) as (running, worker):
        ends: list[str] = []
        started = threading.Semaphore(0)

        def stream() -> None:
            body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            last = ""
            with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if not last:
                            started.release()
                        last = line
            ends.append(last)

        streams = [threading.Thread(target=stream, daemon=True) for _ in range(16)]
        for thread in streams:
            thread.start()
        for _ in streams:
            assert started.acquire(timeout=60)
        probing = threading.Event()

        def probe() -> None:  # what /health asks
            while not probing.is_set():
                worker.is_alive()
                time.sleep(0.001)

        stopper, pid, real_waitpid = threading.current_thread(), worker._process.pid, os.waitpid
        reaped = threading.Event()

        def waitpid(waited: int, options: int) -> tuple[int, int]:
            if waited != pid:
                return real_waitpid(waited, options)
            if threading.current_thread() is stopper:
                reaped.wait(1.0)  # another thread reaps the engine process first ...
                return real_waitpid(waited, options)
            result = real_waitpid(waited, options)
            if result[0] == pid:
                reaped.set()
                time.sleep(0.5)  # ... and waits for a core before it records the exit code (a loaded machine)
            return result

        monkeypatch.setattr(os, "waitpid", waitpid)  # multiprocessing's Process.join / is_alive call it
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        began = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="forkpoint.server"):
            worker.shutdown(timeout_s=0.0)
        took = time.monotonic() - began
        probing.set()
        prober.join(10)
        monkeypatch.undo()
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert worker._process.exitcode == 0 and not worker.is_alive()
        assert took < 5, f"the engine process took {took:.1f} s to stop"
        for thread in streams:
            thread.join(30)
        assert len(ends) == 16 and all("shutting down" in json.loads(end[6:])["error"]["message"] for end in ends)


def test_serve_engine_process_stops_on_ctrl_c(tiny_engine, tmp_path: Path):
    """`forkpoint serve --engine-process` answers, and Ctrl-C (SIGINT to the process group, as a terminal
    sends it) stops the server and its engine process: the server exits 0 and no process of the group is left."""
    args = [tiny_engine["model"], "--engine-process", "--max-model-len", "1024", "--served-model-name", "m"]
    with serve_process(args, tmp_path / "serve.log", new_session=True) as running:
        reply = httpx.post(f"{running.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 3, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert "GIL switch interval 0.5 ms in the server and engine processes" in running.output()
        os.killpg(running.process.pid, signal.SIGINT)
        assert running.process.wait(timeout=60) == 0, running.output()
        deadline = time.monotonic() + 20
        while True:  # the engine process ends after the server's Stop (it ignores the SIGINT itself)
            try:
                os.killpg(running.process.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.1)


def switch_interval(engine) -> float:
    return sys.getswitchinterval()


def test_the_engine_process_sets_its_switch_interval(tiny_engine):
    """The engine process runs with the GIL switch interval it was given (its command reader and outbox thread wait
    up to one interval for the GIL on every message: docs/server.md "The pipe's crossings"); this process's own
    is left alone (its entry point's to set)."""
    here = sys.getswitchinterval()
    worker, _ = start_engine_process(tiny_engine, served_model_name="m", marker_policy=MarkerPolicy("allow"),
                                     log_level="warning", switch_interval_s=0.0007)
    try:
        worker.start()
        assert worker.call(switch_interval).result(timeout=60) == pytest.approx(0.0007)
        assert sys.getswitchinterval() == here
    finally:
        worker.shutdown(timeout_s=0.0)


def test_a_switch_interval_without_the_engine_process_is_refused(capsys):
    assert main(["serve", "--gil-switch-interval-ms", "1"]) == 2
    assert "--engine-process" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--engine-process", "--gil-switch-interval-ms", "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_engine_process_with_replicas_is_refused(capsys):
    assert main(["serve", "--engine-process", "--data-parallel-size", "2"]) == 2
    assert "--engine-process" in capsys.readouterr().err


def test_images_are_decoded_here_and_reach_the_engine_process(tiny_model_factory):
    """Chat with an image_url part: the image is decoded and placed in the server process, the prompt (with its
    pixels) crosses the pipe, and the second request reuses the checkpoint after the image."""
    directory, _ = tiny_model_factory("qwen3_5_moe")
    url = data_url(random_image(1, 40, 24))
    kwargs = {"model": str(directory), "num_kv_blocks": 128, "max_num_seqs": 4}
    with process_server(ServerConfig(served_model_name="m"), engine_kwargs=kwargs) as (running, worker):
        bodies = [{"model": "m", "max_tokens": 1, "temperature": 0.0,
                   "messages": [m.model_dump(exclude_none=True) for m in messages(url, i)]} for i in range(2)]
        responses = [running.post("/v1/chat/completions", json=body) for body in bodies]
        assert [r.status_code for r in responses] == [200, 200], responses[0].text
        position = running.post("/tokenize", json={"model": "m", "messages": bodies[0]["messages"]}).json()[
            "checkpoint_positions"][0]
        assert responses[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] == position > 15
        wait_idle(worker)
