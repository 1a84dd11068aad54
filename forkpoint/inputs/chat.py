"""Rendering chat conversations to prompt text with the tokenizer's chat template.

Rendering happens on text, before tokenisation, so a checkpoint marker written inside a
message is plain text to the template and comes out unchanged; tokenising the rendered prompt
then turns it into the marker id, exactly as in a plain prompt.

Images (`render_chat_with_images`): an OpenAI `{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}` part (or an offline `{"type": "image", "image": <PIL image or
path>}` part) becomes the text `<|vision_start|><|image_pad|><|vision_end|>` at its place among
the parts, and its source is returned in order for `multi_modal_data`. Only data URLs are
accepted in `image_url`: nothing is fetched over the network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from forkpoint.inputs.template_render import render_template, render_template_and_history
from forkpoint.inputs.template_sandbox import SandboxedTemplate

# OpenAI-style text content parts are joined with a newline, as vLLM does for templates that
# take string content.
TEXT_PART_SEPARATOR = "\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | SandboxedTemplate | None = None,
    **template_kwargs: Any,
) -> str:
    """Render one conversation to prompt text as ``tokenizer.apply_chat_template`` does (`template_render.py`).

    messages: a non-empty list of dicts, each with a ``role`` (str) and a ``content`` that is a
        str or a list of OpenAI-style parts ``{"type": "text", "text": str}``; the text parts
        are joined with a newline, so the template always sees string content. Other keys
        (e.g. ``name``) are passed through to the template.
    chat_template: a Jinja template that overrides the tokenizer's own; a `SandboxedTemplate` (a
        request's template) renders in its sandbox instead, with the same variables.
    template_kwargs: extra template variables (e.g. ``enable_thinking=False``).

    Raises ValueError naming the message and field when the conversation is malformed or has
    a non-text part, and when neither the tokenizer nor the call provides a chat template.
    """
    return _render(tokenizer, messages, None, add_generation_prompt=add_generation_prompt,
                   chat_template=chat_template, **template_kwargs)


def render_chat_with_images(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | SandboxedTemplate | None = None,
    **template_kwargs: Any,
) -> tuple[str, list[Any]]:
    """`render_chat` that also takes image parts (see the module docstring). Returns the prompt
    text, with one placeholder per image, and the image sources in order (data URL strings,
    PIL images or paths), ready for `{"prompt": text, "multi_modal_data": {"image": images}}`."""
    images: list[Any] = []
    text = _render(tokenizer, messages, images, add_generation_prompt=add_generation_prompt,
                   chat_template=chat_template, **template_kwargs)
    return text, images


def render_chat_and_history(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | SandboxedTemplate | None = None,
    **template_kwargs: Any,
) -> tuple[str, list[Any], str | None]:
    """`render_chat_with_images(..., add_generation_prompt=True)` and the same conversation rendered without the
    generation prompt where one pass over it gives both (`template_render.render_template_and_history`), else
    None; for `chat_encoder(..., rendered=(messages, history))`, so the turn boundary costs no second pass."""
    images: list[Any] = []
    conversation = _conversation(tokenizer, messages, images, chat_template)
    if isinstance(chat_template, SandboxedTemplate):
        text = chat_template.render(tokenizer, conversation, add_generation_prompt=True, **template_kwargs)
        return text, images, None
    text, history = render_template_and_history(tokenizer, conversation, chat_template=chat_template,
                                                **template_kwargs)
    return _text(text), images, history


def _conversation(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], images: list[Any] | None,
                  chat_template: str | SandboxedTemplate | None) -> list[dict[str, Any]]:
    """The messages checked and normalised for the template (string content, image parts collected)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: pass chat_template=... (a Jinja template), "
            "use a tokenizer whose tokenizer_config.json or chat_template.jinja has one, "
            "or call generate() with a rendered prompt"
        )
    return [_normalize_message(index, message, images) for index, message in enumerate(_message_list(messages))]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], images: list[Any] | None, *,
            add_generation_prompt: bool, chat_template: str | SandboxedTemplate | None, **template_kwargs: Any) -> str:
    conversation = _conversation(tokenizer, messages, images, chat_template)
    if isinstance(chat_template, SandboxedTemplate):  # a request's own template: never in this process
        return chat_template.render(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                    **template_kwargs)
    return _text(render_template(tokenizer, conversation, chat_template=chat_template,
                                 add_generation_prompt=add_generation_prompt, **template_kwargs))


def _text(rendered: Any) -> str:
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


def _normalize_message(index: int, message: Any, images: list[Any] | None) -> dict[str, Any]:
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
    return {**message, "content": _content_text(index, message["content"], images)}


def _content_text(index: int, content: Any, images: list[Any] | None) -> str:
    """The message content as one string; image parts are appended to `images` (None: not allowed)."""
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
        if images is not None and isinstance(part, Mapping) and part.get("type") in ("image_url", "image"):
            images.append(_image_source(part, where))
            texts.append(IMAGE_PLACEHOLDER)
            continue
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"{where} is not a text part ({kind!r}): only {{'type': 'text', 'text': str}} "
                "parts are supported" + ("" if images is not None else
                                         " here (image parts: use render_chat_with_images / LLM.chat)")
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}['text'] must be a str")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def _image_source(part: Mapping[str, Any], where: str) -> Any:
    """The image of an `image_url` part (a data URL) or an offline `image` part (PIL image or path)."""
    if part["type"] == "image":
        if part.get("image") is None:
            raise ValueError(f"{where} is an image part without 'image': give {{'type': 'image', 'image': <PIL "
                             "image or path>}")
        return part["image"]
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str):
        raise ValueError(f"{where}['image_url'] must be {{'url': 'data:image/...;base64,...'}}")
    if not url.startswith("data:"):
        raise ValueError(f"{where}: image URL {url[:40]!r} is not fetched (no network access): send the image "
                         "inline as a data:image/...;base64 URL")
    return url


def chat_encoder(tokenizer: PreTrainedTokenizerBase, encode_text: Callable[[str], list[int]] | None = None,
                 rendered: tuple[Sequence[Mapping[str, Any]], str | None] | None = None, /, *,
                 chat_template: str | None = None,
                 **template_kwargs: Any) -> Callable[[Sequence[Mapping[str, Any]], bool], list[int]]:
    """`encode(conversation, add_generation_prompt) -> token ids` of the rendered conversation (image
    parts as one placeholder each, markers as text), for `inputs/turns.py`. encode_text: tokenises the
    rendered text; it must equal ``tokenizer.encode(text, add_special_tokens=False)`` (a server's
    `SegmentEncoder`); None: that call. rendered: (messages, their rendering without the generation prompt)
    from `render_chat_and_history` with the same template arguments: a conversation of the same message objects
    takes that text instead of a rendering. (Positional-only, so a template variable may share its name.)"""

    def encode(conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        if (not add_generation_prompt and rendered is not None and rendered[1] is not None
                and len(conversation) == len(rendered[0]) and all(a is b for a, b in zip(conversation, rendered[0]))):
            text = rendered[1]
        else:
            text = _render(tokenizer, conversation, [], add_generation_prompt=add_generation_prompt,
                           chat_template=chat_template, **template_kwargs)
        if encode_text is not None:
            return encode_text(text)
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode
