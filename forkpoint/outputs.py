"""Result objects returned by `LLM.generate` and `LLMEngine.step` (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A log-probability that is a plain float and also reads like vLLM's `Logprob`
    (`.logprob`, `.rank`: 1 for the most likely token), so code written for either works."""

    rank: int | None

    def __new__(cls, value: float, rank: int | None = None) -> Logprob:
        obj = super().__new__(cls, value)
        obj.rank = rank
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob({float(self)!r}, rank={self.rank})"


@dataclass
class CompletionOutput:
    """One sampled sequence. logprobs: per generated token, {token_id: Logprob} (sampled + top-k)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """When a prompt moved through the engine (vLLM's `RequestOutput.metrics`), for latency breakdowns.

    Times are `time.monotonic()` seconds of the engine's process. arrival_time: the engine took the
    prompt (`add_request`); first_scheduled_time: its first sequence was first admitted into a step
    (None: still queued); first_token_time: its first generated token was sampled (None: none yet);
    queued_steps: steps the engine scheduled between arrival and that first admission (what it waited
    behind: other requests' decodes and prefill chunks, a producer's checkpoint, memory); prefill_steps:
    steps from that first admission to the first sampled token of the same sequence, both counted (1: it
    sampled in the step that admitted it; None: it has sampled nothing yet)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    queued_steps: int = 0
    prefill_steps: int | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first admission (None while queued)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """Output of one prompt. prompt_token_ids never contain the checkpoint marker (every output of one
    prompt holds the same list, as vLLM's do: read it, do not change it);
    num_cached_tokens counts prompt tokens reused from a checkpoint (max over the n samples);
    cache_miss_reason (an extension of vLLM's fields) says why reuse stopped short of the tokens the
    prompt shares with prompts computed before (a `CacheMissReason` value: "no_checkpoint",
    "template_divergence", "evicted_device", ...), None when it reused all it could or shares nothing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    checkpoint_positions: list[int] = field(default_factory=list)
    finished: bool = False
    # None unless SamplingParams.prompt_logprobs was set; then one entry per prompt token: None for the
    # first, else {token_id: Logprob} holding the actual token and the top k given the tokens before it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cache_miss_reason: str | None = None
    metrics: RequestMetrics | None = None  # when the prompt was queued, scheduled, first sampled
