"""Request-supplied chat templates, run where they can do no harm: in a child process with a time
limit, a memory cap, and jinja2's immutable sandbox with limits on loop ranges and output size
(`template_child.py`).

A template from a client is a program: `{% for i in range(100000) %}{% for j in range(100000) %}`
never ends, `'a' * 3000000000` allocates 3 GB. The server runs one only when its operator allows it
(`--trust-request-chat-template`, vLLM's flag), and then through `TemplateSandbox.render`: a breach
of any limit is a ValueError (a 400), and the caller waits at most `timeout_s` (the child is killed
and replaced past it), so one template cannot stall the requests behind it for longer.

    sandbox = TemplateSandbox(TemplateLimits(timeout_s=2.0))
    text = SandboxedTemplate(source, sandbox).render(tokenizer, conversation, add_generation_prompt=True)
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

CHILD = Path(__file__).with_name("template_child.py")


@dataclass(frozen=True)
class TemplateLimits:
    """timeout_s: wall time of one render (the caller waits no longer); max_output_chars: the rendered
    prompt's length, and of any value built with `*`; max_range: items of one `range(...)`;
    max_memory_bytes: the child's address space (RLIMIT_AS)."""

    timeout_s: float = 2.0
    max_output_chars: int = 16 << 20
    max_range: int = 10_000
    max_memory_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or min(self.max_output_chars, self.max_range, self.max_memory_bytes) < 1:
            raise ValueError(f"template limits must be positive, got {self}")


class TemplateSandbox:
    """One child process rendering templates, one render at a time (thread-safe). `close()` ends it."""

    def __init__(self, limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self.num_killed = 0  # children killed at the deadline or lost (memory), for tests and logs
        self._closed = False  # set by close(): no child is started after it

    def render(self, template: str, context: dict[str, Any]) -> str:
        """`template` rendered with `context` (JSON values). Raises ValueError naming the breach or the
        template's own error; returns or raises within about `timeout_s`."""
        try:
            request = json.dumps({"template": template, "context": context, "timeout_s": self.limits.timeout_s},
                                 ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as err:
            raise ValueError(f"the chat template's variables are not JSON values: {err}") from None
        with self._lock:
            deadline = time.monotonic() + self.limits.timeout_s + 0.5  # the child stops itself first
            child = self._started()
            try:
                child.stdin.write(struct.pack(">I", len(request)) + request)
                child.stdin.flush()
                (size,) = struct.unpack(">I", self._read(child, 4, deadline))
                reply = json.loads(self._read(child, size, deadline))
            except TimeoutError:
                self._kill()
                raise ValueError(f"the request's chat template ran past its {self.limits.timeout_s:g} s limit "
                                 "and was stopped") from None
            except (OSError, EOFError, ValueError):
                self._kill()
                if self._closed:
                    raise ValueError("the request's chat template was stopped: the server is shutting down") from None
                raise ValueError("the request's chat template was stopped: its process crashed or ran out of the "
                                 f"sandbox's memory ({self.limits.max_memory_bytes >> 20} MiB)") from None
        if "error" in reply:
            raise ValueError(f"the request's chat template failed in the sandbox: {reply['error']}")
        return reply["text"]

    @property
    def child_pid(self) -> int | None:
        """The running child's process id (None before the first render and after a kill)."""
        return None if self._child is None else self._child.pid

    def close(self) -> None:
        """Kill the child at once, even mid-render (that render raises ValueError now, not at its time
        limit: the server's shutdown waits for no template); later renders raise ValueError."""
        self._closed = True
        child = self._child
        if child is not None:
            child.kill()  # safe beside a render: it sees end of file and stops waiting
        with self._lock:
            if self._child is not None:
                self._child.kill()
                self._child.wait()
                self._child = None

    def _started(self) -> subprocess.Popen:
        if self._closed:
            raise ValueError("the request's chat template was not run: the server is shutting down")
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-I", str(CHILD), json.dumps(asdict(self.limits))],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._child

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None
            self.num_killed += 1

    @staticmethod
    def _read(child: subprocess.Popen, n: int, deadline: float) -> bytes:
        """n bytes of the child's answer; TimeoutError past `deadline`, EOFError if it died."""
        fd, data = child.stdout.fileno(), b""
        while len(data) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data


@dataclass(frozen=True)
class SandboxedTemplate:
    """A chat template a request supplied, bound to the sandbox that runs it. Passed where a template
    string goes (`render_chat(..., chat_template=...)`), it renders in the sandbox instead of
    `tokenizer.apply_chat_template`, with the same variables: messages, tools, documents,
    add_generation_prompt, the tokenizer's special tokens, and the extra keyword arguments."""

    source: str
    sandbox: TemplateSandbox

    def render(self, tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, Any]], *,
               add_generation_prompt: bool, **template_kwargs: Any) -> str:
        special = {name: value for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}
        context = {**special, "messages": conversation, "tools": template_kwargs.pop("tools", None),
                   "documents": template_kwargs.pop("documents", None),
                   "add_generation_prompt": add_generation_prompt, **template_kwargs}
        return self.sandbox.render(self.source, context)
