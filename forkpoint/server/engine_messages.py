"""What the server process and the engine process say to each other (`--engine-process`): picklable
value objects over one `multiprocessing` pipe, in order, each way.

    server process (ProcessWorker)                        engine process (engine_child.py)
    ------------------------------                        --------------------------------
                                    <- Ready(front, metrics) | StartFailed(error)   once the model is loaded
    Add(sink_id, requests)          ->                    EngineWorker.submit -> Acknowledged(call_id=sink_id)
    Abort(request_ids)              ->                    EngineWorker.abort
    Compile(call_id, spec)          ->                    grammar threads -> Acknowledged(call_id)
    Call(call_id, fn)               ->                    EngineWorker.call -> Acknowledged(call_id, value)
    Stop(timeout_s)                 ->                    EngineWorker.shutdown, then the process ends
                                    <- Delivered(items, metrics)   each step's outputs, or failures
                                    <- Metrics(values)             the engine's metrics when they changed

`call_id`s of Add are the sink ids; Compile and Call have ids of their own (one counter, so they never
collide). An error crosses as `Failure`: the exception's kind and message, raised again on the other
side as the same kind (an engine's ValueError stays a 400).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forkpoint.outputs import RequestOutput
from forkpoint.sampling_params import StructuredOutputsParams
from forkpoint.server.engine_front import EngineFront
from forkpoint.server.worker import EngineFailure, NewRequest, RequestOutOfMemory, ServerShuttingDown

# the exception kinds that cross as themselves; any other arrives as EngineFailure with its name in the message
KINDS: dict[str, type[Exception]] = {kind.__name__: kind for kind in (
    ValueError, ServerShuttingDown, EngineFailure, RequestOutOfMemory)}


@dataclass(frozen=True)
class Failure:
    """An exception on its way to the other process: `kind` (a name in `KINDS`, else any class name) and
    its message."""

    kind: str
    message: str

    @staticmethod
    def of(error: BaseException) -> Failure:
        return Failure(type(error).__name__, str(error))

    def error(self) -> Exception:
        """The exception to raise on this side: the same kind for the ones in `KINDS`, else EngineFailure."""
        kind = KINDS.get(self.kind)
        if kind is None:
            return EngineFailure(f"the engine process failed: {self.kind}: {self.message}")
        return kind(self.message)


# ---- server -> engine --------------------------------------------------------------------------

@dataclass(frozen=True)
class Add:
    sink_id: int
    requests: Sequence[NewRequest]


@dataclass(frozen=True)
class Abort:
    request_ids: Sequence[str]


@dataclass(frozen=True)
class Compile:
    call_id: int
    spec: StructuredOutputsParams


@dataclass(frozen=True)
class Call:
    """`fn(engine)` on the engine thread: `fn` must pickle (a module-level function, not a lambda)."""

    call_id: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Stop:
    timeout_s: float


# ---- engine -> server --------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    """The engine is loaded: what the front needs, and its metrics before any request."""

    front: EngineFront
    metrics: dict[str, float]


@dataclass(frozen=True)
class StartFailed:
    failure: Failure


@dataclass(frozen=True)
class Acknowledged:
    """The command `call_id` is done: `failure` None and its `value`, or what it raised."""

    call_id: int
    value: Any = None
    failure: Failure | None = None


@dataclass(frozen=True)
class Delivered:
    """One step's deliveries: (sink id, the outputs or the failure that ends the sink), and the engine's
    metrics as of that step."""

    items: Sequence[tuple[int, list[RequestOutput] | Failure]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class Metrics:
    values: dict[str, float]
