"""Request bodies of the OpenAI-compatible API, validated by pydantic (a violation is a 400 naming
the field). Only fields that forkpoint honours are declared; unknown fields are ignored, as the
OpenAI API does for fields a model does not use.

forkpoint extensions (pass them with the openai client's ``extra_body``):
- ``checkpoint_positions`` (completions): checkpoint positions in prompt tokens, for token-id
  prompts (and text prompts), as in the offline API;
- a ``"checkpoint": true`` flag on a chat text content part: checkpoint right after that part;
- vLLM's sampling extras ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TokenIds = list[int]
NO_IMAGES_IN_COMPLETIONS = ("/v1/completions takes text or token-id prompts only (a string, token ids, or a list of "
                            "either): send images to /v1/chat/completions as image_url content parts with data URLs")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by both generation endpoints (OpenAI ranges)."""

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
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a batch of either."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    checkpoint_positions: list[int] | None = None
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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported: the prompt is not returned with the completion")
        return echo


class ContentPart(BaseModel):
    """An OpenAI content part; ``checkpoint: true`` (forkpoint) checkpoints after its text."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    checkpoint: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
