"""Rendering chat conversations to prompt text with the tokenizer's chat template.

Rendering happens on text, before tokenisation, so a checkpoint marker written inside a
message is plain text to the template and comes out unchanged; tokenising the rendered prompt
then turns it into the marker id, exactly as in a plain prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# OpenAI-style text content parts are joined with a newline, as vLLM does for templates that
# take string content.
TEXT_PART_SEPARATOR = "\n"


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """Render one conversation to prompt text with ``tokenizer.apply_chat_template``.

    messages: a non-empty list of dicts, each with a ``role`` (str) and a ``content`` that is a
        str or a list of OpenAI-style parts ``{"type": "text", "text": str}``; the text parts
        are joined with a newline, so the template always sees string content. Other keys
        (e.g. ``name``) are passed through to the template.
    chat_template: a Jinja template that overrides the tokenizer's own.
    template_kwargs: extra template variables (e.g. ``enable_thinking=False``).

    Raises ValueError naming the message and field when the conversation is malformed or has
    a non-text part, and when neither the tokenizer nor the call provides a chat template.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: pass chat_template=... (a Jinja template), "
            "use a tokenizer whose tokenizer_config.json or chat_template.jinja has one, "
            "or call generate() with a rendered prompt"
        )
    conversation = [_normalize_message(index, message) for index, message in
                    enumerate(_message_list(messages))]
    rendered = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    if not isinstance(rendered, str):
        raise ValueError(
            f"the chat template rendered a {type(rendered).__name__}, not a str: pass one "
            "conversation (a list of message dicts) per call"
        )
    return rendered


def _message_list(messages: Any) -> Sequence[Any]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of message dicts, not {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    return messages


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(
            f"messages[{index}] must be a dict with 'role' and 'content', "
            f"not {type(message).__name__}"
        )
    for field in ("role", "content"):
        if field not in message:
            raise ValueError(f"messages[{index}] has no '{field}': every message needs "
                             "'role' and 'content'")
    role = message["role"]
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}]['role'] must be a non-empty str, not {role!r}")
    return {**message, "content": _content_text(index, message["content"])}


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise ValueError(
            f"messages[{index}]['content'] must be a str or a list of "
            f"{{'type': 'text', 'text': str}} parts, not {type(content).__name__}"
        )
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}]['content'][{part_index}]"
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"{where} is not a text part ({kind!r}): only {{'type': 'text', 'text': str}} "
                "parts are supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}['text'] must be a str")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)
