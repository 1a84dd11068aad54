"""Shutdown while a tokenizer thread is busy: `forkpoint serve` exits within `--shutdown-timeout` and
a little more, however long the prompt being tokenised would still take (issue 27, item 9).

The server runs as a child process because what is under test is the process's exit: Python joins
a thread pool's threads at interpreter exit, after the app has shut down.
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
# spaces are the text with the most characters per token (~128 for the Qwen3.5 vocabulary), so the
# longest legal prompt in characters: 32,000 tokens, ~5 s to length-check and ~5 s to tokenise
SLOW_PROMPT = " " * (32_000 * 128)


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


def test_serve_exits_within_the_timeout_while_a_prompt_is_tokenised(tmp_path):
    # SIGINT (Ctrl-C): before the fix the process exited 13.3 s after it, joining the busy thread at exit.
    # SIGTERM exits through uvicorn's re-raised signal before that join; one server start (~20-45 s on
    # 2 cores) is what this test costs, so only the signal that failed is sent.
    stop = signal.SIGINT
    args = ["--max-model-len", "32768", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--tokenizer-workers", "2",
            "--log-level", "warning", "--disable-log-stats"]
    with serve_process(args, tmp_path / "serve.log") as running:
        result: dict = {}
        # two prompts in one request: one tokenizer thread busy for ~20 s
        thread = _post_in_thread(f"{running.base_url}/v1/completions",
                                 {"prompt": [SLOW_PROMPT, SLOW_PROMPT], "max_tokens": 1}, result)
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
