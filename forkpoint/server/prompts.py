"""From HTTP request content to engine prompts: the marker policy, the structured checkpoint
controls, chat rendering and tokenisation.

Prompts are tokenised here, on the server's event loop, so that the server knows each prompt's
length (for ``max_tokens`` checks and defaults) and its checkpoint positions before the engine
sees it; the engine receives ``{"prompt_token_ids", "checkpoint_positions"}`` with the markers
already removed, which it treats exactly like the marked text (DESIGN.md section 3).

Where the marker can come from, and what the policy (`MarkerPolicy`) does to it:

    client text (messages, prompt string)  --allow: kept / strip: removed / reject: 400-->
    "checkpoint": true on a content part   --always: marker appended after the part's text-->
    checkpoint_positions (completions)     --always: passed as positions-->

Prompts are processed once: with the engine's `InputProcessor` (one server), the builder hands the
engine a `ProcessedPrompt` (validated, hashed), which `LLMEngine.add_request` takes as it is. Without
one (the replicas' ingress, whose engines live elsewhere) it hands the marker-free dict.

Chat prompts also carry where the next turn will leave them (`inputs/turns.py`: automatic CHAT_TURN
checkpoints) and their cache breakpoints (Anthropic's `cache_control` on a message or content part,
at most `MAX_BREAKPOINTS`, checkpoints at their exact ends like markers).

Images (chat `image_url` parts with data URLs, multimodal models): decoded here, their
placeholders expanded before the markers are removed, so positions count image tokens as the
engine does; the engine receives the expanded ids with the decoded images (`multi_modal_data`).
The handlers build prompts through `run` (and `from_messages_async`), in the server's tokenizer
threads (a pool): rendering, tokenising (seconds for a prompt of megabytes) and decoding images never stall
the event loop that streams every other request's tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from forkpoint.inputs.chat import chat_encoder, render_chat_and_history, render_chat_with_images
from forkpoint.inputs.images import ImageInput
from forkpoint.inputs.markers import prompt_to_token_ids, strip_checkpoint_markers
from forkpoint.inputs.multimodal import ImagePromptProcessor
from forkpoint.inputs.processor import InputProcessor, ProcessedPrompt, PromptTooLongError
from forkpoint.inputs.segment_tokens import SegmentEncoder
from forkpoint.inputs.turns import Breakpoint, breakpoint_positions, reply_continues, turn_boundaries
from forkpoint.server.config import MarkerPolicy
from forkpoint.server.errors import APIError, invalid_request
from forkpoint.server.prompt_length import tokens_beyond
from forkpoint.server.protocol import ChatMessage
from forkpoint.server.reasoning import prompt_opens_thinking

MAX_BREAKPOINTS = 4  # cache_control breakpoints per request (Anthropic's limit)


@dataclass(frozen=True)
class EnginePrompt:
    """A prompt ready for ``LLMEngine.add_request``: marker-free ids and exact positions, and the
    engine's `ProcessedPrompt` of it when the builder has the engine's processor."""

    token_ids: list[int]
    checkpoint_positions: tuple[int, ...]
    multi_modal_data: dict[str, Any] | None = None  # {"image": [ImageInput, ...]}, placeholders expanded
    opens_thinking: bool = False  # chat: the rendered prompt ends inside an open <think> (reasoning.py)
    processed: ProcessedPrompt | None = None
    cache_salt: str | None = None  # vLLM's cache_salt: part of every block hash (already in `processed`)
    # a chat's turn boundaries in token_ids and whether its turn end can start the next turn (inputs/turns.py),
    # for engines that process the prompt themselves (replicas); already in `processed` when it is set
    turn_positions: tuple[int, ...] = ()
    turn_end_reusable: bool = True

    def engine_input(self) -> ProcessedPrompt | dict[str, Any]:
        if self.processed is not None:
            return self.processed
        prompt = {"prompt_token_ids": self.token_ids, "checkpoint_positions": list(self.checkpoint_positions)}
        if self.multi_modal_data is not None:
            prompt["multi_modal_data"] = self.multi_modal_data
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


class PromptBuilder:
    """Builds `EnginePrompt`s from request content under one marker policy.

    checkpoint_token / checkpoint_token_id: the marker string and its id (None when the engine
    has checkpoints disabled: then structured controls are ignored and the marker string is
    plain text). processor: the engine's input processor (prompts leave here processed), or None.
    turn_boundaries: whether chat prompts get their turn boundaries (the engine places automatic
    checkpoints). max_model_len: without a processor (the replicas' front end), the length a prompt
    text is refused beyond before it is tokenised whole (with one, the processor's). segments: tokenises
    rendered chat prompts turn by turn with a cache of the turns seen (`inputs/segment_tokens.py`: the
    same ids, a session's next turn pays only for its new text); None: each text tokenised whole.
    chat_template: a Jinja template that chat prompts render with instead of the tokenizer's (a request's
    own template, where the server trusts those, still takes precedence). Every method raises `APIError`
    (400) naming the request field at fault.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        checkpoint_token: str,
        checkpoint_token_id: int | None,
        max_checkpoints: int,
        policy: MarkerPolicy,
        images: ImagePromptProcessor | None = None,
        executor: concurrent.futures.Executor | None = None,
        processor: InputProcessor | None = None,
        turn_boundaries: bool = False,
        max_model_len: int | None = None,
        segments: SegmentEncoder | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.segments = segments
        self.chat_template = chat_template  # the server's template (--chat-template); None: the tokenizer's
        self.processor = processor
        self.max_model_len = processor.limits.max_model_len if processor is not None else max_model_len
        self.turn_boundaries = turn_boundaries and checkpoint_token_id is not None
        self.executor = executor  # where `run` builds prompts (None: asyncio's default thread pool)
        self.images = images  # the engine's image front end (None: image parts are a 400)
        self.tokenizer = tokenizer
        self.checkpoint_token = checkpoint_token
        self.checkpoint_token_id = checkpoint_token_id
        self.max_checkpoints = max_checkpoints
        self.policy = policy

    def from_text(self, text: str, positions: Sequence[int] | None = None, *, param: str = "prompt",
                  process: bool = True, cache_salt: str | None = None) -> EnginePrompt:
        """A completion prompt string (markers in it obey the policy). `process=False` (for /tokenize):
        ids and positions only; a text that cannot fit max_model_len is refused all the same."""
        text = self._client_text(text, param)
        self._within_length(text, param)
        try:
            raw = prompt_to_token_ids(text, self.tokenizer)
        except ValueError as err:
            raise invalid_request(str(err), param=param) from None
        self._no_image_placeholders(raw.token_ids, param)
        return self._parse(raw.token_ids, positions, param, process=process, cache_salt=cache_salt)

    def from_token_ids(self, token_ids: Sequence[int], positions: Sequence[int] | None = None,
                       *, param: str = "prompt", cache_salt: str | None = None) -> EnginePrompt:
        """A token-id prompt; a marker id in it counts as client marker text."""
        self._no_image_placeholders(token_ids, param)
        if self.checkpoint_token_id is not None and self.checkpoint_token_id in token_ids:
            if self.policy is MarkerPolicy.REJECT:
                raise self._rejected(param)
            if self.policy is MarkerPolicy.STRIP:
                token_ids = [t for t in token_ids if t != self.checkpoint_token_id]
        return self._parse(list(token_ids), positions, param, cache_salt=cache_salt)

    def from_messages(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                      template_kwargs: dict[str, Any] | None = None, process: bool = True,
                      cache_salt: str | None = None) -> EnginePrompt:
        """A chat conversation, rendered with the server's or the tokenizer's chat template (images decoded in
        this thread: handlers on the event loop use `from_messages_async`). `process=False`: ids
        and positions only, not the engine's processing (for /tokenize: no exact length limit, but a
        rendering that cannot fit max_model_len is refused before it is tokenised whole)."""
        conversation = [self._message(i, message) for i, message in enumerate(messages)]
        template_kwargs = {key: self._client_value(value, "tools" if key == "tools" else "chat_template_kwargs")
                           for key, value in (template_kwargs or {}).items()}
        if self.chat_template is not None:
            template_kwargs.setdefault("chat_template", self.chat_template)
        token_ids, sources, thinking, history = self._render(conversation, add_generation_prompt, template_kwargs,
                                                             cache_salt)
        self._only_placed_markers(messages, token_ids)
        turns, breakpoints, reusable = self._chat_positions(messages, conversation, token_ids,
                                                            add_generation_prompt and process, template_kwargs,
                                                            cache_salt, history)
        images = self._load_images(sources) if sources else []
        salt = {"cache_salt": cache_salt} if cache_salt is not None else {}
        if self.processor is not None and process:
            prompt = self._process({"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}} | salt
                                   if images else {"prompt_token_ids": token_ids} | salt, "messages", turns,
                                   breakpoints, turn_end_reusable=reusable)
        elif images:
            prompt = self._with_images(token_ids, images)
        else:
            prompt = self._parse(token_ids, None, "messages", _stripped(token_ids, self.checkpoint_token_id,
                                                                        breakpoints), process=process)
            if self.processor is None and process:  # the replicas' engines process it: the turns travel with it
                prompt = dataclasses.replace(prompt, turn_positions=tuple(_stripped(
                    token_ids, self.checkpoint_token_id, turns)), turn_end_reusable=reusable)
        return dataclasses.replace(prompt, opens_thinking=thinking, cache_salt=cache_salt)

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in the executor, off the event loop (for the tokenizer's work)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def from_messages_async(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                                  template_kwargs: dict[str, Any] | None = None, process: bool = True,
                                  cache_salt: str | None = None) -> EnginePrompt:
        """`from_messages` for the event loop: rendered, tokenised and its images decoded in the executor."""
        return await self.run(self.from_messages, messages, add_generation_prompt=add_generation_prompt,
                              template_kwargs=template_kwargs, process=process, cache_salt=cache_salt)

    def _chat_positions(self, messages: Sequence[ChatMessage], conversation: list[dict[str, Any]],
                        token_ids: list[int], add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
                        cache_salt: str | None = None,
                        history: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(turn boundaries, cache breakpoint ends, whether the turn end can start the next turn) in
        `token_ids`, the rendered conversation's ids (inputs/turns.py; boundaries only with
        `add_generation_prompt`). history: `conversation` rendered without the generation prompt, where the
        prompt's rendering gave it (not rendered again). A 400 for more than MAX_BREAKPOINTS breakpoints."""
        points = [Breakpoint(i, None) for i, message in enumerate(messages) if message.cache_control is not None]
        points += [Breakpoint(i, j) for i, message in enumerate(messages) if isinstance(message.content, list)
                   for j, part in enumerate(message.content) if part.cache_control is not None]
        if len(points) > MAX_BREAKPOINTS:
            raise invalid_request(f"the messages carry {len(points)} cache_control breakpoints; at most "
                                  f"{MAX_BREAKPOINTS} are allowed per request: remove some", param="messages")
        if self.checkpoint_token_id is None or not (points or (self.turn_boundaries and add_generation_prompt)):
            return (), (), True
        encode = chat_encoder(self.tokenizer, functools.partial(self._encode_text, cache_salt=cache_salt),
                              (conversation, history), **(template_kwargs or {}))
        try:
            breakpoints = breakpoint_positions(encode, conversation, token_ids, sorted(points, key=_order))
        except ValueError as err:
            raise invalid_request(str(err), param="messages") from None
        if not (self.turn_boundaries and add_generation_prompt):
            return (), breakpoints, True
        return turn_boundaries(encode, conversation, token_ids), breakpoints, reply_continues(encode, conversation,
                                                                                               token_ids)

    def _process(self, prompt: dict[str, Any], param: str, turns: Sequence[int] = (),
                 breakpoints: Sequence[int] = (), *, turn_end_reusable: bool = True) -> EnginePrompt:
        """The engine's processing, here and once: validated, hashed, turn boundaries and breakpoints placed."""
        try:
            processed = self.processor.process(prompt, turn_positions=turns, breakpoints=breakpoints,
                                               turn_end_reusable=turn_end_reusable)
        except PromptTooLongError as err:
            raise invalid_request(str(err), param=param, code="context_length_exceeded") from None
        except ValueError as err:
            raise invalid_request(str(err), param=param) from None
        data = prompt.get("multi_modal_data")
        return EnginePrompt(processed.token_ids, processed.checkpoint_positions, data, processed=processed,
                            cache_salt=prompt.get("cache_salt"))

    def _render(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None,
                cache_salt: str | None = None) -> tuple[list[int], list[Any], bool, str | None]:
        """Token ids of the rendered conversation (markers still in), its image sources in order,
        whether the prompt leaves a thought open, and the conversation rendered without the generation
        prompt where the same pass gave it (`render_chat_and_history`), else None. A rendering that cannot
        fit max_model_len is refused before it is tokenised whole."""
        history = None
        try:
            if add_generation_prompt:
                text, sources, history = render_chat_and_history(self.tokenizer, conversation,
                                                                 **(template_kwargs or {}))
            else:
                text, sources = render_chat_with_images(self.tokenizer, conversation, add_generation_prompt=False,
                                                        **(template_kwargs or {}))
            self._within_length(text, "messages")
            token_ids = self._encode_text(text, cache_salt=cache_salt)
        except ValueError as err:
            raise invalid_request(str(err), param="messages") from None
        except TemplateError as err:  # e.g. the template's raise_exception on a role it does not know
            raise invalid_request(f"the chat template could not render these messages: {err}",
                                  param="messages") from None
        if sources and self.images is None:
            raise invalid_request("this server takes no images: its model has no vision tower", param="messages")
        return token_ids, sources, prompt_opens_thinking(text), history

    def _encode_text(self, text: str, *, cache_salt: str | None = None) -> list[int]:
        """A rendered chat prompt's token ids: `prompt_to_token_ids`'s, through the segment cache when the
        builder has one (in the request's cache_salt namespace). Raises ValueError for an empty text."""
        if self.segments is None:
            return prompt_to_token_ids(text, self.tokenizer).token_ids
        if not text:
            raise ValueError("'prompt' is an empty string: a prompt needs at least one token")
        return self.segments.encode(text, cache_salt or "")

    def _load_images(self, sources: list[Any]) -> list[ImageInput]:
        """Decode, convert and hash the images (CPU-bound, thread-safe: no shared state)."""
        try:
            return self.images.load({"image": sources})
        except ValueError as err:
            raise invalid_request(str(err), param="messages") from None

    def _with_images(self, token_ids: list[int], images: list[ImageInput]) -> EnginePrompt:
        """Expand the placeholders, then remove markers; no marker may fall inside an image."""
        try:
            prompt = self._parse(self.images.expand(token_ids, images), None, "messages", process=False)
            self.images.place(prompt.token_ids, prompt.checkpoint_positions, images)
        except ValueError as err:  # (_parse raises APIError itself)
            raise invalid_request(str(err), param="messages") from None
        return EnginePrompt(prompt.token_ids, prompt.checkpoint_positions, {"image": images})

    def _message(self, index: int, message: ChatMessage) -> dict[str, Any]:
        param = f"messages[{index}].content"
        content = message.content
        if content is None:
            content = ""
        elif isinstance(content, str):
            content = self._client_text(content, param)
        else:
            parts = []
            for part in content:
                fields = self._client_value(part.model_dump(exclude={"checkpoint", "cache_control"},
                                                            exclude_none=True), param)
                if part.type == "text" and part.text is not None:
                    text = self._client_text(part.text, param)
                    if part.checkpoint and self.checkpoint_token_id is not None:
                        text += self.checkpoint_token
                    fields["text"] = text
                parts.append(fields)
            content = parts
        fields = self._client_value(message.model_dump(exclude={"cache_control", "content"}, exclude_none=True),
                                    f"messages[{index}]")
        if "tool_calls" in fields:
            fields["tool_calls"] = self._client_value(_tool_calls_for_template(index, fields["tool_calls"]),
                                                      f"messages[{index}].tool_calls")
        return {**fields, "content": content}

    def _no_image_placeholders(self, token_ids: Sequence[int], param: str) -> None:
        """Text and token-id prompts carry no images: an image placeholder in one is a 400 that says
        where images go (the engine would refuse the prompt for a missing image)."""
        if self.images is not None and self.images.vision.image_token_id in token_ids:
            raise invalid_request(f"{param} contains the image placeholder <|image_pad|>, but text and token-id "
                                  "prompts carry no images: send images to /v1/chat/completions as image_url "
                                  "content parts with data URLs", param=param)

    def _within_length(self, text: str, param: str) -> None:
        """A 400 (context_length_exceeded) for a text that cannot fit max_model_len, found by
        tokenising little more than max_model_len tokens of it (prompt_length.py); the engine's
        processor checks the exact length of the rest. Markers are counted (at most max_checkpoints
        of them are removed later)."""
        if self.max_model_len is None:
            return
        max_model_len = self.max_model_len
        count = tokens_beyond(text, self.tokenizer, max_model_len - 1 + self.max_checkpoints)
        if count is not None:
            raise invalid_request(
                f"prompt has more than {max_model_len - 1} tokens (the first part of its text alone has {count}), "
                f"max_model_len is {max_model_len}: shorten the prompt or raise max_model_len",
                param=param, code="context_length_exceeded")

    def _client_text(self, text: str, param: str) -> str:
        """`text` under the marker policy; strip removes markers to a fixed point (removing one may
        join the halves of another: `<|mamba_<|mamba_checkpoint|>checkpoint|>`)."""
        if self.checkpoint_token not in text or self.policy is MarkerPolicy.ALLOW:
            return text
        if self.policy is MarkerPolicy.REJECT:
            raise self._rejected(param)
        while self.checkpoint_token in text:
            text = text.replace(self.checkpoint_token, "")
        return text

    def _client_value(self, value: Any, param: str) -> Any:
        """Every string in a JSON-like value (dict keys too: tool schemas, tool call arguments, template
        kwargs) under the marker policy; other objects (a sandboxed template) as they are."""
        if self.policy is MarkerPolicy.ALLOW:
            return value
        if isinstance(value, str):
            return self._client_text(value, param)
        if isinstance(value, dict):
            return {self._client_value(k, param): self._client_value(v, param) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._client_value(item, param) for item in value]
        return value

    def _only_placed_markers(self, messages: Sequence[ChatMessage], token_ids: Sequence[int]) -> None:
        """Under strip and reject, the rendered prompt holds only the markers that structured controls
        placed (`"checkpoint": true` parts): a 400 when the template joined others out of client text
        (a request template, or halves in adjacent fields) - there is no client text left to strip."""
        if self.policy is MarkerPolicy.ALLOW or self.checkpoint_token_id is None:
            return
        placed = sum(1 for message in messages if isinstance(message.content, list) for part in message.content
                     if part.type == "text" and part.text is not None and part.checkpoint)
        if token_ids.count(self.checkpoint_token_id) > placed:
            raise invalid_request(
                f"the rendered chat prompt contains the checkpoint marker {self.checkpoint_token!r} where no "
                "checkpoint control placed it (the chat template joined it out of request text), which this "
                f"server does not accept (--marker-in-user-content {self.policy.value}): place checkpoints with "
                "a content part's \"checkpoint\": true", param="messages", code="checkpoint_marker_rejected")

    def _rejected(self, param: str) -> APIError:
        return invalid_request(
            f"{param} contains the checkpoint marker {self.checkpoint_token!r}, which this server does "
            "not accept in client content (--marker-in-user-content reject): place checkpoints with "
            "a content part's \"checkpoint\": true or with checkpoint_positions",
            param=param, code="checkpoint_marker_rejected",
        )

    def _parse(self, token_ids: list[int], positions: Sequence[int] | None, param: str,
               breakpoints: Sequence[int] = (), *, process: bool = True, cache_salt: str | None = None) -> EnginePrompt:
        """Marker-free ids and positions (`breakpoints`: more positions, in stripped coordinates);
        processed by the engine's processor when the builder has it (and `process`)."""
        if self.processor is not None and process:
            prompt = {"prompt_token_ids": token_ids, "checkpoint_positions": list(positions or ())}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            return self._process(prompt, param,
                                 breakpoints=_raw_positions(token_ids, self.checkpoint_token_id, breakpoints))
        try:
            given = list(positions or ())
            parsed = strip_checkpoint_markers(token_ids, self.checkpoint_token_id,
                                              given + [p for p in breakpoints if p not in given], self.max_checkpoints)
        except ValueError as err:
            raise invalid_request(str(err), param=param) from None
        return EnginePrompt(parsed.token_ids, parsed.checkpoint_positions, cache_salt=cache_salt)


def _order(point: Breakpoint) -> tuple[int, int]:
    return point.message, -1 if point.part is None else point.part


def _stripped(token_ids: Sequence[int], marker_id: int | None, positions: Sequence[int]) -> list[int]:
    """Positions in `token_ids` (markers in) as positions of the marker-free ids."""
    if marker_id is None or not positions:
        return list(positions)
    return [p - token_ids[:p].count(marker_id) for p in positions]


def _raw_positions(token_ids: Sequence[int], marker_id: int | None, positions: Sequence[int]) -> list[int]:
    """Positions of the marker-free ids as positions in `token_ids` (markers in): the inverse of `_stripped`,
    at the first raw position with that many real tokens before it."""
    if marker_id is None or not positions:
        return list(positions)
    real = [index for index, token in enumerate(token_ids) if token != marker_id]
    return [real[p - 1] + 1 for p in positions if 0 < p <= len(real)]


def _tool_calls_for_template(index: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool calls with `arguments` decoded from JSON text into a
    dict, as chat templates (Qwen's among them) iterate over them."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise invalid_request(f"{param} must be a list of tool calls", param=param)
    result = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_request(f"{param}: each call needs function.name", param=param)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise invalid_request(f"{param}: function.arguments is not valid JSON: {err}", param=param) from None
        if not isinstance(arguments, dict):
            raise invalid_request(f"{param}: function.arguments must be a JSON object", param=param)
        result.append({**call, "function": {**function, "arguments": arguments}})
    return result
