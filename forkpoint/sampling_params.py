"""Sampling parameters, following vLLM's `SamplingParams` names and defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one prompt. The constructor validates and raises ValueError naming the field.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables nucleus sampling;
    min_p 0.0 disables min-p. Penalties as in vLLM (they apply before greedy and random picks):
    presence_penalty / frequency_penalty in [-2, 2] subtract `p * (count > 0)` / `f * count` over the
    generated tokens; repetition_penalty > 0 divides positive (multiplies negative) logits of every
    token seen in the prompt or the output. `logprobs=k` returns the sampled token's and the top-k log-probabilities
    (of the unmodified distribution) for every generated token. `prompt_logprobs=k` returns, for
    every prompt token after the first, its log-probability and the top-k given the tokens before it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 0 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", list(stop) if stop else [])
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", list(ids) if ids else [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
