"""The server process's side of an engine in its own process (`forkpoint serve --engine-process`):
`start_engine_process` spawns it (engine_child.py) and waits until it is ready; `ProcessWorker` has
`EngineWorker`'s surface (`add_many`, `abort`, `call`, `metrics_snapshot`, `is_alive`, `shutdown`), so
`OpenAIServing` and `Generation` run on it unchanged, and `compile` for the requests' constraints,
which compile in the engine process (its compiler's cache is the one the engine reads).

    event loop / any thread                       reader thread (events from the engine process)
    -----------------------                       ----------------------------------------------
    add_many: register the sink, send Add    ->   Acknowledged -> the add's future
    abort: send Abort, forget the ids             Delivered    -> the sinks' queues, one wake-up a loop
    call / compile: send, await the future        Metrics      -> metrics_snapshot
    shutdown: send Stop, wait for the end         end of pipe  -> every open sink and future fails

Commands go out through one sender thread, so a large prompt's pickling and pipe write never hold
the event loop. If the engine process dies, every request in flight ends with `EngineFailure`,
`is_alive()` turns False (/health 503) and `forkpoint serve` exits 1 for its supervisor, as when the
engine thread ends (app.exit_when_engine_ends).

Several threads ask whether the engine process has exited (the reader at the pipe's end, `shutdown`,
/health's `is_alive`); one at a time reaps it (`_exit_code`). multiprocessing's `Process.join` and
`is_alive` are not safe from two threads at once: one thread's waitpid takes the exit status, and until
that thread records it, another one's waitpid finds no child and reads the process as running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from forkpoint.sampling_params import StructuredOutputsParams
from forkpoint.server.config import MarkerPolicy
from forkpoint.server.engine_child import run_engine_process
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
from forkpoint.server.worker import EngineFailure, NewRequest, OutputSink, ServerShuttingDown, deliver_together

logger = logging.getLogger("forkpoint.server")

STOP_GRACE_S = 10.0  # beyond the shutdown timeout: the engine's last step and its messages


def start_engine_process(engine_kwargs: dict[str, Any], *, served_model_name: str, marker_policy: MarkerPolicy,
                         log_level: str = "info", switch_interval_s: float | None = None,
                         ) -> tuple[ProcessWorker, EngineFront]:
    """Spawn the engine process with `LLM(**engine_kwargs)` and wait until it is ready. Raises ValueError
    with the engine's message when it cannot start (a bad configuration, a missing model), or
    EngineFailure when the process died without one. switch_interval_s: the engine process's GIL switch
    interval (`sys.setswitchinterval`; None: CPython's 5 ms); this process's own is its entry point's to set
    (`forkpoint serve` sets both from --gil-switch-interval-ms)."""
    context = multiprocessing.get_context("spawn")  # never fork a process that holds threads (and CUDA)
    command_reader, command_writer = context.Pipe(duplex=False)
    event_reader, event_writer = context.Pipe(duplex=False)
    process = context.Process(target=run_engine_process, name="forkpoint-engine",
                              args=(engine_kwargs, served_model_name, marker_policy, log_level, command_reader,
                                    event_writer, switch_interval_s))  # not a daemon: it may start processes of its own
                                                    # (tensor-parallel ranks, compile workers); it ends on Stop or
                                                    # when this process's pipe closes
    process.start()
    command_reader.close()  # the child's ends: ours closed, so its exit closes the pipes
    event_writer.close()
    try:
        first = event_reader.recv()
    except EOFError:
        process.join()
        command_writer.close()
        raise EngineFailure(f"the engine process exited with code {process.exitcode} before it was ready "
                            "(its log above says why)") from None
    if isinstance(first, StartFailed):
        process.join()
        command_writer.close()
        error = first.failure.error()
        raise (ValueError(str(error)) if isinstance(error, ValueError) else error)
    assert isinstance(first, Ready), f"the engine process sent {type(first).__name__} before Ready"
    return ProcessWorker(process, command_writer, event_reader, first.metrics), first.front


class ProcessWorker:
    """`EngineWorker`'s surface over the engine process `process` (its command and event pipes); `metrics`:
    the engine's metrics as it was ready."""

    def __init__(self, process: BaseProcess, commands: Connection, events: Connection,
                 metrics: dict[str, float]) -> None:
        self._process = process
        self._commands = commands
        self._events = events
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the maps below: the event loop, callers of `call`, the reader thread
        self._sinks: dict[int, OutputSink] = {}
        self._open: dict[int, set[str]] = {}  # sink id -> its requests not finished yet
        self._sink_of: dict[str, int] = {}
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._metrics = metrics  # the engine's, as last sent (Ready's first)
        self._ended = threading.Event()  # the events pipe ended: the engine process stopped or died
        self._reaping = threading.Lock()  # `_process`'s waitpid and signals: one thread at a time (`_exit_code`)
        self._stopping = False
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="forkpoint-engine-events", daemon=True)
        self._sender = threading.Thread(target=self._send_all, name="forkpoint-engine-commands", daemon=True)

    # ---- EngineWorker's surface ----------------------------------------------------------------

    def start(self) -> None:
        self._reader.start()
        self._sender.start()

    def is_alive(self) -> bool:
        return self._exit_code(0.0) is None and not self._ended.is_set()

    def metrics_snapshot(self) -> dict[str, float]:
        """The engine's metrics as the engine process last sent them (a fresh dict each time they change)."""
        return self._metrics

    async def add_many(self, requests: Sequence[NewRequest], sink: OutputSink) -> None:
        """Add all `requests` in one go (all or none), delivering their outputs to `sink`. Raises the
        engine's ValueError (nothing was added) or `ServerShuttingDown` (also once the engine process has
        exited)."""
        sink_id = next(self._ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running()
            self._sinks[sink_id] = sink
            self._open[sink_id] = {request.request_id for request in requests}
            self._sink_of.update((request.request_id, sink_id) for request in requests)
            self._pending[sink_id] = done
        self._outgoing.put(Add(sink_id, tuple(requests)))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            with self._lock:
                self._forget_sink(sink_id)
            raise

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored); their outputs stop at once."""
        if not request_ids:
            return
        with self._lock:
            for request_id in request_ids:
                sink_id = self._sink_of.pop(request_id, None)
                if sink_id is not None:
                    self._open[sink_id].discard(request_id)
                    if not self._open[sink_id]:
                        self._forget_sink(sink_id)
        self._outgoing.put(Abort(tuple(request_ids)))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread in the engine process; `fn` and its result must pickle
        (a module-level function, not a lambda). The future holds the result or the exception."""
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ValueError(f"{fn!r} cannot be sent to the engine process (use a module-level function): "
                             f"{error}") from None
        return self._request(lambda call_id: Call(call_id, fn))

    async def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's constraint in the engine process's grammar threads (`GrammarThreads.compile`'s
        contract: the compiler's ValueError, or ServerShuttingDown)."""
        await asyncio.wrap_future(self._request(lambda call_id: Compile(call_id, spec)))

    def shutdown(self, timeout_s: float) -> None:
        """Let in-flight requests finish for up to `timeout_s`, abort the rest (their sinks get
        `ServerShuttingDown`), and wait for the engine process to end (killed if it does not). Blocking."""
        with self._lock:
            self._stopping = True
        if not self._sender.is_alive() and self._sender.ident is None:  # never started: close the pipe here
            self._commands.close()
        elif self._reader.is_alive():
            self._outgoing.put(Stop(timeout_s))
            self._ended.wait(timeout_s + STOP_GRACE_S)
        self._outgoing.put(None)  # the sender closes the command pipe: the engine process's reader ends
        if self._sender.ident is not None:
            self._sender.join(timeout=5)
        if self._exit_code(STOP_GRACE_S) is None:
            logger.error("the engine process did not stop; its threads' stacks follow in its log, then it is killed")
            self._signal(signal.SIGUSR1)  # engine_child registers faulthandler for it
            if self._exit_code(1.0) is None:
                self._signal(signal.SIGKILL)
            self._exit_code(None)

    # ---- internals -----------------------------------------------------------------------------

    def _exit_code(self, timeout_s: float | None) -> int | None:
        """The engine process's exit code once it has exited, waiting up to `timeout_s` (None: for ever);
        None while it runs. Any thread: the wait is on the process's sentinel, which reaps nothing; the
        reaping (`join`, whose waitpid records the exit code) happens under `_reaping`, so a thread never
        reads an exited process as alive because another thread's waitpid took its exit status and has
        not recorded it yet (that made shutdown kill an engine process that had already exited)."""
        if not multiprocessing.connection.wait([self._process.sentinel], timeout_s):
            return None
        with self._reaping:
            self._process.join()
            return self._process.exitcode

    def _signal(self, signum: int) -> None:
        """Send `signum` to the engine process unless it has been reaped (then its pid may name another process)."""
        with self._reaping:
            if self._process.exitcode is None:  # under the lock: not reaped, so the pid is still the engine process's
                os.kill(self._process.pid, signum)

    def _check_running(self) -> None:
        """(lock held) Raise ServerShuttingDown when no command can be served."""
        if self._stopping:
            raise ServerShuttingDown("the server is shutting down")
        if self._ended.is_set():  # as EngineWorker's "not running": a 503, /health says why
            raise ServerShuttingDown(f"the engine process has exited (code {self._exit_code(0.0)})")

    def _request(self, message: Callable[[int], object]) -> concurrent.futures.Future:
        call_id = next(self._ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            try:
                self._check_running()
            except ServerShuttingDown as error:
                done.set_exception(error)
                return done
            self._pending[call_id] = done
        self._outgoing.put(message(call_id))
        return done

    def _forget_sink(self, sink_id: int) -> None:
        """(lock held) No more deliveries to this sink."""
        self._sinks.pop(sink_id, None)
        for request_id in self._open.pop(sink_id, ()):
            self._sink_of.pop(request_id, None)

    def _send_all(self) -> None:
        """Sender thread: commands in order until None; a command that cannot be pickled fails its own call."""
        while (command := self._outgoing.get()) is not None:
            try:
                self._commands.send(command)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                self._fail_command(command, EngineFailure(f"could not send {type(command).__name__} to the engine "
                                                          f"process: {error}"))
            except OSError:  # the engine process is gone: the reader fails everything
                break
        self._commands.close()

    def _fail_command(self, command: object, error: Exception) -> None:
        call_id = getattr(command, "call_id", getattr(command, "sink_id", None))
        with self._lock:
            done = self._pending.pop(call_id, None)
        if done is not None and not done.done():
            done.set_exception(error)

    def _read(self) -> None:
        """Reader thread: events until the engine process closes its pipe (stopped) or dies."""
        while True:
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                break
            if isinstance(event, Delivered):
                self._metrics = event.metrics
                self._dispatch(event.items)
            elif isinstance(event, Acknowledged):
                with self._lock:
                    done = self._pending.pop(event.call_id, None)
                if done is not None and not done.done():
                    if event.failure is None:
                        done.set_result(event.value)
                    else:
                        done.set_exception(event.failure.error())
            elif isinstance(event, Metrics):
                self._metrics = event.values
        self._end()

    def _dispatch(self, items: Sequence[tuple[int, list | Failure]]) -> None:
        with self._lock:
            targets = []
            for sink_id, item in items:
                sink = self._sinks.get(sink_id)
                if sink is None:  # aborted meanwhile: its outputs are not wanted
                    continue
                if isinstance(item, Failure):
                    targets.append((sink, item.error()))
                    self._forget_sink(sink_id)
                    continue
                targets.append((sink, item))
                open_ids = self._open[sink_id]
                for output in item:
                    if output.finished:
                        open_ids.discard(output.request_id)
                        self._sink_of.pop(output.request_id, None)
                if not open_ids:
                    self._forget_sink(sink_id)
        deliver_together(targets)

    def _end(self) -> None:
        """The engine process is gone: every open sink and waiting call fails (ServerShuttingDown when it
        was told to stop, EngineFailure when it died)."""
        self._ended.set()
        self._outgoing.put(None)  # the sender closes the command pipe: a stopping engine process then exits
        with self._lock:
            stopping = self._stopping
            sinks, pending = list(self._sinks.values()), list(self._pending.values())
            self._sinks.clear()
            self._open.clear()
            self._sink_of.clear()
            self._pending.clear()
        if stopping:  # shutdown waits for the exit
            message = "the server is shutting down; the request was aborted"
        else:
            message = f"the engine process exited (code {self._exit_code(STOP_GRACE_S)})"
            logger.critical("%s; failing %d request(s) in flight", message, len(sinks))
        kind = ServerShuttingDown if stopping else EngineFailure
        for sink in sinks:
            sink.deliver_threadsafe(kind(message))
        for done in pending:
            if not done.done():
                done.set_exception(kind(message))
