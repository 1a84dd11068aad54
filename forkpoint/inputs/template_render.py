"""Rendering a chat template as `tokenizer.apply_chat_template(..., tokenize=False)` does, without its
per-call copies of the conversation.

transformers rebuilds everything the template sees on every call: the messages are copied twice over
(objects to dicts, then to plain JSON types, recursively), the tools, documents and keyword arguments
once. A chat server renders each request's whole conversation three times (the prompt, its history and
the next-turn probe of `inputs/turns.py`), so at turn 5 of issue 26's agent workload (14 messages, 21k
characters) those copies cost as much as half the template itself.

The copies exist to turn rich objects (pydantic models, dataclasses, images, str subclasses) into plain
JSON values. A conversation that is plain JSON already (exact `dict`, `list`, `tuple`, `str`, `int`,
`float`, `bool`, None: what a parsed request body holds) comes out of them equal to itself, so
`render_template` renders it as it is with transformers' own compiled template (its environment,
filters and sandbox: `ImmutableSandboxedEnvironment`, whose templates cannot mutate what they are given)
and the same variables:

    messages               top-level None values dropped, reasoning fields aliased (transformers' helper)
    tools, documents       as given (None when absent)
    add_generation_prompt
    the special tokens     tokenizer.special_tokens_map, overridden by
    template kwargs        the rest

Anything else (a value of another type anywhere, a tokenizer class with its own `apply_chat_template`,
a dict of named templates, `documents` that are not dicts, callables as tools, a template kwarg named
like one of `apply_chat_template`'s own parameters) goes through
`apply_chat_template` itself. The text is the same either way: tests render random conversations both
ways (tool calls, reasoning fields, None values, thinking on and off, several templates).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils import chat_template_utils

PLAIN_SCALARS = (str, int, float, bool, type(None))
# apply_chat_template's own parameters: a template kwarg of one of these names (a client's chat_template_kwargs
# may hold "continue_final_message") changes what it does, so such calls go through it
OWN_PARAMETERS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs", "tools", "documents"}


def render_template(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]], *,
                    chat_template: str | None, add_generation_prompt: bool, **template_kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(conversation, chat_template=chat_template, add_generation_prompt=...,
    tokenize=False, **template_kwargs)``: the same value (see the module docstring), and the same errors
    (the fallback raises them)."""
    if _direct(tokenizer, conversation, chat_template, template_kwargs):
        kwargs = dict(template_kwargs)
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        template = chat_template_utils._compile_jinja_template(tokenizer.get_chat_template(chat_template, tools))
        messages = chat_template_utils._alias_reasoning_fields(
            [{key: value for key, value in message.items() if value is not None} for message in conversation])
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt,
                               **{**tokenizer.special_tokens_map, **kwargs})
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def _direct(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]], chat_template: str | None,
            template_kwargs: dict[str, Any]) -> bool:
    """Whether `render_template` may skip `apply_chat_template`: transformers' own method and template
    lookup, one template string, a non-empty list of dict messages and every value plain JSON."""
    cls = type(tokenizer)
    if (cls.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template
            or cls.get_chat_template is not PreTrainedTokenizerBase.get_chat_template
            or not isinstance(chat_template if chat_template is not None else tokenizer.chat_template, str)):
        return False
    if type(conversation) is not list or not conversation or any(type(m) is not dict for m in conversation):
        return False
    tools, documents = template_kwargs.get("tools"), template_kwargs.get("documents")
    if tools is not None and (type(tools) is not list or any(type(tool) is not dict for tool in tools)):
        return False
    if documents is not None and (type(documents) is not list or any(type(d) is not dict for d in documents)):
        return False
    if any(type(key) is not str or key in OWN_PARAMETERS for key in template_kwargs):
        return False
    return _plain(conversation) and _plain(template_kwargs)


def _plain(value: Any) -> bool:
    """Whether `value` is made of exact JSON types only (dict keys: str), which transformers' copies
    (`_message_objects_to_dicts`, `_plain_template_data`) return unchanged."""
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return True
    if kind is dict:
        return all(type(key) is str and _plain(item) for key, item in value.items())
    if kind is list or kind is tuple:
        return all(_plain(item) for item in value)
    return False
