"""Life of one HTTP generation request on the event loop: admission, submission of its prompts to
the engine thread, the stream of outputs, and the cleanup that aborts whatever is unfinished.

Everything here runs on the server's event loop, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from forkpoint.outputs import RequestOutput
from forkpoint.sampling_params import SamplingParams
from forkpoint.server.errors import APIError, invalid_request, overloaded
from forkpoint.server.grammar_threads import GrammarThreads
from forkpoint.server.metrics import ServerMetrics
from forkpoint.server.prompts import EnginePrompt
from forkpoint.server.request_params import rejected_param
from forkpoint.server.worker import EngineWorker, NewRequest, OutputSink, ServerShuttingDown

logger = logging.getLogger("forkpoint.server")


class Admission:
    """Bounds the sequences that wait for their first token (queued, deferred or prefilling): a
    prompt with `n` completions is n sequences (it takes n places, as n prompts would).

    waiting / running: admitted sequences without a first token / generating tokens.
    max_per_request: most sequences (prompts x n) one request may ask for (a 400 beyond it).
    max_waiting_per_client: most waiting places one client (the request's `user`; requests without
        one share one client) may hold, so one client cannot fill the queue for everyone (None: no
        per-client bound). Every counter is changed on the event loop only.
    """

    def __init__(self, max_waiting: int, retry_after_s: int, *, max_per_request: int | None = None,
                 max_waiting_per_client: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        # a request over any of the three bounds could never be admitted: a 400, not a 503
        self.max_per_request = min(bound for bound in (max_waiting, max_per_request, max_waiting_per_client)
                                   if bound is not None)
        self.max_waiting_per_client = max_waiting_per_client
        self.waiting = 0
        self.running = 0
        self.waiting_by_client: dict[str, int] = {}  # clients with waiting places only

    def admit(self, prompts: int, n: int = 1, client: str = "") -> None:
        """Take `prompts` x `n` waiting places for `client`, or raise a 503 `APIError` when they do
        not fit now (a 400 when they never can)."""
        count = prompts * n
        if count > self.max_per_request:
            raise invalid_request(
                f"the request asks for {prompts} prompt(s) x n={n} = {count} sequences but at most "
                f"{self.max_per_request} are taken per request (--max-num-seqs-per-request, "
                "--max-waiting-requests, --max-waiting-per-user): lower n or send fewer prompts per request",
                param="n" if n > 1 else "prompt")
        held = self.waiting_by_client.get(client, 0)
        cap = self.max_waiting_per_client
        if cap is not None and held + count > cap:
            raise overloaded(
                self.retry_after_s,
                f"this client (user {client!r}) has {held} sequences waiting for their first token, limit {cap} "
                f"per client (--max-waiting-per-user): retry after {self.retry_after_s} s",
            )
        if self.waiting + count > self.max_waiting:
            raise overloaded(
                self.retry_after_s,
                f"the server is at capacity ({self.waiting} sequences waiting for their first token, "
                f"limit {self.max_waiting}): retry after {self.retry_after_s} s",
            )
        self.waiting += count
        self.waiting_by_client[client] = held + count

    def first_token(self, n: int = 1, client: str = "") -> None:
        """One admitted prompt (its `n` sequences) produced its first token."""
        self._unwait(n, client)
        self.running += n

    def release(self, state: str, n: int = 1, client: str = "") -> None:
        """An unfinished prompt (`n` sequences) in `state` ("waiting" or "running") ended; other
        states hold nothing."""
        if state == "waiting":
            self._unwait(n, client)
        elif state == "running":
            self.running -= n

    def _unwait(self, n: int, client: str) -> None:
        self.waiting -= n
        left = self.waiting_by_client[client] - n
        if left:
            self.waiting_by_client[client] = left
        else:
            del self.waiting_by_client[client]


class Generation:
    """The engine requests of one HTTP request (one per prompt), as one stream of outputs.

    ``await gen.start()``, then ``async for index, output in gen.outputs()``, and ``gen.close()``
    however the request ends: it aborts the prompts that have not finished and releases their
    admission places, so a client that goes away frees its engine resources.
    endpoint: label of the request in the outcome metric; prompt_param: the request field
    named in a 400 when the engine rejects a prompt. received: when the HTTP request reached its
    handler (`time.monotonic()`; default: now); arrived: when it reached the application
    (`server/arrival.py`; default: received), the start of its time to first token. grammars: where
    a structured-output constraint is compiled before the prompts go to the engine thread (None: behind
    the replicas' ingress, each replica compiles it, server/replicas/deployment.py); constraint_param:
    the request field that carried the constraint, named by the 400 when it does not compile (None: the
    prompt field). stream: the response streams, so every step's output is wanted (as a delta: only what
    is new, the finished output whole); otherwise the engine reports each prompt only at its first token
    and when it finishes.
    """

    def __init__(self, worker: EngineWorker, admission: Admission, metrics: ServerMetrics, *,
                 endpoint: str, prompt_param: str, request_id: str, prompts: Sequence[EnginePrompt],
                 params: SamplingParams, cache_key: str | None = None, client: str = "",
                 received: float | None = None, arrived: float | None = None,
                 grammars: GrammarThreads | None = None, constraint_param: str | None = None,
                 stream: bool = True) -> None:
        self._cache_key = cache_key  # prompt_cache_key: replicas route the group together
        self._client = client  # the request's `user` ("" without one): its admission places are its client's
        self._endpoint = endpoint
        self._prompt_param = prompt_param
        self._worker = worker
        self._grammars = grammars
        self._constraint_param = constraint_param
        self._admission = admission
        self._metrics = metrics
        self._ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._prompts = prompts
        self._params = params
        self._stream = stream
        self._received = time.monotonic() if received is None else received  # the handler's start
        self._arrival = self._received if arrived is None else min(arrived, self._received)
        self._submitted = self._received  # when the prompts were handed to the engine thread
        self._added = self._received  # when the engine had taken them (add_many returned)
        self._state = dict.fromkeys(self._ids, "new")  # new -> waiting -> running -> done
        self._sink: OutputSink | None = None
        self._outcome: str | None = None
        self._started = False  # True once the prompts may be in the engine
        self._closed = False

    @property
    def params(self) -> SamplingParams:
        return self._params


    async def start(self) -> None:
        """Admit, compile the request's constraint (off the engine thread, in `grammars`) and submit
        every prompt. Raises `APIError`: 503 when the server is at capacity or shutting down, 400 when
        the constraint does not compile or the engine rejects a prompt (nothing is left running then,
        and `close()` has nothing to do: the error handler counts the outcome). Cancelled before the
        prompts were handed over, it gives their places back and leaves nothing."""
        self._admission.admit(len(self._ids), self._params.n, self._client)
        for rid in self._ids:
            self._state[rid] = "waiting"
        self._sink = OutputSink(asyncio.get_running_loop())
        requests = [NewRequest(rid, p.engine_input(), self._params, self._cache_key, p.turn_positions,
                               p.turn_end_reusable, tenant=self._client, stream=self._stream)
                    for rid, p in zip(self._ids, self._prompts)]
        handed_over = False
        try:
            if self._grammars is not None and self._params.structured_outputs is not None:
                await self._grammars.compile(self._params.structured_outputs)
            self._submitted = time.monotonic()
            handed_over = True
            await self._worker.add_many(requests, self._sink)
            self._added = time.monotonic()
            self._started = True
        except ValueError as err:
            self._release_all()
            # before the hand-over only the constraint's compile raises: name the field that carried it
            param = (self._constraint_param if not handed_over and self._constraint_param is not None
                     else rejected_param(err, self._prompt_param))
            raise invalid_request(str(err), param=param) from None
        except ServerShuttingDown as err:
            self._release_all()
            raise APIError(str(err), status=503, type="service_unavailable_error", code="shutting_down") from None
        except BaseException:
            if handed_over:  # cancelled while adding: the add may still land, so abort it
                self._started = True
                self.close()
            else:  # cancelled while its grammar compiled: nothing reached the engine thread
                self._release_all()
            raise

    def close(self) -> None:
        """Abort the prompts that have not finished, release their places and count the request's
        outcome (aborted if anything was unfinished). Idempotent; call it however the request ends."""
        if self._closed or not self._started:
            return
        self._closed = True
        unfinished = [rid for rid, state in self._state.items() if state in ("waiting", "running")]
        self._release_all()
        self._worker.abort(unfinished)
        if self._outcome is None:
            self._outcome = "aborted" if unfinished else "success"
        self._metrics.count(self._endpoint, self._outcome)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, output) until every prompt has finished: with `stream` every step's, only
        what is new except the finished one (`deltas`); else the cumulative outputs of its first token and
        its finished one.

        Raises `EngineFailure` or `ServerShuttingDown` when the engine thread ends the request.
        """
        assert self._sink is not None, "call start() first"
        while any(self._state[rid] != "done" for rid in self._ids):
            item = await self._sink.queue.get()
            if isinstance(item, BaseException):
                self._outcome = "aborted" if isinstance(item, ServerShuttingDown) else "error"
                self._release_all()
                raise item
            for output in item:
                self._observe(output)
                yield self._index[output.request_id], output

    def _observe(self, output: RequestOutput) -> None:
        rid = output.request_id
        now = time.monotonic()
        if self._state[rid] == "waiting" and (output.finished or any(o.token_ids for o in output.outputs)):
            self._admission.first_token(self._params.n, self._client)
            self._state[rid] = "running"
            self._metrics.ttft.observe(now - self._arrival)
            self._first_token_breakdown(output, now)
        if output.finished and self._state[rid] == "running":
            self._admission.release("running", self._params.n, self._client)
            self._state[rid] = "done"
            self._metrics.e2e.observe(now - self._arrival)

    def _first_token_breakdown(self, output: RequestOutput, now: float) -> None:
        """Where the time to `output`'s first token went, into the latency histograms and a debug log
        line: request (the HTTP body read, parsed and validated before the handler), prompt (rendered,
        tokenised, admitted, its grammar compiled), hand-off (queued for the engine thread, which
        takes new prompts between steps), queue (until a step first schedules it, behind how many
        steps), prefill (to its first sampled token, in how many steps: 1 when the step that first
        schedules it samples it), delivery (the engine's output work and the hop to the event loop).
        Only for an engine on this clock: its arrival time lies between the hand-off and its
        acknowledgement (replicas' engines in other processes may have other clocks)."""
        times = output.metrics
        if (times is None or times.first_scheduled_time is None or times.first_token_time is None
                or not self._submitted <= times.arrival_time <= self._added):
            return
        request, prompt = self._received - self._arrival, self._submitted - self._received
        handoff = times.arrival_time - self._submitted
        queue = times.first_scheduled_time - times.arrival_time
        prefill = times.first_token_time - times.first_scheduled_time
        delivery = now - times.first_token_time
        self._metrics.observe_first_token(request=request, prompt=prompt, handoff=handoff, queue=queue,
                                          prefill=prefill, delivery=delivery)
        if logger.isEnabledFor(logging.DEBUG):
            steps = "" if times.prefill_steps is None else f" ({times.prefill_steps} steps)"
            logger.debug("request %s: first token after %.1f ms: request %.1f, prompt %.1f, hand-off %.1f, "
                         "queue %.1f (%d steps), prefill %.1f%s, delivery %.1f ms; %d of %d prompt tokens cached",
                         output.request_id,
                         1000 * (now - self._arrival), 1000 * request, 1000 * prompt, 1000 * handoff, 1000 * queue,
                         times.queued_steps, 1000 * prefill, steps, 1000 * delivery, output.num_cached_tokens,
                         len(output.prompt_token_ids))

    def _release_all(self) -> None:
        """Give back the admission places of every unfinished prompt and mark it done."""
        for rid, state in self._state.items():
            self._admission.release(state, self._params.n, self._client)
            self._state[rid] = "done"

