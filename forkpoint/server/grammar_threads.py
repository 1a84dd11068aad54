"""Structured-output grammars compiled off the engine thread: `GrammarThreads`.

A constraint the compiler has not seen is compiled (llguidance) when its request is added, and the
server adds requests on the one engine thread: a 4,096-string `choice` held every stream ~70 ms, a big
JSON schema can hold them for seconds. So a request with a constraint first waits, on the event loop,
for its grammar to be compiled in one of these threads; the engine thread's `add_request` then finds it
in the compiler's cache and only copies it. llguidance releases the GIL while it compiles, so the
engine thread and the event loop run meanwhile. (vLLM compiles in a thread pool too.)

    await grammars.compile(params.structured_outputs)   # ValueError: the constraint does not compile
    grammars.shutdown()                                 # at the app's end; running compiles not joined

The threads are `PromptThreads` (daemons), not a `ThreadPoolExecutor`, whose threads Python joins at
exit: a compile of seconds would hold the process past `--shutdown-timeout`.
"""

from __future__ import annotations

import asyncio

from forkpoint.sampling_params import StructuredOutputsParams
from forkpoint.server.prompt_threads import PromptThreads
from forkpoint.server.worker import ServerShuttingDown
from forkpoint.structured import GrammarCompiler

GRAMMAR_THREADS = 2  # compiles at once; more wait in the queue, each on its own request only


class GrammarThreads:
    """Compiles constraints into `grammars` (the engine's compiler) in `max_workers` threads.

    Invariant: a compile whose waiter was cancelled still runs to its end if it had started (it only
    fills the compiler's cache) and is dropped if it was still queued; nothing else is left behind."""

    def __init__(self, grammars: GrammarCompiler, max_workers: int = GRAMMAR_THREADS) -> None:
        self._grammars = grammars
        self._threads = PromptThreads(max_workers, "forkpoint-grammar")

    async def compile(self, spec: StructuredOutputsParams) -> None:
        """Return once `spec` is compiled and cached. Raises the compiler's ValueError naming the problem,
        or `ServerShuttingDown` after `shutdown()`."""
        try:
            done = self._threads.submit(self._grammars.ensure_compiled, spec)
        except RuntimeError:  # shut down: the engine thread is stopping too
            raise ServerShuttingDown("the server is shutting down") from None
        await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Take no more work; queued compiles are cancelled, running ones are not waited for."""
        self._threads.shutdown(wait=False, cancel_futures=True)
