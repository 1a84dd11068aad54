"""The request body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it), validated by
pydantic: a violation is a 400 naming the field, and so is any top-level field not declared here
(the server's rule, protocol.py). responses_input.py turns a valid body into a chat request.

`input` is a string (one user message) or a list of items:

    {"role", "content"} / {"type": "message", ...}   roles user, system, developer, assistant;
                                                     content a string or input_text / output_text parts
    {"type": "function_call", "call_id", "name", "arguments"}
    {"type": "function_call_output", "call_id", "output"}
    {"type": "reasoning", ...}                       accepted and dropped (vLLM's way)

Any other item or part type is a 400 naming `input` that says which types are taken. The fields
that output items carry when a client sends a response's `output` back (`id`, `status`,
`annotations`, `logprobs`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from forkpoint.server.protocol import validated_element

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
TOOL_TYPES = ("function",)
Status = Literal["in_progress", "completed", "incomplete"]


class TextPart(BaseModel):
    """input_text (user, system) or output_text (assistant) content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _text_parts(content: Any) -> Any:
    """A clear error for a content part forkpoint does not take (images, files, refusals)."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise ValueError(f"content[{j}] has type {kind!r}, which forkpoint does not take here: content parts "
                             f"are {' and '.join(PART_TYPES)}")
    return content


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Status | None = None
    phase: str | None = None

    _parts = field_validator("content", mode="before")(_text_parts)


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output item, sent back)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: Status | None = None

    _parts = field_validator("output", mode="before")(_text_parts)


class ReasoningItem(BaseModel):
    """An earlier response's reasoning, sent back: accepted, left out of the prompt."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_MODELS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                            "function_call_output": FunctionCallOutputItem,
                                            "reasoning": ReasoningItem}


def parse_items(items: list[Any], name: str) -> list[InputItem]:
    """Each item of `items` (JSON objects) as its model; a ValueError naming the item (`name[i]`)
    and, for an unknown type, the types that are taken. Also reads a stored response's output items,
    which are valid input items."""
    parsed = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{name}[{i}] must be an object (an item), got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_MODELS:
            raise ValueError(f"{name}[{i}] has type {kind!r}, which forkpoint does not take: items are "
                             f"{', '.join(ITEM_TYPES)} (or {{\"role\", \"content\"}} messages)")
        parsed.append(validated_element(_ITEM_MODELS[kind], item, f"{name}[{i}] ({kind})"))
    return parsed


class FunctionTool(BaseModel):
    """A function tool in the Responses API's flat shape (the chat API nests it under "function")."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: text (no constraint), json_object, or json_schema with its flat `name` /
    `schema` / `description` / `strict` (the chat API nests them under "json_schema")."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("format of type json_schema needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """`reasoning.effort`: "none" / "minimal" turn the template's thinking off, the others on
    (responses_input.py); `summary` is accepted (no summaries are written: `summary: []`)."""

    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Every field OpenAI's API has and forkpoint does not honour is left
    undeclared (a 400 naming it), except the few accepted with their one honoured value
    (`truncation: "disabled"`, `background: false`, `include: []`)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)
    # vLLM's extension, as on the other endpoints: requests with different salts share no reuse (and no stored
    # response: responses_serving.py)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: Literal[False] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in TOOL_TYPES:
                raise ValueError(f"tools[{i}] has type {kind!r}, which forkpoint does not serve: it takes function "
                                 "tools only ({\"type\": \"function\", \"name\", \"parameters\", ...})")
        return tools

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input is an empty list: give a string or at least one item")
        return parse_items(value, "input")

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, include: list[str] | None) -> list[str] | None:
        if include:
            raise ValueError(f"include {include} asks for output data forkpoint does not produce: send [] or leave "
                             "it out")
        return include

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")  # declared before tool_choice: validated first (absent if invalid)
        if choice is not None and choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools")
        if isinstance(choice, FunctionChoice) and choice.name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice names function {choice.name!r}, which is not in tools")
        return choice
