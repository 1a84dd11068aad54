"""Sampling parameters, following vLLM's `SamplingParams` names and defaults, and
`StructuredOutputsParams` (vLLM's structured-output request: one of json, regex, choice, grammar)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# alternatives a `choice` constraint may list: each is one of a grammar compiled on the engine thread when
# the request is added (llguidance on the CPU: 20,000 took 0.5 s, 100,000 32 s before it failed)
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the generated text to a JSON schema, a regular expression, one of a list of
    strings, or a Lark grammar (llguidance's syntax; GBNF is converted). Exactly one is set.

    json: a JSON schema as a dict or its JSON text (`{"type": "object"}` for any object);
    regex: a regular expression the whole output must match; choice: a non-empty list of strings;
    grammar: a Lark (or GBNF) grammar text. Grammars are compiled when the request is added
    (forkpoint/structured/), so an invalid one is a ValueError there.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, grammar; got "
                             + (", ".join(given) if given else "none"))
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as err:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty grammar text, got {self.grammar!r}")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {choice!r}")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(choice)} strings; at most {MAX_CHOICES} are "
                                 "taken (a json_schema or a grammar can constrain more)")
            object.__setattr__(self, "choice", list(choice))

    @property
    def kind(self) -> str:
        """The one field that is set: "json", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def cache_key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (the compiled-grammar cache key)."""
        value = getattr(self, self.kind)
        if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, value


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

    Logits processors (forkpoint/runner/logits_processors.py, vLLM's semantics), applied before the
    penalties and the pick: `logit_bias` {token id: bias} added to the logits; `allowed_token_ids`
    restricts the pick to those ids; `bad_words` are never generated (a multi-token word is blocked
    at its last token when the output ends with the rest); `min_tokens` masks EOS and
    `stop_token_ids` (and ignores stop strings) until that many tokens are out; `structured_outputs`
    constrains the text to a schema, regex, choice or grammar (forkpoint/structured/). Token ids
    are checked against the vocabulary when the request is added.

    The text, as vLLM makes it (engine/output_processor.py): `skip_special_tokens` leaves special
    tokens out of it; `spaces_between_special_tokens` False (with special tokens kept) joins two
    added tokens in a row without what the decoder puts between them; `include_stop_str_in_output`
    keeps a matched stop string (the text is cut right after it, not right before it) and the text of
    the EOS or `stop_token_ids` token that ended the sequence, which is otherwise left out.
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
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._validate_processors()
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

    def _validate_processors(self) -> None:
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not ids
                                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative ints, got {ids!r}")
        if ids is not None:
            object.__setattr__(self, "allowed_token_ids", list(ids))
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, (int, float))
                    and not isinstance(v, bool) and math.isfinite(v) for k, v in bias.items()):
                raise ValueError(f"logit_bias must map non-negative token ids to finite floats, got {bias!r}")
            object.__setattr__(self, "logit_bias", {k: float(v) for k, v in bias.items()} or None)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple))
                                  or not all(isinstance(w, str) and w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        if words is not None:
            object.__setattr__(self, "bad_words", list(words) or None)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a forkpoint.StructuredOutputsParams, got "
                             f"{type(so).__name__}: use StructuredOutputsParams(json=, regex=, choice= or grammar=)")

    @property
    def has_logits_processors(self) -> bool:
        """Whether the request needs `apply_logits_processors` (any of the fields above)."""
        return bool(self.allowed_token_ids or self.logit_bias or self.min_tokens or self.bad_words
                    or self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
