"""The server's tokenizer pool: `PromptThreads`, a fixed set of daemon threads that build prompts.

Why not `concurrent.futures.ThreadPoolExecutor`: Python joins its threads at interpreter exit (an
atexit hook of `concurrent.futures`), whatever `shutdown(wait=False)` said. A prompt of megabytes
still being tokenised (seconds; the Rust tokenizer releases the GIL, so nothing interrupts it) then
held the process past `--shutdown-timeout` until it was done (issue 27: a Ctrl-C with
`--shutdown-timeout 1` exited after 13.3 s, a 64k-token request's tokenisation). Here
the threads are daemons: after `shutdown(wait=False)` the process exits at once, and the work still
running dies with it (its request was already cancelled by the server's graceful-shutdown timeout).

    pool = PromptThreads(4, "forkpoint-tokenizer")
    await loop.run_in_executor(pool, build_prompt)    # any Executor use
    pool.shutdown(wait=False, cancel_futures=True)    # queued work cancelled, running work not joined
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class PromptThreads(Executor):
    """`max_workers` daemon threads taking work in submission order, started at the first `submit`.

    Invariants: after `shutdown`, `submit` raises RuntimeError (as ThreadPoolExecutor's); a future is
    cancelled only while queued (`cancel_futures`), never once running; the threads are never joined
    unless `shutdown(wait=True)` asks."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against shutdown
        self._threads: list[threading.Thread] = []
        self._shut_down = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if not self._threads:
                self._threads = [threading.Thread(target=self._serve, name=f"{self._prefix}_{i}", daemon=True)
                                 for i in range(self._max_workers)]
                for thread in self._threads:
                    thread.start()
            future: Future = Future()
            self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; `cancel_futures`: cancel the queued work; `wait`: join the threads (after
        the work they still hold). Idempotent."""
        with self._lock:
            self._shut_down = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._work.put(None)  # one stop sign per thread, behind the queued work (a spare one is harmless)
        if wait:
            for thread in self._threads:
                thread.join()

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # as ThreadPoolExecutor: the caller's future carries it
                future.set_exception(exc)
                del exc  # no reference cycle through the traceback
            else:
                future.set_result(result)
