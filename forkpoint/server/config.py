"""Configuration of the HTTP server: a frozen value built once by the CLI (or a test) and passed to
`build_app`. Engine knobs are not here: they belong to `LLM` / `EngineConfig`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from forkpoint.inputs.segment_tokens import DEFAULT_CACHE_BYTES
from forkpoint.server.tool_parsers import ALL_FORMATS

DEFAULT_MODEL_NAME = "forkpoint-default"
# the fewest JSON objects --max-request-objects defaults to (server/json_body.py says why a limit)
MIN_DEFAULT_REQUEST_OBJECTS = 8192
# context tokens per JSON object in the default past that: a long agent conversation's messages and
# content blocks carry tens of tokens each, so it fits long before it has this many objects
TOKENS_PER_DEFAULT_OBJECT = 16
# the fewest JSON values --max-request-values defaults to (~0.03 s of decoding and validation)
MIN_DEFAULT_REQUEST_VALUES = 1 << 18


def default_max_request_objects(max_model_len: int) -> int:
    """--max-request-objects when not given: 8,192, or one per 16 tokens of `max_model_len` if more
    (16,384 at 262,144 tokens)."""
    return max(MIN_DEFAULT_REQUEST_OBJECTS, max_model_len // TOKENS_PER_DEFAULT_OBJECT)


def default_max_request_values(max_model_len: int) -> int:
    """--max-request-values when not given: 2^18, or two token-id prompts of `max_model_len` tokens if
    more."""
    return max(MIN_DEFAULT_REQUEST_VALUES, 2 * max_model_len)


class MarkerPolicy(enum.StrEnum):
    """What the server does with the checkpoint marker string when it arrives inside client text
    (message content or a completion prompt, as text or as the marker's token id).

    allow: it works as a checkpoint marker, exactly as in the offline API.
    strip: it is removed from the client's text; structured controls (a content part's
        ``"checkpoint": true``, ``checkpoint_positions``) still place checkpoints.
    reject: the request is answered 400.
    """

    ALLOW = "allow"
    STRIP = "strip"
    REJECT = "reject"


@dataclass(frozen=True)
class CorsPolicy:
    """Cross-origin requests (vLLM's --allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials, with vLLM's defaults): which browser origins may call the API, with which
    methods and headers. No origins: no CORS headers at all (browsers then refuse cross-origin calls)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            values = tuple(getattr(self, name))
            if not all(isinstance(value, str) and value for value in values):
                raise ValueError(f"CORS {name} must be non-empty strings, got {list(values)}")
            object.__setattr__(self, name, values)


def default_tokenizer_workers() -> int:
    """Prompt-building threads for this machine: its CPU count, at least 2 (one huge prompt never
    holds up every other request) and at most 8."""
    return min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class ServerConfig:
    """Knobs of the OpenAI-compatible server.

    served_model_name: the model id that /v1/models lists and requests must name.
    served_model_aliases: other ids requests may name (vLLM's --served-model-name with several names, e.g.
        the model names an agent client sends); /v1/models lists them after it, responses carry
        served_model_name.
    max_waiting_requests: engine requests admitted but without a first token yet (queued,
        deferred behind a checkpoint, or prefilling) above which new requests get 503.
    retry_after_s: the Retry-After header of a 503.
    marker_policy: see `MarkerPolicy`.
    shutdown_timeout_s: on shutdown, in-flight requests get this long to finish before they
        are aborted.
    max_request_bytes: request bodies above this get 413 before they are read (vLLM's
        --max-request-bytes); None: enough for any one prompt that fits max_model_len
        (`limits.default_max_request_bytes`).
    max_request_objects: JSON objects a request body may hold (messages, content parts, tools and
        every object of their schemas count one each); a body with more is a 400 found while it is
        decoded, before FastAPI builds a model per object on the event loop (server/json_body.py).
        None: `default_max_request_objects(max_model_len)`.
    max_request_values: JSON values (array elements and members' values: token ids, strings,
        numbers, objects) a request body may hold; more is a 400 found from its bytes or while it is
        decoded. None: `default_max_request_values(max_model_len)`, room for a few token-id prompts of
        max_model_len tokens.
    log_stats / log_stats_interval_s: log a stats line (throughput, queues, pools, checkpoint
        reuse) every interval while the engine is busy.
    trust_request_chat_template: run a chat template that a request supplies
        (`chat_template_kwargs.chat_template`; vLLM's --trust-request-chat-template), in a sandboxed
        child process with limits (`inputs/template_sandbox.py`); False (default): such a request is a 400.
    max_num_seqs_per_request: most sequences (prompts x n) one request may ask for; more is a 400.
    max_waiting_per_user: most sequences one client (the request's `user` field; requests without
        one count as one client) may have waiting for a first token; beyond it that client gets 503
        while others are still admitted (None: no per-client bound).
    tokenizer_workers: threads that build prompts (render, tokenise, decode images), so one huge
        prompt occupies one of them and the others go on (default: the CPU count, 2 to 8).
    token_cache_bytes: bytes of chat prompt pieces (turns) whose token ids the prompt builder keeps
        (`inputs/segment_tokens.py`: a session's next turn tokenises only its new text, same ids); 0: every
        chat prompt is tokenised whole.
    cache_isolation: "none" (requests share reuse unless they send different `cache_salt`s), "user"
        (a request without `cache_salt` is salted by its `user` field: tenants share no checkpoint) or
        "api-key" (salted by the API key it presented; needs `api_keys`).
    responses_store_bytes: bytes of finished /v1/responses responses kept for `previous_response_id` and
        GET /v1/responses/{id} (`response_store.py`; least recently used dropped first); 0: none are kept.
    cors: the cross-origin policy (`CorsPolicy`; vLLM's default: any origin, method and header).
    chat_template: vLLM's --chat-template: the Jinja template chat prompts render with instead of the
        tokenizer's (None: the tokenizer's; a request's own, where trusted, still wins).
    tool_formats: the formats tool calls are read in under tool_choice "auto" (server/tool_parsers/ names;
        default: all of them; --tool-call-parser names one, as vLLM reads only its parser's).
    api_keys: vLLM's --api-key: with keys, every route but /health and /metrics needs
        `Authorization: Bearer <one of them>` (401 otherwise), and a request's client (its admission
        places, its checkpoint share) is the key it presented, not its `user` field (server/auth.py).
    """

    served_model_name: str = DEFAULT_MODEL_NAME
    max_waiting_requests: int = 1024
    retry_after_s: int = 1
    marker_policy: MarkerPolicy = MarkerPolicy.ALLOW
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int | None = None
    max_request_objects: int | None = None
    max_request_values: int | None = None
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    trust_request_chat_template: bool = False
    cache_isolation: str = "none"
    max_num_seqs_per_request: int = 256
    max_waiting_per_user: int | None = None
    tokenizer_workers: int = field(default_factory=default_tokenizer_workers)
    api_keys: tuple[str, ...] = ()
    token_cache_bytes: int = DEFAULT_CACHE_BYTES
    responses_store_bytes: int = 64 * 2**20
    chat_template: str | None = None
    tool_formats: tuple[str, ...] = ALL_FORMATS
    served_model_aliases: tuple[str, ...] = ()
    cors: CorsPolicy = field(default_factory=CorsPolicy)

    def __post_init__(self) -> None:
        if not self.served_model_name or not all(self.served_model_aliases):
            raise ValueError("served_model_name and served_model_aliases must be non-empty strings")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_request_objects is not None and self.max_request_objects < 1:
            raise ValueError(f"max_request_objects must be >= 1, got {self.max_request_objects}")
        if self.max_request_values is not None and self.max_request_values < 1:
            raise ValueError(f"max_request_values must be >= 1, got {self.max_request_values}")
        if self.log_stats_interval_s <= 0:
            raise ValueError(f"log_stats_interval_s must be > 0, got {self.log_stats_interval_s}")
        object.__setattr__(self, "marker_policy", MarkerPolicy(self.marker_policy))
        for name in ("max_num_seqs_per_request", "max_waiting_per_user", "tokenizer_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0 (0: no store), got {self.responses_store_bytes}")
        if self.token_cache_bytes < 0:
            raise ValueError(f"token_cache_bytes must be >= 0 (0: no cache), got {self.token_cache_bytes}")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if not all(isinstance(key, str) and key for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if self.cache_isolation not in ("none", "user", "api-key"):
            raise ValueError(f"cache_isolation must be 'none', 'user' or 'api-key', got {self.cache_isolation!r}")
        if self.cache_isolation == "api-key" and not self.api_keys:
            raise ValueError("cache_isolation 'api-key' needs api_keys (--api-key): without keys requests name no key")
        object.__setattr__(self, "served_model_aliases", tuple(self.served_model_aliases))

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every id requests may name: served_model_name first, then its aliases."""
        return (self.served_model_name, *self.served_model_aliases)

