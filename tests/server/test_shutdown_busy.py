"""Shutdown while a tokenizer thread is busy: `forkpoint serve` exits within `--shutdown-timeout` and
a little more, however long the prompt being tokenised would still take (issue 27, item 9).

The server runs as a child process because what is under test is the process's exit: Python joins
a thread pool's threads at interpreter exit, after the app has shut down. It serves the tiny
word-level model (tests/tiny_models.py): what is under test is the server's tokenizer threads, not
the model, and it starts in a fraction of the embedded model's time.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.server.conftest import serve_process

SHUTDOWN_TIMEOUT_S = 1.0
# past the timeout: uvicorn's and the lifespan's own steps, and interpreter exit, on a loaded CPU
EXIT_MARGIN_S = 4.0
# the tiny model's word-level tokenizer reads one run of emoji as one (unknown) word: a prompt of one
# token however long, and the slowest text per byte of JSON for it (~5 MB/s on one core). 2M emoji
# (8 MB) take ~2 s to length-check and tokenise; SLOW_PROMPTS of them, in one request, keep one
# tokenizer thread busy ~12 s (2 cores), well past the signal at 2 s plus the allowed exit time (with
# the threads made non-daemon again, the bug, the process outlives the wait and the test fails)
SLOW_PROMPT = "\N{GRINNING FACE}" * 2_000_000
SLOW_PROMPTS = 6


def _post_in_thread(url: str, body: dict, result: dict) -> threading.Thread:
    """POST `body` to `url`; record the status code or the transport error, and when it ended."""

    def run() -> None:
        try:
            result["status"] = httpx.post(url, json=body, timeout=120).status_code
        except httpx.TransportError as err:
            result["error"] = err
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_serve_exits_within_the_timeout_while_a_prompt_is_tokenised(tmp_path, tiny_model_factory):
    # SIGINT (Ctrl-C): before the fix the process exited 13.3 s after it, joining the busy thread at exit.
    # SIGTERM exits through uvicorn's re-raised signal before that join; one server start is what this
    # test costs, so only the signal that failed is sent.
    stop = signal.SIGINT
    directory, _ = tiny_model_factory("qwen3_5_text")
    # the default body limit admits max_model_len of the tiny vocabulary's longest tokens: ~1.3 MB
    args = [str(directory), "--max-model-len", "4096", "--max-request-bytes", str(1 << 30),
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--tokenizer-workers", "2",
            "--log-level", "warning", "--disable-log-stats"]
    with serve_process(args, tmp_path / "serve.log") as running:
        result: dict = {}
        # the prompts of one request: one tokenizer thread busy for ~12 s
        thread = _post_in_thread(f"{running.base_url}/v1/completions",
                                 {"prompt": [SLOW_PROMPT] * SLOW_PROMPTS, "max_tokens": 1}, result)
        time.sleep(2.0)  # the body is sent and parsed: the prompts are being tokenised
        assert thread.is_alive(), result
        stopped = time.monotonic()
        running.process.send_signal(stop)
        try:
            running.process.wait(timeout=SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
        finally:
            print(f"exited {time.monotonic() - stopped:.1f} s after {stop.name}")
        thread.join(EXIT_MARGIN_S)
        assert not thread.is_alive(), "the busy request is still waiting for an answer"
        assert result["ended"] - stopped < SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S
        # answered (shutting down) or its connection closed: never a success, never left hanging
        assert result.get("status", 503) >= 500, result
