"""Shapes of the generation endpoints' choices: the shared `ResponseFormatter` and /v1/completions'
`CompletionFormat` (echo, prompt logprobs in OpenAI's and vLLM's layouts). Chat: chat_format.py.

A formatter is made per request; `transform` adjusts each engine output first (dropping the one
token that `max_tokens: 0` samples), then `choice` shapes a whole response's choice and
`chunk_choice` a streamed one, from a `Delta`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from forkpoint.outputs import RequestOutput


@dataclass
class Delta:
    """New output of one choice since the last chunk (the whole output for a full response).
    output: the prompt's latest RequestOutput (prompt ids and prompt logprobs for echo)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int = 0
    output: RequestOutput | None = None


class ResponseFormatter(abc.ABC):
    """Shape of one endpoint's responses. Subclasses fill in the choice layouts."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs in the response
        self._texts: dict[int, str] = {}  # token id -> its text, for this response's logprobs

    def transform(self, output: RequestOutput) -> RequestOutput:
        """The engine output as the response reports it (unchanged unless a subclass says otherwise)."""
        return output

    @abc.abstractmethod
    def choice(self, delta: Delta) -> dict[str, Any]:
        """A choice of the whole response (`delta` holds the complete output)."""

    @abc.abstractmethod
    def chunk_choice(self, delta: Delta) -> dict[str, Any]:
        """A choice of a streamed chunk."""

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices of the chunks sent before any token (chat: the assistant role)."""
        return []

    def token_text(self, token_id: int) -> str:
        """`tokenizer.decode([token_id])`, each id decoded once a response."""
        text = self._texts.get(token_id)
        if text is None:
            # as token_texts: the Rust decode is the wrapper's when the tokenizer cleans up no spaces, and
            # skips the wrapper's argument conversions (most of a streamed logprobs chunk's host time)
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            text = self._texts[token_id] = (
                self.tokenizer.decode([token_id]) if backend is None or self.tokenizer.clean_up_tokenization_spaces
                else backend.decode([token_id], skip_special_tokens=False))
        return text

    def top(self, logprobs: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(logprobs.items(), key=lambda item: -item[1])[: self.top_logprobs]


class CompletionFormat(ResponseFormatter):
    """/v1/completions. echo: the choice's text (and logprobs) start with the prompt; drop_output:
    `max_tokens: 0` (the sampled token is not reported); prompt_logprobs: vLLM's `prompt_logprobs`
    field in each choice (k, or None for none)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top_logprobs: int | None, *, echo: bool = False,
                 drop_output: bool = False, prompt_logprobs: int | None = None) -> None:
        super().__init__(tokenizer, top_logprobs)
        self.echo = echo
        self.drop_output = drop_output
        self.prompt_logprobs = prompt_logprobs
        self._prompt_chars: dict[int, int] = {}  # echo: choice -> length of its echoed prompt text

    def transform(self, output: RequestOutput) -> RequestOutput:
        if not self.drop_output:
            return output
        empty = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                     finish_reason="length" if c.finish_reason else None) for c in output.outputs]
        return dataclasses.replace(output, outputs=empty)

    def choice(self, delta: Delta) -> dict[str, Any]:
        echo = self.echo and delta.index not in self._prompt_chars and delta.output is not None
        prompt_text = self.tokenizer.decode(delta.output.prompt_token_ids) if echo else ""
        if echo:
            self._prompt_chars[delta.index] = len(prompt_text)
        out = {"index": delta.index, "text": prompt_text + delta.text,
               "logprobs": self._logprobs(delta, echo, self._prompt_chars.get(delta.index, 0)),
               "finish_reason": delta.finish_reason}
        if self.prompt_logprobs is not None and delta.output is not None and (echo or not self.echo):
            out["prompt_logprobs"] = prompt_logprobs_json(self.tokenizer, delta.output.prompt_logprobs)
        return out

    def chunk_choice(self, delta: Delta) -> dict[str, Any]:
        return self.choice(delta)

    def _logprobs(self, delta: Delta, echo: bool, prompt_chars: int) -> dict[str, Any] | None:
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        if echo and delta.output is not None:  # the prompt's tokens first: None for the first one
            prompt_ids, entries = delta.output.prompt_token_ids, delta.output.prompt_logprobs
            if entries is None or len(entries) != len(prompt_ids):
                raise ValueError("echo with logprobs needs the engine's prompt_logprobs, one entry per prompt token")
            texts = token_texts(self.tokenizer, [*prompt_ids, *(t for e in entries if e is not None for t in e)])
            for token_id, entry in zip(prompt_ids, entries):
                text = texts[token_id]
                tokens.append(text)
                token_logprobs.append(None if entry is None else float(entry[token_id]))
                top.append(None if entry is None else {texts[t]: float(lp) for t, lp in self.top(entry)})
                offsets.append(offset)
                offset += len(text)
        offset = prompt_chars + delta.text_offset
        for token_id, entry in zip(delta.token_ids, delta.logprobs):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry.get(token_id))
            top.append({self.token_text(t): lp for t, lp in self.top(entry)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(tokenizer: PreTrainedTokenizerBase,
                         entries: list[dict[int, float] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` layout: per prompt token None (the first) or {token id (str):
    {"logprob", "rank", "decoded_token"}} holding the actual token and the top k."""
    if entries is None:
        return None
    texts = token_texts(tokenizer, (t for entry in entries if entry is not None for t in entry))
    result: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        result.append({str(t): {"logprob": float(lp), "rank": getattr(lp, "rank", None),
                                "decoded_token": texts[t]} for t, lp in entry.items()})
    return result


def token_texts(tokenizer: PreTrainedTokenizerBase, token_ids: Iterable[int]) -> dict[int, str]:
    """Each distinct id of `token_ids` -> `tokenizer.decode([id])`, decoded in one call to the Rust
    tokenizer (`backend_tokenizer.decode_batch`) when the tokenizer has one and cleans up no spaces (its
    decode is then that call's). A prompt's scores are tens of thousands of ids (8,192 tokens with 5
    logprobs: 49k), 0.13 s one Python decode at a time against 0.035 s in one batch on the CPU, time
    the response's render held the GIL from the engine thread and the event loop: issue 27's
    echo_logprobs_8k case had the bystander's largest gap there, at the end of the case."""
    ids = list(dict.fromkeys(token_ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or tokenizer.clean_up_tokenization_spaces:
        return {t: tokenizer.decode([t]) for t in ids}
    return dict(zip(ids, backend.decode_batch([[t] for t in ids], skip_special_tokens=False)))
