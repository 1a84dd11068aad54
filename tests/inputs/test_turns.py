"""Turn boundaries and cache breakpoints (inputs/turns.py) with the real Qwen3.5 tokenizer and template:
the boundary is a prefix of every way the conversation can go on, and no more than a few tokens short
of what the next turn really shares."""

from __future__ import annotations

import random

import pytest

from forkpoint.inputs import LoadedTokenizer
from forkpoint.inputs.chat import chat_encoder
from forkpoint.inputs.turns import (
    Breakpoint,
    breakpoint_positions,
    common_prefix_length,
    reply_continues,
    turn_boundaries,
)

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a research agent. Cite sources. " * 8}


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5, 6], [5, 6, 7]) == 2
    assert common_prefix_length(list(range(1000)), list(range(999)) + [0]) == 999
    rng = random.Random(0)
    for _ in range(200):  # mismatches at and around chunk edges, equal lists, one a prefix of the other
        a = [rng.randrange(3) for _ in range(rng.randrange(1200))]
        cut = rng.choice([0, 255, 256, 257, 511, 512, rng.randrange(len(a) + 1)])
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(600))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == want


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": TOOLS}],
                         ids=["plain", "thinking-off", "thinking-on", "tools"])
def test_boundary_is_shared_with_the_next_turn(qwen: LoadedTokenizer, kwargs):
    """Turn k+1 (the reply sent back as text, thoughts included, then a new message) starts with the
    boundary of turn k, and shares at most a few tokens more (the assistant header)."""
    encode = chat_encoder(qwen.tokenizer, **kwargs)
    messages = [SYSTEM, {"role": "user", "content": "Find the population of Lyon."}]
    replies = ["<think>\nLet me look.\n</think>\n\nAbout 520,000 people.", "It grew 1% a year."]
    for turn, reply in enumerate(replies):
        full = encode(messages, True)
        (boundary,) = turn_boundaries(encode, messages, full)
        assert 0 < boundary < len(full)
        history = encode(messages, False)
        assert full[:boundary] == history[:boundary]
        messages = messages + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": f"And question {turn}?"}]
        following = encode(messages, True)
        shared = common_prefix_length(full, following)
        assert following[:boundary] == full[:boundary]
        assert shared - 4 <= boundary <= shared


@pytest.mark.parametrize("kwargs,continues", [({}, True), ({"enable_thinking": False}, False),
                                             ({"enable_thinking": True}, False), ({"tools": TOOLS}, True)],
                         ids=["plain", "thinking-off", "thinking-on", "tools"])
def test_reply_continues_says_whether_the_next_turn_starts_with_the_prompt(qwen: LoadedTokenizer, kwargs, continues):
    """Qwen3.5's generation prompt opens a (possibly empty) <think> block when enable_thinking is set, and the next
    turn renders the reply without it: then no next turn (a user message or a tool result after the reply)
    starts with the prompt, and a checkpoint after prompt and reply is never read."""
    encode = chat_encoder(qwen.tokenizer, **kwargs)
    messages = [SYSTEM, {"role": "user", "content": "Find the population of Lyon."}]
    full = encode(messages, True)
    assert reply_continues(encode, messages, full) is continues
    reply = qwen.tokenizer.encode("About 520,000 people.", add_special_tokens=False)
    for following in ({"role": "user", "content": "And Lille?"}, {"role": "tool", "content": "520,000"}):
        after = encode(messages + [{"role": "assistant", "content": "About 520,000 people."}, following], True)
        assert (after[: len(full) + len(reply)] == full + reply) is continues


def test_reply_continues_makes_no_claim_when_the_template_refuses(qwen: LoadedTokenizer):
    def refusing(conversation, add_generation_prompt):
        if len(conversation) > 2:
            raise ValueError("roles must alternate")
        return qwen.tokenizer.encode("x" * len(conversation), add_special_tokens=False)

    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    assert reply_continues(refusing, messages, refusing(messages, True)) is True


def test_each_tool_result_of_a_run_gets_a_boundary(qwen: LoadedTokenizer):
    encode = chat_encoder(qwen.tokenizer, tools=TOOLS, enable_thinking=False)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": f"c{i}", "function": {"name": "search", "arguments": {"q": f"q{i}"}}}
        for i in range(3)]}
    messages = [SYSTEM, {"role": "user", "content": "Compare three cities."}, call] + [
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}: " + "data " * 20} for i in range(3)]
    full = encode(messages, True)
    positions = turn_boundaries(encode, messages, full)
    assert len(positions) == 3  # after results 1 and 2, and the history's end (after result 3)
    for count, position in zip((1, 2), positions):
        fewer = encode(messages[: 3 + count], True)  # a client that had only `count` results so far
        assert fewer[:position] == full[:position]
        assert common_prefix_length(fewer, full) - 4 <= position


def test_breakpoints_end_exactly_at_the_part_and_message(qwen: LoadedTokenizer):
    tok = qwen.tokenizer
    encode = chat_encoder(tok)
    document = "The quarterly report lists revenue by region. " * 10
    messages = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": document},
                                                     {"type": "text", "text": "Summarise it."}]}]
    full = encode(messages, True)
    message_end, part_end = breakpoint_positions(encode, messages, full, [Breakpoint(1, 0), Breakpoint(0)])
    assert tok.decode(full[:message_end]).endswith("Cite sources. <|im_end|>\n")
    assert tok.decode(full[:part_end]).endswith(document.rstrip()) or tok.decode(full[:part_end]).endswith(document)
    assert part_end < len(full) and tok.decode(full[part_end:]).startswith(("\nSummarise", " \nSummarise"))


def test_a_conversation_without_generation_prompt_has_no_boundary(qwen: LoadedTokenizer):
    encode = chat_encoder(qwen.tokenizer)
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    assert turn_boundaries(encode, messages, encode(messages, False)) == ()
