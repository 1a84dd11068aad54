"""The engine thread: the one thread that owns and steps the `LLMEngine` (which is not
thread-safe). Request handlers on the asyncio loop talk to it only through a command queue; it
answers through futures and per-request `OutputSink`s.

    event loop (handlers)                         engine thread
    ---------------------                         -------------
    add_many(...) --------> command queue ------> engine.add_request(...) -> future result
    abort(ids)    --------> command queue ------> engine.abort_request(id)
                                                  engine.step() -> outputs
    sink.queue  <-- loop.call_soon_threadsafe --- one per event loop per step (deliver_together)

All commands waiting in the queue are applied before each step, so requests that arrive together
(one producer and its consumers) are scheduled together. A failure the engine cannot continue from
(a tensor-parallel rank failed) ends every request and the thread, so /health reports 503.

Each step's deliveries go out together through `deliver` ({sink: outputs or the exception that ends
it}); by default `deliver_each`, one wake-up of the event loop a step. An engine in its own process (engine_child.py)
sends them to the server process in one message instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forkpoint.engine.engine import LLMEngine, StepFailed
from forkpoint.engine.memory_retry import OutOfMemory
from forkpoint.outputs import RequestOutput
from forkpoint.runner.errors import RunnerUnusable
from forkpoint.sampling_params import SamplingParams

logger = logging.getLogger("forkpoint.server")


class ServerShuttingDown(RuntimeError):
    """The server is draining: no new requests, and unfinished ones are aborted at the deadline."""


class EngineFailure(RuntimeError):
    """The engine raised while stepping; the requests in flight were aborted."""


class RequestOutOfMemory(EngineFailure):
    """The request ran out of memory alone in the smallest step (engine/memory_retry.py): the
    client's to fix (a 400), not the server's."""


# one step's deliveries: each sink (an `OutputSink`, or any hashable the worker's `deliver` understands) with
# the outputs of its requests that progressed, or the exception that ends them
Deliveries = Mapping[Hashable, "list[RequestOutput] | BaseException"]


def deliver_each(deliveries: Deliveries) -> None:
    """The default delivery: each `OutputSink`'s item into its queue (`deliver_together`)."""
    deliver_together(deliveries.items())


def deliver_together(deliveries: Iterable[tuple[OutputSink, list[RequestOutput] | BaseException]]) -> None:
    """Put each item into its `OutputSink`'s queue, with one `call_soon_threadsafe` per event loop: each
    call wakes the loop through its self-pipe (a syscall, a handle), and one per sink per step cost the
    engine thread ~0.4 ms a step at 256 streams on the 2-core CPU (bench/stream_chunk_cost.py)."""
    puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for sink, item in deliveries:
        puts.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, items in puts.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for into, item in items:
        into.put_nowait(item)


class OutputSink:
    """Delivery point of one HTTP request's engine requests, on the server's event loop.

    The engine thread puts either a list of `RequestOutput`s (cumulative, one per request that
    progressed in a step) or an exception (`EngineFailure`, `ServerShuttingDown`) that ends them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()

    def deliver_threadsafe(self, item: list[RequestOutput] | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass


@dataclass(frozen=True)
class NewRequest:
    """One prompt for the engine (`prompt`: a `ProcessedPrompt`, or a prompt dict for replicas);
    cache_key: the request's prompt_cache_key (replicas route its group together), or None;
    turn_positions / turn_end_reusable: a chat prompt dict's turn boundaries in its marker-free ids and
    whether its turn end can start the next turn (inputs/turns.py; in the `ProcessedPrompt` otherwise)."""

    request_id: str
    prompt: Any
    params: SamplingParams
    cache_key: str | None = None
    turn_positions: tuple[int, ...] = ()
    turn_end_reusable: bool = True
    tenant: str = ""  # the client (`user`; "" for none) whose checkpoint share it draws on
    # the HTTP response streams: the engine reports the prompt every step, as deltas (only what is new) until
    # the finished output; otherwise only in the step of its first token and when it finishes (a cumulative
    # output costs in proportion to the output so far)
    stream: bool = True

    def engine_prompt(self, engine: Any) -> Any:
        """What `engine.add_request` takes: the prompt, processed here with its turns when it is a dict
        that carries them (engine thread; raises ValueError naming the problem)."""
        if isinstance(self.prompt, dict) and (self.turn_positions or not self.turn_end_reusable):
            return engine.inputs.process(self.prompt, turn_positions=self.turn_positions,
                                         turn_end_reusable=self.turn_end_reusable)
        return self.prompt


@dataclass(frozen=True)
class _Add:
    requests: Sequence[NewRequest]
    sink: Hashable
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _Abort:
    request_ids: Sequence[str]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _Stop:
    deadline: float


class EngineWorker:
    """Owns `engine` on a background thread between `start()` and `shutdown()`; `deliver` hands each
    step's outputs and failures to their sinks (engine thread; default: `deliver_each`)."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[Deliveries], None] = deliver_each) -> None:
        self._engine = engine
        self._deliver = deliver
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="forkpoint-engine", daemon=True)
        self._metrics: dict[str, float] = {}
        # engine thread only:
        self._sinks: dict[str, Hashable] = {}
        self._deadline: float | None = None
        self._fatal: BaseException | None = None  # the engine cannot step any more

    # ---- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._metrics = dict(self._engine.metrics())
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def metrics_snapshot(self) -> dict[str, float]:
        """`engine.metrics()` as of the last step (a fresh dict each time; never mutated)."""
        return self._metrics

    async def add_many(self, requests: Sequence[NewRequest], sink: OutputSink) -> None:
        """Add all `requests` in one go (all or none), delivering their outputs to `sink`.

        Raises the engine's ValueError (nothing was added) or `ServerShuttingDown`.
        """
        await asyncio.wrap_future(self.submit(requests, sink))

    def submit(self, requests: Sequence[NewRequest], sink: Hashable) -> concurrent.futures.Future:
        """`add_many` from any thread: the future is done (None, or the error `add_many` raises) on the
        engine thread once the engine took the requests, before any step reports them."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(requests, sink, done), done)
        return done

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored); frees their resources."""
        if request_ids:
            self._commands.put(_Abort(tuple(request_ids)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (for checks such as
        `engine.check_integrity()`); the future holds its result or exception."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done), done)
        return done

    def shutdown(self, timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout_s`, abort the rest
        (their sinks get `ServerShuttingDown`) and join the thread. Blocking."""
        if not self._thread.is_alive():
            return
        self._commands.put(_Stop(time.monotonic() + timeout_s))
        self._thread.join()

    def _send(self, command: Any, done: concurrent.futures.Future) -> None:
        if not self._thread.is_alive():
            done.set_exception(ServerShuttingDown("the engine thread is not running"))
            return
        self._commands.put(command)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while self._fatal is None:
            busy = self._engine.has_unfinished_requests()
            if self._deadline is not None:
                if not self._sinks or time.monotonic() >= self._deadline:
                    break
                self._drain(timeout=0.0 if busy else 0.01)
            else:
                self._drain(timeout=0.0 if busy else None)
            if self._engine.has_unfinished_requests():
                self._step()
        self._fail_all(ServerShuttingDown("the server is shutting down; the request was aborted"))
        self._fail_pending_commands()
        self._metrics = dict(self._engine.metrics())

    def _drain(self, timeout: float | None) -> None:
        """Apply all queued commands; wait up to `timeout` (None: forever) for the first one."""
        try:
            command = self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._metrics = dict(self._engine.metrics())

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if self._sinks.pop(request_id, None) is not None:
                    self._engine.abort_request(request_id)
                    logger.info("request %s aborted (the client went away or the request was cancelled)",
                                request_id)
        elif isinstance(command, _Call):
            try:
                command.done.set_result(command.fn(self._engine))
            except Exception as exc:
                command.done.set_exception(exc)
        elif isinstance(command, _Stop):
            self._deadline = command.deadline

    def _add(self, command: _Add) -> None:
        if self._deadline is not None:
            command.done.set_exception(ServerShuttingDown("the server is shutting down"))
            return
        added: list[str] = []
        try:
            for request in command.requests:
                self._engine.add_request(request.request_id, request.engine_prompt(self._engine), request.params,
                                         stream=request.stream, deltas=request.stream,
                                         report_first_token=not request.stream,
                                         tenant=request.tenant)
                added.append(request.request_id)
        except Exception as exc:
            for request_id in added:
                self._engine.abort_request(request_id)
            command.done.set_exception(exc)
            return
        for request_id in added:
            self._sinks[request_id] = command.sink
        command.done.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except StepFailed as failure:
            if isinstance(failure.cause, RunnerUnusable):  # no later step can run: end the thread
                logger.error("the engine cannot continue: %s", failure.cause)
                self._fatal = failure.cause
                self._fail_all(EngineFailure(f"the engine failed: {failure.cause}"))
                return
            # the engine released the step and stays usable: only the requests in that step fail
            self._fail_some(failure.request_ids, RequestOutOfMemory(str(failure.cause))
                            if isinstance(failure.cause, OutOfMemory) else EngineFailure(
                f"the engine failed while generating: {type(failure.cause).__name__}: {failure.cause}"))
            outputs = failure.outputs
        except Exception as exc:
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_all(EngineFailure(f"the engine failed while generating: {type(exc).__name__}: {exc}"))
            return
        batches: dict[Hashable, list[RequestOutput]] = defaultdict(list)
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            batches[sink].append(output)
            if output.finished:
                del self._sinks[output.request_id]
        self._metrics = dict(self._engine.metrics())  # before the outputs: a reader of both sees them agree
        if batches:
            self._deliver(batches)

    def _fail_some(self, request_ids: Sequence[str], exc: BaseException) -> None:
        """End the sinks of `request_ids` (already ended in the engine) with `exc`; a sink that also
        carries other requests has them aborted, since its response can no longer complete."""
        sinks = {self._sinks[r] for r in request_ids if r in self._sinks}
        for request_id, sink in list(self._sinks.items()):
            if sink in sinks:
                self._engine.abort_request(request_id)
                del self._sinks[request_id]
        if sinks:
            self._deliver(dict.fromkeys(sinks, exc))

    def _fail_all(self, exc: BaseException) -> None:
        """Abort every request in flight and end its sink with `exc`."""
        sinks = set(self._sinks.values())
        if self._sinks:
            logger.warning("aborting %d request(s) in flight: %s", len(self._sinks), exc)
        for request_id in list(self._sinks):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
        self._sinks.clear()
        if sinks:
            self._deliver(dict.fromkeys(sinks, exc))

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)):
                command.done.set_exception(ServerShuttingDown("the server is shutting down"))
