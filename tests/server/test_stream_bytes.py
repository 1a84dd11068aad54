"""Streamed chunks' bytes (serving.py `_stream`, sse.py) against their construction before commit e75a60b:
each chunk's dict built whole and `json.dumps`-ed, each logprob token's text one `tokenizer.decode([id])`
at a time. Seeded random streams: content, reasoning, tool calls (auto, required, named), logprobs, n > 1,
usage, every finish reason, /v1/completions' chunks too."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from types import SimpleNamespace

import pytest

from forkpoint.outputs import CompletionOutput, Logprob, RequestOutput
from forkpoint.server.chat_format import ChatFormat, ChatOptions
from forkpoint.server.reasoning import ReasoningParser
from forkpoint.server.responses import CompletionFormat
from forkpoint.server.serving import OpenAIServing, _Usage, stream_deltas
from forkpoint.server.sse import ChunkFrame, encode_json, sse

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
PIECES = (" river", " café", " 日本語", " 🤖", ' "quoted"', " back\\slash", "\n", "\t", " \u2028", "<", "think", ">",
          "</think>", "</th", "ink>", " storm", "{", "}", "<tool_call>", "\x00", "")
CALLS = {"auto": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "required": '[{"name": "get_weather", "parameters": {"city": "Nîmes"}}]',
         "named": '{"city": "Zürich"}'}


def old_sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def old_stream(gen, fmt, header: dict, num_prompts: int, include_usage: bool):
    """serving.py's `_stream` before commit e75a60b (its error branches aside)."""
    chunk = {**header, "object": fmt.chunk_object_name}
    usage = _Usage()
    for choice in fmt.opening_chunks(num_prompts * gen.params.n):
        yield old_sse({**chunk, "choices": [choice]})
    async for delta in stream_deltas(gen, fmt, usage.last):
        yield old_sse({**chunk, "choices": [fmt.chunk_choice(delta)]})
    if include_usage:
        yield old_sse({**chunk, "choices": [], "usage": usage.as_dict()})
    gen.close()
    yield old_sse("[DONE]")


class OneAtATime:
    """The formatters' token texts before commit e75a60b: `tokenizer.decode([id])` every time."""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class OldChatFormat(OneAtATime, ChatFormat):
    pass


class OldCompletionFormat(OneAtATime, CompletionFormat):
    pass


class FakeGeneration:
    def __init__(self, outputs: list[tuple[int, RequestOutput]], n: int) -> None:
        self.params = SimpleNamespace(n=n)
        self._outputs = outputs

    async def outputs(self):
        for item in self._outputs:
            yield item

    def close(self) -> None:
        pass


def random_outputs(rng: random.Random, num_prompts: int, n: int, text_of, logprobs: bool,
                   finish: str) -> list[tuple[int, RequestOutput]]:
    """Delta outputs of `num_prompts` prompts with `n` completions each, interleaved, each prompt's last one
    finished and cumulative; `text_of(choice)`: that completion's pieces."""
    plans = {(p, i): text_of(p * n + i) for p in range(num_prompts) for i in range(n)}
    steps = max(len(pieces) for pieces in plans.values())
    made: dict[tuple[int, int], tuple[list[int], list]] = {key: ([], []) for key in plans}
    outputs = []
    for step in range(steps + 1):
        for p in range(num_prompts):
            last = step == steps
            completions = []
            for i in range(n):
                ids, lps = made[p, i]
                if last:
                    completions.append(CompletionOutput(i, "".join(plans[p, i]), list(ids), finish,
                                                        list(lps) if logprobs else None))
                    continue
                piece = plans[p, i][step] if step < len(plans[p, i]) else ""
                new_ids = [rng.randrange(100, 20000) for _ in range(rng.choice((0, 1, 1, 2)) if piece else 0)]
                new_lps = [{t: Logprob(-rng.random(), 1), **{rng.randrange(100, 20000): Logprob(-1 - rng.random(), k)
                                                            for k in range(2, 6)}} for t in new_ids]
                ids += new_ids
                lps += new_lps
                completions.append(CompletionOutput(i, piece, new_ids, None, new_lps if logprobs else None))
            outputs.append((p, RequestOutput(f"r{p}", None, [1, 2, 3], completions, num_cached_tokens=step % 3,
                                             finished=last)))
    return outputs


def collect(stream) -> list[str]:
    async def run() -> list[str]:
        return [event async for event in stream]

    return asyncio.run(run())


def seeded_uuid(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=rng.getrandbits(128), version=4))


@pytest.mark.parametrize("seed", range(24))
def test_chat_chunks_are_the_old_bytes(spare_llm, monkeypatch, seed: int) -> None:
    tokenizer = spare_llm.get_tokenizer()
    rng = random.Random(seed)
    mode = ("none", "auto", "required", "named")[seed % 4]
    n, num_prompts = rng.choice((1, 1, 3)), 1
    logprobs, usage, thinking = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    finish = rng.choice(("stop", "length"))

    def text_of(choice: int) -> list[str]:
        pieces = [rng.choice(PIECES) for _ in range(rng.randrange(0, 12))]
        if thinking and rng.random() < 0.7:
            pieces.insert(rng.randrange(len(pieces) + 1), "</think>")
        if mode != "none" and rng.random() < 0.8:
            call = CALLS[mode]
            cut = sorted(rng.sample(range(1, len(call)), 3))
            parts = [call[a:b] for a, b in zip([0, *cut], [*cut, len(call)])]
            pieces = (pieces if mode == "auto" else []) + parts
        return pieces

    outputs = random_outputs(rng, num_prompts, n, text_of, logprobs, finish)
    options = ChatOptions(tool_mode=mode, function="get_weather" if mode == "named" else None,
                          tools=(TOOL,) if mode != "none" else (), thinking=thinking, parallel=rng.random() < 0.5)
    top = rng.choice((0, 2, 5)) if logprobs else None
    header = {"id": "chatcmpl-ab\u00e9", "created": 1764950000 + seed, "model": "forkpoint/\u6a21\u578b"}
    streams = []
    for version, fmt_class, stream in (("old", OldChatFormat, old_stream), ("new", ChatFormat, OpenAIServing._stream)):
        seeded_uuid(monkeypatch, seed)
        gen = FakeGeneration(outputs, n)
        streams.append(collect(stream(None, gen, fmt_class(tokenizer, top, options), header, num_prompts, usage)
                               if version == "new" else stream(gen, fmt_class(tokenizer, top, options), header,
                                                                num_prompts, usage)))
    old, new = streams
    assert new == old
    assert len(new) >= 2 + n and new[-1] == "data: [DONE]\n\n"


@pytest.mark.parametrize("seed", range(6))
def test_completion_chunks_are_the_old_bytes(spare_llm, seed: int) -> None:
    tokenizer = spare_llm.get_tokenizer()
    rng = random.Random(100 + seed)
    n, num_prompts = rng.choice((1, 2)), rng.choice((1, 2))
    logprobs = rng.choice((None, 0, 3))
    outputs = random_outputs(rng, num_prompts, n, lambda c: [rng.choice(PIECES) for _ in range(rng.randrange(1, 9))],
                             logprobs is not None, "length")
    header = {"id": "cmpl-1", "created": 1764950000, "model": "m"}
    old = collect(old_stream(FakeGeneration(outputs, n), OldCompletionFormat(tokenizer, logprobs), header,
                             num_prompts, True))
    new = collect(OpenAIServing._stream(None, FakeGeneration(outputs, n), CompletionFormat(tokenizer, logprobs),
                                        header, num_prompts, True))
    assert new == old


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice((None, True, False))
    if kind == 1:
        return rng.randrange(-10**20, 10**20)
    if kind == 2:
        return rng.choice((Logprob(-rng.random() * 30, 1), rng.random(), float("inf"), -0.0, 1e-300))
    if kind in (3, 4):
        return "".join(rng.choice(PIECES) for _ in range(rng.randrange(4)))
    if kind in (5, 6):
        return {rng.choice(PIECES) + str(i): random_json(rng, depth + 1) for i in range(rng.randrange(4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_encode_json_is_json_dumps() -> None:
    rng = random.Random(0)
    for _ in range(500):
        value = random_json(rng)
        assert encode_json(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        assert sse(value if not isinstance(value, str) else {"v": value}) == old_sse(
            value if not isinstance(value, str) else {"v": value})


def test_chunk_frame_is_the_whole_chunk() -> None:
    frame = ChunkFrame({"id": "x\"y", "created": 1, "model": "日本"}, "chat.completion.chunk")
    choice = {"index": 0, "delta": {"content": "a\n"}, "logprobs": None, "finish_reason": None}
    whole = {"id": "x\"y", "created": 1, "model": "日本", "object": "chat.completion.chunk"}
    assert frame.event(choice) == old_sse({**whole, "choices": [choice]})
    assert frame.with_fields([], usage={"total_tokens": 3}) == old_sse({**whole, "choices": [], "usage":
                                                                         {"total_tokens": 3}})


def test_reasoning_pieces_split_as_a_whole() -> None:
    """The content state's shortcut: any split of an output reads as the whole output does."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(12)))
        thinking = rng.random() < 0.5
        parser = ReasoningParser(thinking)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 3)))
        got = [parser.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got.append(parser.finish())
        reasoning, content = ReasoningParser.split(text, thinking)
        assert "".join(d.content for d in got) == (content or "")
        assert "".join(d.reasoning for d in got) == (reasoning or "")
