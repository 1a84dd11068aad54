"""From a validated request body to `SamplingParams`: the sampling fields, the logits processors,
and the one structured-output constraint a request may carry (response_format, structured_outputs,
vLLM's guided_* fields, or the JSON a tool_choice of "required" or a named function implies).

Every conflict or unusable value is an `APIError` (400) naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pydantic import BaseModel

from forkpoint.inputs.template_sandbox import SandboxedTemplate, TemplateSandbox
from forkpoint.sampling_params import SamplingParams, StructuredOutputsParams
from forkpoint.server.errors import invalid_request
from forkpoint.server.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
)

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# a seed is a 64-bit integer (vLLM's range); the n sequences of a request use seed .. seed + n - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
# arguments the chat template's render call passes itself: chat_template_kwargs may not set them
RENDER_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "images"})
_SURROGATE = re.compile("[\ud800-\udfff]")


def reject_unencodable_text(body: BaseModel) -> None:
    """400 naming the top-level field of `body` that holds a lone UTF-16 surrogate anywhere inside it
    (a JSON "\\ud800" escape without its pair, or CESU-8 bytes, which the JSON decoder turns into
    one): such text has no UTF-8 form, so nothing can tokenise or match it."""
    fields = dict(body)
    fields.update(body.model_extra or {})
    for name, value in fields.items():
        if _has_surrogate(value):
            raise invalid_request(f"{name} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape, "
                                  "or a surrogate written as UTF-8 bytes): send valid Unicode text", param=name)


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):  # isascii is O(1): a 50 MB ASCII prompt skips a 0.35 s scan on the event loop
        return not value.isascii() and _SURROGATE.search(value) is not None
    if isinstance(value, BaseModel):
        return any(_has_surrogate(v) for v in dict(value).values()) or _has_surrogate(value.model_extra or {})
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    return False


def rejected_param(error: ValueError, prompt_param: str) -> str:
    """The request field a ValueError of the engine's `add_request` is about: the sampling field its
    message starts with ("logit_bias has token ids outside the vocabulary ..."), else the prompt."""
    field_name = str(error).split(" ", 1)[0]
    return field_name if field_name in SAMPLING_FIELDS else prompt_param


def template_kwargs(body: ChatCompletionRequest | TokenizeRequest,
                    sandbox: TemplateSandbox | None = None) -> dict[str, Any]:
    """The chat template's extra variables: `chat_template_kwargs` plus the request's `tools`.
    A key that the render call sets itself (`RENDER_ARGUMENTS`) is a 400. A template of the request's
    own (`chat_template`) runs in `sandbox` (the operator trusts request templates), and without one
    is a 400."""
    kwargs = dict(body.chat_template_kwargs or {})
    clashes = sorted(RENDER_ARGUMENTS.intersection(kwargs))
    if clashes:
        raise invalid_request(f"chat_template_kwargs may not set {clashes}: the server passes them to the template "
                              "itself (tools go in the tools field, add_generation_prompt at the top level)",
                              param="chat_template_kwargs")
    if "chat_template" in kwargs and sandbox is not None:
        if not isinstance(kwargs["chat_template"], str) or not kwargs["chat_template"]:
            raise invalid_request("chat_template_kwargs.chat_template must be a Jinja template string",
                                  param="chat_template_kwargs")
        kwargs["chat_template"] = SandboxedTemplate(kwargs["chat_template"], sandbox)
    elif "chat_template" in kwargs:
        raise invalid_request("chat_template_kwargs.chat_template: this server does not run request-supplied chat "
                              "templates (its operator may allow them with --trust-request-chat-template)",
                              param="chat_template_kwargs")
    if body.tools is not None:
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return kwargs


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    structured: StructuredOutputsParams | None) -> SamplingParams:
    """SamplingParams of a request; SamplingParams' own ValueErrors become 400s naming the field."""
    if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
        raise invalid_request(f"seed must be a 64-bit integer ({SEED_RANGE[0]} .. {SEED_RANGE[1]}), got {body.seed}",
                              param="seed")
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed, max_tokens=max_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids, min_tokens=body.min_tokens, bad_words=body.bad_words,
            structured_outputs=structured, skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as err:  # SamplingParams names the field first: "stop must be ..."
        field_name = str(err).split(" ", 1)[0]
        raise invalid_request(str(err), param=field_name if field_name in SAMPLING_FIELDS else None) from None


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured-output constraint, from whichever one field carries it."""
    given = _constraint_fields(body)
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise invalid_request(f"give at most one structured-output constraint, got {names}", param=given[1][0])
    name, fields = given[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as err:
        raise invalid_request(f"{name}: {err}", param=name) from None


def constraint_param(body: SamplingFields) -> str | None:
    """The request field whose constraint the output follows (named by a 400 when it does not compile):
    tool_choice when it forces a tool call, else the structured-output field given; None without one."""
    if isinstance(body, ChatCompletionRequest) and forces_tool_call(body):
        return "tool_choice"
    given = _constraint_fields(body)
    return given[0][0] if given else None


def _constraint_fields(body: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field name, StructuredOutputsParams keyword arguments) of every structured-output field given."""
    given: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None and body.response_format.type != "text":
        fmt = body.response_format
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else {"type": "object"}
        given.append(("response_format", {"json": schema}))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        given.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            given.append((name, {key: getattr(body, name)}))
    return given


def forces_tool_call(body: ChatCompletionRequest) -> bool:
    """Whether tool_choice ("required" or a named function, with tools given) constrains the output."""
    return body.tools is not None and body.tool_choice is not None and body.tool_choice not in ("none", "auto")


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The JSON that tool_choice "required" or a named function forces (vLLM's way): for a named
    function, its arguments object; for "required", a list of {"name", "parameters"} calls."""
    if not forces_tool_call(body):
        return None
    choice = body.tool_choice
    functions = {t.function.name: t.function for t in body.tools}
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputsParams(json=_parameters_schema(functions[choice.function.name].parameters))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "const": name},
                                               "parameters": _parameters_schema(fn.parameters)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, fn in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}
