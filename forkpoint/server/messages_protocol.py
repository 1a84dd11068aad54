"""The request bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API,
as vLLM serves it), validated by pydantic: a violation is a 400 naming the field, and so is any
field not declared here (the server's rule, protocol.py): `service_tier`, `container`,
`mcp_servers`, `context_management`, ... messages_input.py turns a valid body into a chat request.

A message is `{"role": "user" | "assistant", "content": str | [block, ...]}`; the blocks taken:

    text               {"text", "cache_control"?}                          user, assistant
    image              {"source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"},
                        "cache_control"?}                                   user
    tool_use           {"id", "name", "input": {...}, "cache_control"?}    assistant
    tool_result        {"tool_use_id", "content": str | [text block], "is_error"?, "cache_control"?}
                                                                            user
    thinking           {"thinking", "signature"?}                          assistant (sent back; dropped)
    redacted_thinking  {"data"}                                            assistant (sent back; dropped)

Any other block type, or a block in the other role's message, is a 400 naming `messages` that says
which types are taken.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forkpoint.server.protocol import CacheControl, validated_element

BLOCKS_BY_ROLE = {"user": ("text", "image", "tool_result"),
                  "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class TextBlock(BaseModel):
    """A text block; `citations` are output metadata a client may send back: accepted only empty."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, citations: list[Any] | None) -> list[Any] | None:
        if citations:
            raise ValueError("citations are not taken on input text: send the text alone")
        return citations


class Base64Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image"]
    source: Base64Source | URLSource = Field(discriminator="type")
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        """The image as the chat path's `image_url` takes it: a data URL (a URL source as it is)."""
        source = self.source
        return source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(BaseModel):
    """A call the model made (an earlier message's output block, sent back)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """The result of a call, for the model to read. `is_error` has no chat counterpart: the content
    alone is rendered."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    """An earlier message's thinking, sent back: accepted, left out of the prompt."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCK_MODELS: dict[str, type[BaseModel]] = {
    "text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        """Each block as its model, with a ValueError naming the block (`content[j]`) and the block
        types the message's role takes."""
        content = value.get("content") if isinstance(value, dict) else None
        if not isinstance(content, list):
            return value
        role = value.get("role")
        taken = BLOCKS_BY_ROLE.get(role, tuple(_BLOCK_MODELS))
        parsed = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in taken:
                raise ValueError(f"content[{j}] has type {kind!r}, which forkpoint does not take in a {role} "
                                 f"message: {role} blocks are {', '.join(taken)}")
            parsed.append(validated_element(_BLOCK_MODELS[kind], block, f"content[{j}] ({kind})"))
        return {**value, "content": parsed}


class Tool(BaseModel):
    """A client tool (`type` "custom" or none). Anthropic's server tools (`bash_...`, `web_search_...`,
    `text_editor_...`, ...) are a 400 naming `tools`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    """auto, any (some tool: chat's "required"), tool (the named one), none."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only that type takes one")
        return self


class ThinkingConfig(BaseModel):
    """The template's thinking switch: enabled and adaptive (the model decides how much) turn it on;
    `budget_tokens` is accepted and not enforced (docs/server.md)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("thinking of type 'enabled' needs budget_tokens, and only that type takes it")
        return self


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what makes the prompt."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Anthropic's automatic caching: a breakpoint on the last block of the last message
    cache_control: CacheControl | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type", "custom") if isinstance(tool, dict) else None
            if kind != "custom":
                raise ValueError(f"tools[{i}] has type {kind!r}, which forkpoint does not serve: it takes client "
                                 "tools only ({\"name\", \"description\", \"input_schema\"})")
        return tools

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, messages: list[Message]) -> list[Message]:
        if messages and messages[-1].role == "assistant":
            raise ValueError("the last message is an assistant message (a prefill), which forkpoint does not "
                             "continue: end with a user message")
        return messages

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> CountTokensRequest:
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.name is not None and choice.name not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice names tool {choice.name!r}, which is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Every field Anthropic's API has and forkpoint does not honour is left
    undeclared: a 400 naming it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: Metadata | None = None
    # vLLM's extension, as on the other endpoints: requests with different salts share no reuse
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
