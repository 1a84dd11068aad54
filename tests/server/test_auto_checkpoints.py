"""Automatic checkpoints over HTTP: a conversation's next turn reuses the previous one without any
marker, reported as cached_tokens (official openai client)."""

from __future__ import annotations

from forkpoint.server.cli import build_parser
from forkpoint.server.config import ServerConfig
from forkpoint.server.engine_args import engine_kwargs
from tests.server.conftest import serve


def _metric(running, name: str) -> float:
    return running.engine_call(lambda engine: engine.metrics()[name])


def test_second_chat_turn_reuses_the_first(auto_llm):
    with serve(auto_llm, ServerConfig(served_model_name="auto")) as running:
        hits = _metric(running, "checkpoint_hits_turn_end")
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
        assert _metric(running, "checkpoint_hits_turn_end") >= hits + 1
        running.engine_call(lambda engine: engine.check_integrity())


def test_an_exact_repeat_of_a_completion_prompt_computes_one_token(auto_llm):
    """A ~240-token text prompt sent again through /v1/completions reuses all but its last token (the prompt-end
    checkpoint), whole, streamed and with n=2, as `LLM.generate` does offline; the served outputs stay the same.
    (The servers of the other tests run with automatic checkpoints off, markers only: there a repeat reuses
    nothing, by configuration. `forkpoint serve` turns them on, as `LLM()` does.)"""
    args = build_parser().parse_args(["serve"])
    assert engine_kwargs(args)["auto_checkpoints"] is True
    text = "Quarterly summary: " + " ".join(f"line {i} reads value {i * 3 % 17};" for i in range(26))
    with serve(auto_llm, ServerConfig(served_model_name="auto")) as running:
        hits = _metric(running, "checkpoint_hits_prompt_end")
        client = running.client()
        first = client.completions.create(model="auto", prompt=text, max_tokens=4, temperature=0)
        prompt = first.usage.prompt_tokens
        assert 230 <= prompt <= 250 and first.usage.prompt_tokens_details.cached_tokens == 0
        again = client.completions.create(model="auto", prompt=text, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
        assert again.usage.prompt_tokens_details.model_extra["cache_miss_reason"] is None
        assert again.choices[0].text == first.choices[0].text
        stream = client.completions.create(model="auto", prompt=text, max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
        assert [c.usage.prompt_tokens_details.cached_tokens for c in chunks if c.usage] == [prompt - 1]
        two = client.completions.create(model="auto", prompt=text, max_tokens=4, temperature=0, n=2)
        assert two.usage.prompt_tokens == prompt and two.usage.prompt_tokens_details.cached_tokens == prompt - 1
        assert [c.text for c in two.choices] == [first.choices[0].text] * 2
        assert _metric(running, "checkpoint_hits_prompt_end") >= hits + 3
        running.engine_call(lambda engine: engine.check_integrity())
