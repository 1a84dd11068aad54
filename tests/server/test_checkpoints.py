"""Checkpoint controls over HTTP: the marker string, the structured forms, and reuse reported as
usage.prompt_tokens_details.cached_tokens (the consumer's = the anchor's token count)."""

from __future__ import annotations

import asyncio

from tests.server.conftest import MARKER


def _anchor_len(server, text: str) -> int:
    return server.post("/tokenize", json={"prompt": text}).json()["count"]


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_marker_in_completion_prompt(server, anchor_text):
    anchor = anchor_text("completion-marker")
    client = server.client()
    producer = client.completions.create(model=server.model, prompt=anchor + MARKER + " Q1?", max_tokens=1)
    consumer = client.completions.create(model=server.model, prompt=anchor + MARKER + " Another question?",
                                         max_tokens=1)
    assert _cached(producer.usage) == 0
    assert _cached(consumer.usage) == _anchor_len(server, anchor)
    # the marker is not a prompt token
    assert producer.usage.prompt_tokens == _anchor_len(server, anchor + " Q1?")


def test_marker_in_chat_message(server, anchor_text):
    anchor = anchor_text("chat-marker")
    client = server.client()

    def ask(question: str):
        return client.chat.completions.create(model=server.model, max_tokens=1, messages=[
            {"role": "system", "content": anchor + MARKER}, {"role": "user", "content": question}])

    assert _cached(ask("first?").usage) == 0
    prefix = server.post("/tokenize", json={"messages": [{"role": "system", "content": anchor + MARKER},
                                                         {"role": "user", "content": "x"}]}).json()
    consumer = ask("a different second question?")
    assert _cached(consumer.usage) == prefix["checkpoint_positions"][0] > _anchor_len(server, anchor)


def test_structured_content_part_flag(server, anchor_text):
    anchor = anchor_text("part-flag")
    client = server.client()

    def ask(question: str):
        content = [{"type": "text", "text": anchor, "checkpoint": True}, {"type": "text", "text": question}]
        return client.chat.completions.create(model=server.model, max_tokens=1,
                                              messages=[{"role": "user", "content": content}])

    marked = [{"role": "user", "content": [{"type": "text", "text": anchor, "checkpoint": True},
                                           {"type": "text", "text": "q"}]}]
    positions = server.post("/tokenize", json={"messages": marked}).json()["checkpoint_positions"]
    assert len(positions) == 1
    assert _cached(ask("question one").usage) == 0
    assert _cached(ask("question two, longer").usage) == positions[0]


def test_checkpoint_positions_with_token_prompt(server, anchor_text):
    ids = server.post("/tokenize", json={"prompt": anchor_text("token-ids")}).json()["tokens"]
    suffixes = server.post("/tokenize", json={"prompt": " one two three four"}).json()["tokens"]
    client = server.client()
    first = client.completions.create(model=server.model, prompt=ids + suffixes[:2], max_tokens=1,
                                      extra_body={"checkpoint_positions": [len(ids)]})
    second = client.completions.create(model=server.model, prompt=ids + suffixes[2:], max_tokens=1,
                                       extra_body={"checkpoint_positions": [len(ids)]})
    assert (_cached(first.usage), _cached(second.usage)) == (0, len(ids))
    # a later prompt with the same prefix reuses the checkpoint without asking for it
    third = client.completions.create(model=server.model, prompt=ids + suffixes, max_tokens=1)
    assert _cached(third.usage) == len(ids)


def test_batch_of_token_prompts_shares_one_checkpoint(server, anchor_text):
    ids = server.post("/tokenize", json={"prompt": anchor_text("batch")}).json()["tokens"]
    prompts = [ids + [1000 + i, 2000 + i] for i in range(4)]
    out = server.client().completions.create(model=server.model, prompt=prompts, max_tokens=1,
                                             extra_body={"checkpoint_positions": [len(ids)]})
    assert len(out.choices) == 4
    assert _cached(out.usage) == 3 * len(ids)


def test_many_concurrent_one_to_n(server, anchor_text):
    """33 concurrent streaming requests on one anchor: one producer, 32 consumers, all reuse."""
    anchor = anchor_text("concurrent")
    anchor_len = _anchor_len(server, anchor)
    before = server.metric("forkpoint_checkpoints_created_total")

    async def run():
        async with server.async_client() as client:
            async def one(i: int):
                stream = await client.completions.create(
                    model=server.model, prompt=f"{anchor}{MARKER} candidate {i}: same?", max_tokens=2,
                    stream=True, stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
                return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
            return await asyncio.gather(*(one(i) for i in range(33)))

    results = asyncio.run(run())
    cached = sorted(_cached(usage) for _, usage in results)
    assert cached == [0] + [anchor_len] * 32
    assert all(usage.completion_tokens == 2 for _, usage in results)
    assert server.metric("forkpoint_checkpoints_created_total") == before + 1
    server.wait_idle()
    server.engine_call(lambda engine: engine.check_integrity())
