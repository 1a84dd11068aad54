"""From a validated request body to `SamplingParams`: the sampling fields, the logits processors,
and the one structured-output constraint a request may carry (response_format, structured_outputs,
vLLM's guided_* fields, or the JSON a tool_choice of "required" or a named function implies).

Every conflict or unusable value is an `APIError` (400) naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from forkpoint.sampling_params import SamplingParams, StructuredOutputsParams
from forkpoint.server.errors import invalid_request
from forkpoint.server.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    SamplingFields,
)

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    structured: StructuredOutputsParams | None) -> SamplingParams:
    """SamplingParams of a request; SamplingParams' own ValueErrors become 400s naming the field."""
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
            structured_outputs=structured)
    except ValueError as err:  # SamplingParams names the field first: "stop must be ..."
        field_name = str(err).split(" ", 1)[0]
        raise invalid_request(str(err), param=field_name if field_name in SAMPLING_FIELDS else None) from None


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured-output constraint, from whichever one field carries it."""
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


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The JSON that tool_choice "required" or a named function forces (vLLM's way): for a named
    function, its arguments object; for "required", a list of {"name", "parameters"} calls."""
    choice = body.tool_choice
    if body.tools is None or choice is None or choice in ("none", "auto"):
        return None
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
