"""Request bodies of the OpenAI-compatible API, validated by pydantic (a violation is a 400 naming
the field). Only fields that forkpoint honours are declared, and a request with any other
top-level field is a 400 naming it (`extra="forbid"`): nothing a client sends is silently ignored.
docs/server.md lists every parameter with its status.

forkpoint extensions (pass them with the openai client's ``extra_body``):
- ``checkpoint_positions`` (completions): checkpoint positions in prompt tokens, for token-id
  prompts (and text prompts), as in the offline API;
- a ``"checkpoint": true`` flag on a chat text content part: checkpoint right after that part;
- vLLM's extras: sampling (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
  ``stop_token_ids``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``),
  structured outputs (``structured_outputs``, and the older ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``), the output text (``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``include_stop_str_in_output``), ``chat_template_kwargs``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

TokenIds = list[StrictInt]  # strict: a JSON true or 1.0 is not a token id
# stop strings are matched against every new token's text on the engine thread: bounded in number and
# length (OpenAI takes 4; lm-eval-harness and agents send a handful)
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024

NO_IMAGES_IN_COMPLETIONS = ("/v1/completions takes text or token-id prompts only (a string, token ids, or a list of "
                            "either): send images to /v1/chat/completions as image_url content parts with data URLs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` body: exactly one of json, regex, choice, grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class SamplingFields(BaseModel):
    """Sampling fields shared by both generation endpoints (OpenAI ranges)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    # logits processors (OpenAI: logit_bias, keys are token ids as strings; the rest vLLM's)
    logit_bias: dict[str, StrictFloat] | None = None  # strict: a JSON true is not a bias
    allowed_token_ids: TokenIds | None = None
    min_tokens: int = Field(0, ge=0)
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # the output text (vLLM's; SamplingParams says what they do)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None  # llguidance is what runs
    # OpenAI's prompt caching hints (docs/server.md): requests with one key share a replica; retention
    # is accepted and has no further effect (checkpoints live until evicted, in every tier)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    # vLLM's cache_salt: requests with different salts share no checkpoint and no KV block, so reuse
    # (usage.prompt_tokens_details.cached_tokens) reveals nothing across salts (docs/server.md)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(strings)} strings; at most {MAX_STOP_STRINGS} are taken")
        longest = max(strings, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {len(longest)} characters; at most {MAX_STOP_CHARS} are taken")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a batch of either."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    checkpoint_positions: list[StrictInt] | None = None
    # declared only to refuse them: an image silently dropped would score the wrong prompt
    multi_modal_data: Any = None
    images: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_only(cls, prompt: Any) -> Any:
        """Content parts or vLLM-style prompt dicts (images) get a clear 400, not a type error list."""
        items = prompt if isinstance(prompt, list) else [prompt]
        if any(isinstance(item, dict) for item in items):
            raise ValueError(NO_IMAGES_IN_COMPLETIONS)
        return prompt

    @field_validator("multi_modal_data", "images")
    @classmethod
    def _no_images(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(NO_IMAGES_IN_COMPLETIONS)
        return value

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is an empty list: give a string, token ids, or a non-empty batch")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo: true (score the prompt without generating)")
        return self


class CacheControl(BaseModel):
    """Anthropic's cache breakpoint, ``{"type": "ephemeral"}`` (``ttl`` "5m" or "1h" is accepted: a
    checkpoint lives until evicted, whatever it asks for)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class ContentPart(BaseModel):
    """An OpenAI content part; ``checkpoint: true`` (forkpoint) checkpoints after its text, and so does
    ``cache_control`` (Anthropic's breakpoint, at the part's exact end in the rendered prompt)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    checkpoint: bool = False
    cache_control: CacheControl | None = None


class ChatMessage(BaseModel):
    """A message; other keys (``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``)
    go to the chat template. ``cache_control`` checkpoints at the message's end in the rendered prompt."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    cache_control: CacheControl | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of ``prompt`` and ``messages`` (with ``tools`` rendered as chat does)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: TokenIds


def validated_element(model: type[BaseModel], value: Any, label: str) -> BaseModel:
    """`model.model_validate(value)` for one element of a typed list (an input item, a content block),
    its first error as a ValueError that names the element (`label`, e.g. "input[2] (message)") and
    the field inside it, so the request's 400 says where."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{label} {where}: {first['msg'].removeprefix('Value error, ')}") from None
