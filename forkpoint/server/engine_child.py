"""The engine process of `forkpoint serve --engine-process`: one `LLM` stepped by the server's
`EngineWorker`, driven over two one-way pipes by the server process's `ProcessWorker`
(process_worker.py; the messages: engine_messages.py).

    main thread      reads commands: Add -> EngineWorker.submit, Abort, Compile -> grammar threads,
                     Call -> EngineWorker.call, Stop -> shutdown (in a thread: aborts still arrive)
    engine thread    EngineWorker: steps; each step's deliveries -> one `Delivered` in the outbox
    outbox thread    pickles and sends the events in order
    metrics thread   sends the engine's metrics when they changed (every METRICS_PERIOD_S at most)

Why a process: the server's event loop (HTTP, JSON, SSE chunks) and its tokenizer threads (chat
templates, tokenisation) share one GIL with the engine thread in a single process, so every
request's Python work delays the next step (profiled at 256 sessions on the H200: the GIL held 53%
of the time, the engine thread waiting for it behind the event loop and the tokenizer pool). Here
the step loop has a GIL of its own. SIGINT is ignored (Ctrl-C reaches the whole process group; the
server process decides when to stop and sends Stop); when the server process goes away without
Stop, its pipe closes and this process stops as if told to stop at once.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import logging
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from forkpoint.llm import LLM
from forkpoint.server.config import MarkerPolicy
from forkpoint.server.engine_front import EngineFront
from forkpoint.server.engine_messages import (
    Abort,
    Acknowledged,
    Add,
    Call,
    Compile,
    Delivered,
    Failure,
    Metrics,
    Ready,
    StartFailed,
    Stop,
)
from forkpoint.server.grammar_threads import GRAMMAR_THREADS
from forkpoint.server.prompt_threads import PromptThreads
from forkpoint.server.stats import engine_summary
from forkpoint.server.worker import Deliveries, EngineWorker

logger = logging.getLogger("forkpoint.server")

METRICS_PERIOD_S = 0.05
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"


def run_engine_process(engine_kwargs: dict[str, Any], served_model_name: str, marker_policy: MarkerPolicy,
                       log_level: str, commands: Connection, events: Connection,
                       switch_interval_s: float | None = None) -> None:
    """The engine process's entry point (multiprocessing, spawn): load the engine, send `Ready` (or
    `StartFailed`), serve commands until Stop or the server process is gone. `switch_interval_s`: this
    interpreter's GIL switch interval (None: CPython's 5 ms), set here because it is the process's own
    setting: the command reader and the outbox thread each wait up to one interval for the GIL while the
    engine thread holds it, on every message that crosses (docs/server.md, "The pipe's crossings")."""
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack (the server sends it before a kill)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        began = time.perf_counter()
        llm = LLM(**engine_kwargs)
        loaded = time.perf_counter() - began
        engine = llm.engine
        try:  # structured outputs' vocabulary view now, not on the first constrained request
            engine.grammars.prepare()
        except ValueError as err:  # a slow tokenizer: constrained requests get this error as a 400
            logger.info("structured outputs unavailable: %s", err)
        engine.wait_for_host_tier()
        front = EngineFront.of(llm, engine_summary(llm, served_model_name, marker_policy, loaded))
    except Exception as error:  # the server process reports it and exits
        events.send(StartFailed(Failure.of(error)))
        events.close()
        return
    gc.collect()
    gc.freeze()  # as `forkpoint serve` does with its start-up heap (cli.freeze_startup_heap)
    _EngineChild(llm, events).serve(front, commands)


class _Outbox:
    """Events to the server process, sent in order by one thread; `close()` sends what is queued, then
    closes the pipe (the server process reads its end as the engine's end)."""

    def __init__(self, events: Connection) -> None:
        self._events = events
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="forkpoint-engine-outbox", daemon=True)
        self._thread.start()

    def put(self, event: object) -> None:
        self._queue.put(event)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while (event := self._queue.get()) is not None:
                self._events.send_bytes(_pickled(event))
        except OSError:  # the server process is gone: nobody reads
            logger.warning("the server process closed its pipe; events are dropped")
        finally:
            self._events.close()


def _pickled(event: object) -> bytes:
    """`event` as `Connection.send` pickles it. A call's result or a step's outputs that do not pickle
    fail only their own waiters (the call, the step's requests) with a TypeError naming why; the pipe and
    the engine go on."""
    try:
        return ForkingPickler.dumps(event)
    except Exception as error:  # noqa: BLE001 - whatever pickling raised, it ends only this event's waiters
        failure = Failure.of(TypeError(f"the engine process's {type(event).__name__} did not pickle: {error}"))
        logger.error("%s", failure.message)
        if isinstance(event, Acknowledged):
            return ForkingPickler.dumps(Acknowledged(event.call_id, failure=failure))
        if isinstance(event, Delivered):
            return ForkingPickler.dumps(Delivered([(sink_id, failure) for sink_id, _ in event.items], event.metrics))
        raise


class _EngineChild:
    def __init__(self, llm: LLM, events: Connection) -> None:
        self._llm = llm
        self._outbox = _Outbox(events)
        self._worker = EngineWorker(llm.engine, deliver=self._deliver)
        self._grammars = PromptThreads(GRAMMAR_THREADS, "forkpoint-grammar")
        self._stopped = threading.Event()

    def serve(self, front: EngineFront, commands: Connection) -> None:
        self._outbox.put(Ready(front, dict(self._llm.engine.metrics())))
        self._worker.start()
        threading.Thread(target=self._publish_metrics, name="forkpoint-engine-metrics", daemon=True).start()
        stopping: threading.Thread | None = None
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):  # the server process is gone, or closed the pipe after Stop
                break
            if isinstance(command, Stop):
                if stopping is None:
                    stopping = threading.Thread(target=self._stop, args=(command.timeout_s,),
                                                name="forkpoint-engine-stop", daemon=True)
                    stopping.start()
            else:
                self._apply(command)
        if stopping is None:
            self._stop(0.0)
        else:
            stopping.join()

    def _apply(self, command: object) -> None:
        if isinstance(command, Add):
            done = self._worker.submit(command.requests, command.sink_id)
            done.add_done_callback(functools.partial(self._acknowledge, command.sink_id))
        elif isinstance(command, Abort):
            self._worker.abort(command.request_ids)
        elif isinstance(command, Compile):
            try:
                done = self._grammars.submit(self._llm.engine.grammars.ensure_compiled, command.spec)
            except RuntimeError as error:  # stopping: the threads take no more work
                self._outbox.put(Acknowledged(command.call_id, failure=Failure.of(error)))
                return
            done.add_done_callback(functools.partial(self._acknowledge, command.call_id))
        elif isinstance(command, Call):
            self._worker.call(command.fn).add_done_callback(functools.partial(self._acknowledge, command.call_id))
        else:
            logger.error("unknown command from the server process: %r", type(command).__name__)

    def _acknowledge(self, call_id: int, done) -> None:
        error = done.exception()
        self._outbox.put(Acknowledged(call_id, failure=Failure.of(error)) if error is not None
                         else Acknowledged(call_id, done.result()))

    def _deliver(self, deliveries: Deliveries) -> None:
        """Engine thread: one step's deliveries as one event (sinks are the server process's sink ids)."""
        items = [(sink_id, item if isinstance(item, list) else Failure.of(item))
                 for sink_id, item in deliveries.items()]
        self._outbox.put(Delivered(items, self._worker.metrics_snapshot()))

    def _publish_metrics(self) -> None:
        """The engine's metrics whenever they changed outside a delivery (an abort, a finished command)."""
        last = None
        while not self._stopped.wait(METRICS_PERIOD_S):
            values = self._worker.metrics_snapshot()  # a fresh dict whenever they change
            if values is not last:
                self._outbox.put(Metrics(values))
                last = values

    def _stop(self, timeout_s: float) -> None:
        """Let requests finish for `timeout_s`, abort the rest (their sinks get ServerShuttingDown), send
        the last metrics and close the events pipe."""
        self._worker.shutdown(timeout_s)
        self._grammars.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        self._outbox.put(Metrics(self._worker.metrics_snapshot()))
        self._outbox.close()
