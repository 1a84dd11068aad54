"""PromptBuilder with the segment cache (the server's default) builds the same chat prompts as without
it: token ids, checkpoint positions (markers, "checkpoint": true parts, cache_control breakpoints), turn
boundaries and turn-end reuse, on random agent conversations with the real Qwen3.5 tokenizer and
template, thinking on, off and unset, with and without tools, salted and not."""

from __future__ import annotations

import random

import pytest

from forkpoint.inputs import ensure_default_model, load_tokenizer
from forkpoint.inputs.segment_tokens import SegmentEncoder
from forkpoint.server.config import MarkerPolicy
from forkpoint.server.errors import APIError
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.protocol import ChatCompletionRequest
from forkpoint.server.request_params import template_kwargs

MARKER = "<|mamba_checkpoint|>"
WORDS = ["river", " flood", "gauge", "é", "\n", "  ", "<|im_", "<|im_start|>", MARKER, "日本", "42", "</think>"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model(), checkpoint_token=MARKER)


def builders(loaded) -> tuple[PromptBuilder, PromptBuilder]:
    common = {"checkpoint_token": MARKER, "checkpoint_token_id": loaded.checkpoint_token_id, "max_checkpoints": 16,
              "policy": MarkerPolicy.ALLOW, "turn_boundaries": True, "max_model_len": 1 << 20}
    return (PromptBuilder(loaded.tokenizer, **common),
            PromptBuilder(loaded.tokenizer, **common, segments=SegmentEncoder(loaded.tokenizer, 1 << 16)))


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def message(rng: random.Random, role: str) -> dict:
    if role != "tool" and rng.random() < 0.3:  # content parts, some with checkpoints and breakpoints
        parts = []
        for _ in range(rng.randint(1, 2)):
            part = {"type": "text", "text": text(rng, 6), "checkpoint": rng.random() < 0.3}
            if rng.random() < 0.15:
                part["cache_control"] = {"type": "ephemeral"}
            parts.append(part)
        return {"role": role, "content": parts}
    result = {"role": role, "content": text(rng, 8)}
    if rng.random() < 0.1:
        result["cache_control"] = {"type": "ephemeral"}
    return result


def agent_session(rng: random.Random, turns: int) -> list[list[dict]]:
    """The requests of one agent session: system, document, then per turn (reply, tool results)."""
    messages = [{"role": "system", "content": "You are an agent. " + text(rng, 10)}, message(rng, "user")]
    requests = [list(messages)]
    for turn in range(turns):
        reply = {"role": "assistant", "content": text(rng, 6)}
        if rng.random() < 0.5:
            reply["tool_calls"] = [{"id": f"c{turn}", "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]
        messages += [reply] + [message(rng, "tool") for _ in range(rng.randint(1, 3))]
        requests.append(list(messages))
    return requests


def test_segment_cache_builds_the_same_prompts(tokenizer):
    rng = random.Random(0)
    plain, cached = builders(tokenizer)
    checked = 0
    for session in range(12):
        kwargs = {} if session % 3 == 0 else {"enable_thinking": session % 3 == 1}
        tools = {"tools": TOOLS} if session % 2 else {}
        salt = "tenant" if session % 4 == 3 else None
        for messages in agent_session(rng, 4):
            body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                         "chat_template_kwargs": kwargs, **tools})
            built = [builder.from_messages(body.messages, template_kwargs=template_kwargs(body), cache_salt=salt)
                     for builder in (plain, cached)]
            assert built[0] == built[1]
            assert built[0].turn_positions  # the boundaries were computed (and compared)
            checked += 1
    assert checked == 12 * 5
    assert cached.segments.hits > 0
    cached.segments.check_integrity()


def test_the_server_builds_prompts_with_the_segment_cache(server):
    segments = server.app.state.prompts.segments
    assert isinstance(segments, SegmentEncoder) and segments.openers == ("<|im_start|>",)
    misses = segments.misses
    messages = [{"role": "system", "content": "A system prompt that two requests share."},
                {"role": "user", "content": "first question"}]
    first = server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    hits = segments.hits
    messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second question"}]
    second = server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert segments.misses > misses and segments.hits >= hits + 2  # the system and first user turns were reused
    assert second[: len(first) - 3] == first[:-3]  # all but the assistant header
    tokenizer = server.llm.get_tokenizer()
    assert second == tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True),
                                      add_special_tokens=False)


def test_one_pass_rendering_builds_the_prompts_of_transformers_own(tokenizer, monkeypatch):
    """The prompt and its history from one pass of the template (`inputs/template_render.py`, no copies) build
    the same prompts (ids, markers, breakpoints, turn boundaries, turn-end reuse) as transformers'
    `apply_chat_template` rendering each conversation on its own, tokenised whole."""
    from forkpoint.inputs import chat
    from forkpoint.inputs.template_render import split_template

    assert split_template(tokenizer.tokenizer.chat_template) is not None  # the default template takes one pass
    rng = random.Random(1)
    requests = []
    for session in range(12):
        kwargs = {} if session % 3 == 0 else {"enable_thinking": session % 3 == 1}
        tools = {"tools": TOOLS} if session % 2 else {}
        requests += [ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                           "chat_template_kwargs": kwargs, **tools})
                     for messages in agent_session(rng, 4)]

    def build(builder: PromptBuilder, body: ChatCompletionRequest):
        try:
            return builder.from_messages(body.messages, template_kwargs=template_kwargs(body))
        except APIError as err:  # random markers may sit twice at one position: the same 400 either way
            return err.message

    fast = builders(tokenizer)[1]
    built = [build(fast, body) for body in requests]

    def library(tok, conversation, *, chat_template, add_generation_prompt, **kwargs):
        return tok.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kwargs)

    monkeypatch.setattr(chat, "render_template", library)
    monkeypatch.setattr(chat, "render_template_and_history", lambda tok, conversation, **kwargs: (
        library(tok, conversation, add_generation_prompt=True, **kwargs), None))
    reference = builders(tokenizer)[0]
    for body, prompt in zip(requests, built, strict=True):
        assert build(reference, body) == prompt
    assert sum(1 for prompt in built if not isinstance(prompt, str) and prompt.turn_positions) > 0.8 * len(built)
