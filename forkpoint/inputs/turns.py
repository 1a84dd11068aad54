"""Where a chat prompt's next turn will leave it, and where a client's cache breakpoints end, in exact
token positions of the rendered prompt.

A chat template renders the whole conversation every turn, and it does not render the conversation of
turn k as a prefix of turn k+1: the generation prompt (Qwen3.5: `<|im_start|>assistant\\n<think>\\n\\n
</think>\\n\\n` with thinking off) is replaced by the assistant message as the client sends it back
(`<|im_start|>assistant\\n{content}<|im_end|>`, earlier thoughts dropped). What turn k+1 certainly
shares with turn k is the rendered history without the generation prompt. So the position is found
by rendering, never by guessing strings:

    full      = tokens(render(messages, add_generation_prompt=True))     the prompt itself
    history   = tokens(render(messages, add_generation_prompt=False))
    boundary  = longest common prefix of (history, full)                  in full's token ids

Comparing token ids (not text) keeps the position exact when a merge crosses the join. An agent that
appends several tool results gets one boundary after each of them (the rendering of the conversation
up to that tool message, against the prompt), so a client that resends fewer results reuses the rest.

Whether the turn end (prompt plus reply) can be a prefix of the next turn is found the same way: the
conversation with a reply and a next message appended, rendered, either continues `full` (templates that
render the reply right after the generation prompt) or leaves it inside the generation prompt (Qwen3.5
with `enable_thinking` set: the next turn drops the `<think>` block), and then a checkpoint after the
reply can never be read.

Cache breakpoints (Anthropic's `cache_control`) use the same rule: a message's breakpoint ends where
the rendering of the conversation up to that message leaves the prompt; a content part's, where the
renderings of that message cut after the part, and after the part plus one more, leave each other
(the part's own end, before whatever the template writes after it).

Positions are in the coordinates of `full` (the rendered text's token ids, markers and one
`<|image_pad|>` per image still in); `inputs/processor.py` maps them to the processed prompt's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# tool results of one trailing run that get a boundary each (the most recent ones)
MAX_TOOL_BOUNDARIES = 4
PROBE_PART = {"type": "text", "text": "x"}  # a part after a breakpoint part: where the part's text ends
# what a next turn appends: the reply as the client sends it back, then a message after it (templates render
# the last assistant message differently from earlier ones)
PROBE_TURN = ({"role": "assistant", "content": "x"}, {"role": "user", "content": "x"})

PREFIX_CHUNK = 256  # ids compared per slice in common_prefix_length
Encode = Callable[[Sequence[Mapping[str, Any]], bool], list[int]]  # (conversation, add_generation_prompt) -> ids


@dataclass(frozen=True)
class Breakpoint:
    """A cache breakpoint at the end of messages[message] (part None) or of its content part `part`."""

    message: int
    part: int | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids `a` and `b` share."""
    limit = min(len(a), len(b))
    start = 0
    while start < limit:  # chunks compared in C: one pass over the shared prefix, then a short scan
        end = min(limit, start + PREFIX_CHUNK)
        if a[start:end] != b[start:end]:
            break
        start = end
    while start < limit and a[start] == b[start]:
        start += 1
    return start


def turn_boundaries(encode: Encode, messages: Sequence[Mapping[str, Any]], full: Sequence[int]) -> tuple[int, ...]:
    """Positions in `full` (the tokens of `messages` rendered with the generation prompt) where a later
    turn of the conversation will leave it: the end of the rendered history, and the end of each of the
    last `MAX_TOOL_BOUNDARIES` tool messages of a trailing run of several. Positions lie in
    1..len(full)-1, sorted; a conversation the template cannot render in part gets fewer (never an
    error: the prompt itself rendered)."""
    cuts = [len(messages)]
    run = 0
    while run < len(messages) and messages[len(messages) - 1 - run].get("role") == "tool":
        run += 1
    if run > 1:
        cuts += [len(messages) - k for k in range(1, min(run, MAX_TOOL_BOUNDARIES + 1))]
    positions = set()
    for cut in cuts:
        try:
            history = encode(messages[:cut], False)
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation: no boundary there
            continue
        positions.add(common_prefix_length(history, full))
    return tuple(sorted(p for p in positions if 0 < p < len(full)))


def reply_continues(encode: Encode, messages: Sequence[Mapping[str, Any]], full: Sequence[int]) -> bool:
    """Whether the next turn's rendering (a reply, then another message) starts with all of `full`, the
    prompt with its generation prompt: only then can the state after prompt and reply (the turn end) be
    reused. True when the template cannot render that conversation (no claim: kept as for any prompt)."""
    try:
        after = encode([*messages, *PROBE_TURN], False)
    except Exception:  # noqa: BLE001 - a template may refuse the probe (e.g. roles must alternate): no claim
        return True
    return common_prefix_length(after, full) == len(full)


def breakpoint_positions(encode: Encode, messages: Sequence[Mapping[str, Any]], full: Sequence[int],
                         breakpoints: Sequence[Breakpoint]) -> tuple[int, ...]:
    """The exact end of each breakpoint in `full` (see the module docstring), sorted and distinct.
    Raises ValueError naming the message when the template cannot render the conversation up to it."""
    positions = set()
    for point in breakpoints:
        head = list(messages[: point.message])
        message = messages[point.message]
        try:
            if point.part is None:
                position = common_prefix_length(encode(head + [message], False), full)
            else:
                parts = list(message["content"])[: point.part + 1]
                cut = encode(head + [{**message, "content": parts}], False)
                more = encode(head + [{**message, "content": parts + [PROBE_PART]}], False)
                position = min(common_prefix_length(cut, more), common_prefix_length(cut, full))
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - the template's own error, reported as the client's problem
            where = f"messages[{point.message}]" + ("" if point.part is None else f".content[{point.part}]")
            raise ValueError(f"cache_control on {where}: the chat template cannot render the conversation "
                             f"up to there ({err}); put the breakpoint on another message") from None
        if position > 0:
            positions.add(min(position, len(full)))
    return tuple(sorted(positions))
