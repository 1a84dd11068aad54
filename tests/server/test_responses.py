"""CompletionFormat: echo with prompt logprobs in OpenAI's layout, max_tokens 0, streamed echo,
vLLM's prompt_logprobs field (synthetic engine outputs, the default model's tokenizer)."""

from __future__ import annotations

import pytest

from forkpoint.inputs.default_model import ensure_default_model
from forkpoint.inputs.tokenizer import load_tokenizer
from forkpoint.outputs import CompletionOutput, Logprob, RequestOutput
from forkpoint.server.responses import CompletionFormat, Delta, token_texts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model(), checkpoint_token=None).tokenizer


def output(tokenizer, prompt: str, generated: list[int]) -> RequestOutput:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    entries = [None] + [{t: Logprob(-0.5 * i, 3), 7: Logprob(-0.1, 1)} for i, t in enumerate(ids[1:], 1)]
    completion = CompletionOutput(0, tokenizer.decode(generated), generated, "length",
                                  [{t: Logprob(-1.0, 2)} for t in generated])
    out = RequestOutput("r", prompt, ids, [completion], finished=True)
    out.prompt_logprobs = entries  # RequestOutput.prompt_logprobs (DESIGN.md section 2)
    return out


def test_echo_with_logprobs(tokenizer):
    out = output(tokenizer, "The capital of France", [11, 12])
    fmt = CompletionFormat(tokenizer, 1, echo=True)
    c = out.outputs[0]
    choice = fmt.choice(Delta(0, c.text, c.token_ids, c.logprobs, c.finish_reason, output=out))
    prompt_text = tokenizer.decode(out.prompt_token_ids)
    assert choice["text"] == prompt_text + c.text
    lp = choice["logprobs"]
    n = len(out.prompt_token_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [-0.5 * i for i in range(1, n)]
    assert all(top == {tokenizer.decode([7]): -0.1} for top in lp["top_logprobs"][1:n])  # the top 1
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 2)]
    assert lp["token_logprobs"][n:] == [-1.0, -1.0]


def test_max_tokens_zero_drops_the_sampled_token(tokenizer):
    fmt = CompletionFormat(tokenizer, 0, echo=True, drop_output=True)
    out = fmt.transform(output(tokenizer, "Hello world", [11]))
    c = out.outputs[0]
    assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    choice = fmt.choice(Delta(0, c.text, c.token_ids, c.logprobs, c.finish_reason, output=out))
    assert choice["text"] == tokenizer.decode(out.prompt_token_ids)
    assert len(choice["logprobs"]["tokens"]) == len(out.prompt_token_ids)


def test_streamed_echo_comes_once_and_offsets_continue(tokenizer):
    out = output(tokenizer, "Hello world", [11, 12])
    fmt = CompletionFormat(tokenizer, 0, echo=True)
    c = out.outputs[0]
    first_text = tokenizer.decode([11])
    first = fmt.chunk_choice(Delta(0, first_text, [11], c.logprobs[:1], None, text_offset=0, output=out))
    second = fmt.chunk_choice(Delta(0, c.text[len(first_text):], [12], c.logprobs[1:], "length",
                                    text_offset=len(first_text), output=out))
    prompt_text = tokenizer.decode(out.prompt_token_ids)
    assert first["text"] == prompt_text + first_text and second["text"] == c.text[len(first_text):]
    assert second["logprobs"]["text_offset"] == [len(prompt_text) + len(first_text)]


def test_prompt_logprobs_field(tokenizer):
    out = output(tokenizer, "Hello world", [11])
    fmt = CompletionFormat(tokenizer, None, prompt_logprobs=1)
    c = out.outputs[0]
    choice = fmt.choice(Delta(0, c.text, c.token_ids, c.logprobs, c.finish_reason, output=out))
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(out.prompt_token_ids)
    token = out.prompt_token_ids[1]
    assert entries[1][str(token)] == {"logprob": -0.5, "rank": 3, "decoded_token": tokenizer.decode([token])}


def test_token_texts_are_the_one_by_one_decodes(tokenizer):
    """One batch through the Rust tokenizer gives each id's `decode([id])`: byte pieces, spaces, special
    tokens, the last ids of the vocabulary, repeats."""
    ids = [0, 11, 12, 220, 198, 1000, 151643, len(tokenizer) - 1, 11] + list(range(90000, 90400, 7))
    ids += tokenizer.encode(" héllo wörld 你好 🙂\n\t  x", add_special_tokens=False)
    texts = token_texts(tokenizer, ids)
    assert texts == {t: tokenizer.decode([t]) for t in ids}
