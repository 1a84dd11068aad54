"""Automatic checkpoints over HTTP: a conversation's next turn reuses the previous one without any
marker, reported as cached_tokens (official openai client)."""

from __future__ import annotations

from forkpoint import LLM
from forkpoint.server.config import ServerConfig
from tests.server.conftest import TEST_LLM_KWARGS, serve


def test_second_chat_turn_reuses_the_first():
    llm = LLM(**{**TEST_LLM_KWARGS, "auto_checkpoints": True})
    with serve(llm, ServerConfig(served_model_name="auto")) as running:
        client = running.client()
        messages = [{"role": "system", "content": "You answer questions about the weather. " * 6},
                    {"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model="auto", messages=messages, max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And tomorrow?"}]
        second = client.chat.completions.create(model="auto", messages=messages, max_tokens=6, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # at least the whole first prompt (the turn-end checkpoint also covers the reply when the
        # template renders it back to the same tokens)
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        assert running.engine_call(lambda engine: engine.metrics()["checkpoint_hits_turn_end"]) >= 1
        running.engine_call(lambda engine: engine.check_integrity())
