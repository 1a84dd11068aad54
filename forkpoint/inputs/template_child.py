"""The child process of `template_sandbox.TemplateSandbox`: renders request-supplied chat templates.

Run as a script (``python -I template_child.py LIMITS_JSON``), never imported: it needs only the
standard library and jinja2, so it starts fast and holds nothing of the server. It caps its own
address space (RLIMIT_AS), then answers requests on stdin / stdout, each a 4-byte big-endian length
and a JSON object: in ``{"template", "context", "timeout_s"}``, out ``{"text"}`` or ``{"error"}``.

The Jinja environment is jinja2's ImmutableSandboxedEnvironment (no attribute access to internals,
no mutation of lists and dicts) set up as transformers sets up chat templates (trim_blocks,
lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`), plus limits: `range`
yields at most `max_range` items, `*` and `**` may not build values over the output limit, and the
render stops at `max_output_chars` or its deadline. The parent kills the process for anything else
(a single operation that runs past the deadline, or memory past the cap).
"""

import json
import resource
import struct
import sys
import time
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with size limits on `*` and `**` (jinja2 intercepts the operators listed)."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.max_chars = max_chars

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 4096:
            raise SecurityError(f"exponent {right} is over the sandbox's limit of 4096")
        if operator == "*":
            sized, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(count, int) and hasattr(sized, "__len__") and len(sized) * count > self.max_chars:
                raise SecurityError(f"a value of {len(sized) * count} items is over the sandbox's limit of "
                                    f"{self.max_chars}")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(template: str, context: dict, limits: dict, deadline: float) -> str:
    """The template rendered with `context`; raises TemplateError / SecurityError / TimeoutError."""
    max_chars, max_range = limits["max_output_chars"], limits["max_range"]

    def limited_range(*args):
        values = range(*args)
        if len(values) > max_range:
            raise SecurityError(f"range of {len(values)} items is over the sandbox's limit of {max_range}")
        for value in values:
            if time.monotonic() > deadline:
                raise TimeoutError
            yield value

    env = LimitedEnvironment(max_chars)
    env.filters["tojson"] = _tojson
    env.globals.update(range=limited_range, raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    pieces, size = [], 0
    for piece in env.from_string(template).generate(**context):
        size += len(piece)
        if size > max_chars:
            raise SecurityError(f"the rendered prompt is over the sandbox's limit of {max_chars} characters")
        if time.monotonic() > deadline:
            raise TimeoutError
        pieces.append(piece)
    return "".join(pieces)


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def main() -> None:
    limits = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limits["max_memory_bytes"], limits["max_memory_bytes"]))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            (size,) = struct.unpack(">I", _read(stdin, 4))
            request = json.loads(_read(stdin, size))
        except EOFError:
            return
        deadline = time.monotonic() + request["timeout_s"]
        try:
            reply = {"text": render(request["template"], request["context"], limits, deadline)}
        except TimeoutError:
            reply = {"error": f"the template ran past its {request['timeout_s']:g} s limit"}
        except MemoryError:
            reply = {"error": "the template ran out of the sandbox's memory"}
        except RecursionError:
            reply = {"error": "the template recursed too deeply"}
        except Exception as err:  # the limits (SecurityError), raise_exception, wrong types, missing keys, ...
            reply = {"error": f"{type(err).__name__}: {err}"}
        data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        stdout.write(struct.pack(">I", len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
