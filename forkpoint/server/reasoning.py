"""Separating a thinking model's reasoning from its answer: `<think>...</think>` (Qwen3, Qwen3.5).

The reasoning is the text between `<think>` and `</think>`; the answer (`content`) is what follows
`</think>` (leading newlines dropped). A template that thinks opens `<think>` in the prompt
itself (Qwen3.5 with enable_thinking), so the output starts inside the reasoning:
`starts_in_reasoning=True`. Otherwise an output that begins with `<think>` enters it; any other
output is all content. Output that never closes the thought is all reasoning (as vLLM's parsers).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def held_back(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may still become
    the tag, so a stream holds it back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open for the model to continue."""
    return prompt_text.rstrip().endswith(THINK_START)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Streaming split of one output into reasoning and content: `feed` each new piece of text,
    then `finish`; `split` does a whole text at once."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"  # start -> reasoning -> content
        self._buffer = ""
        self._content_started = False

    @classmethod
    def split(cls, text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a complete output."""
        parser = cls(starts_in_reasoning)
        first, last = parser.feed(text), parser.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        in_reasoning = starts_in_reasoning or text.lstrip().startswith(THINK_START)
        return (reasoning if in_reasoning else None), (content or None)

    def feed(self, text: str) -> ReasoningDelta:
        if self._state == "content" and self._content_started:  # past the thought: all content, nothing held
            return ReasoningDelta(content=text)
        self._buffer += text
        out = ReasoningDelta()
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START):]
                    self._state = "reasoning"
                    continue
                if THINK_START.startswith(stripped):  # still may become "<think>"
                    return out
                self._state = "content"
                self._content_started = True  # no thought: the content is the output as it is
                continue
            if self._state == "reasoning":
                end = self._buffer.find(THINK_END)
                if end < 0:
                    keep = held_back(self._buffer, THINK_END)
                    out.reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.reasoning += self._buffer[:end]
                self._buffer = self._buffer[end + len(THINK_END):]
                self._state = "content"
                continue
            out.content += self._content(self._buffer)
            self._buffer = ""
            return out

    def finish(self) -> ReasoningDelta:
        """Whatever was held back (a partial tag that never completed)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=self._content(rest))

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text
