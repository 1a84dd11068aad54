"""The tokenizer pool's threads: work runs and reports as in any Executor, queued work is cancelled
on shutdown, and running work is never joined at shutdown or at interpreter exit (daemon threads)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from forkpoint.server.prompt_threads import PromptThreads


def test_runs_work_and_carries_its_exception():
    pool = PromptThreads(2, "test-prompt")
    assert pool.submit(lambda a, *, b: a + b, 2, b=3).result(5) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    assert {t.daemon for t in threading.enumerate() if t.name.startswith("test-prompt")} == {True}
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)


def test_shutdown_cancels_queued_work_and_does_not_wait_for_running_work():
    pool = PromptThreads(1, "test-prompt")
    release = threading.Event()
    running = pool.submit(release.wait, 30)
    queued = pool.submit(lambda: "never")
    time.sleep(0.1)
    start = time.monotonic()
    pool.shutdown(wait=False, cancel_futures=True)
    assert time.monotonic() - start < 0.5
    assert queued.cancelled() and not running.done()
    release.set()
    assert running.result(5) is True


def test_the_process_exits_while_a_thread_is_still_busy():
    """A ThreadPoolExecutor here holds the interpreter's exit until the work ends (30 s)."""
    script = ("import time; from forkpoint.server.prompt_threads import PromptThreads\n"
              "pool = PromptThreads(1, 'busy'); pool.submit(time.sleep, 30); time.sleep(0.1)\n"
              "pool.shutdown(wait=False, cancel_futures=True)\n")
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=20)
    assert time.monotonic() - start < 10
