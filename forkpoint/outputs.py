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


@dataclass
class RequestOutput:
    """Output of one prompt. prompt_token_ids never contain the checkpoint marker;
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
