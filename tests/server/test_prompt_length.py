"""A prompt text that cannot fit max_model_len is refused after tokenising little more than
max_model_len tokens of it (server/prompt_length.py), and a text that fits is never refused there."""

from __future__ import annotations

import random

import pytest

from forkpoint.server.prompt_length import PIECE_CHARS, tokens_beyond


def _texts() -> dict[str, str]:
    rng = random.Random(0)
    words = ["alpha", "beta", "the", "über", "naïve", "42", "3.14", "x_y", "(a)", "don't", "—", "🙂"]
    size = 3 * PIECE_CHARS
    return {
        "words": " ".join(rng.choice(words) for _ in range(size // 5)),
        "cjk without spaces": "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(size // 2)),
        "whitespace runs": "".join(rng.choice(["a", " ", "  ", "   ", "\n", "\t", " \n "]) for _ in range(size)),
        "code": "\n".join(f"    def f{i}(self, x): return x[{i}] + {{'k': {i}}}  # note" for i in range(size // 45)),
        "one long word": "ab" * (size // 2),
        "special tokens": " ".join(rng.choice(["<|im_start|>", "<|im_end|>", "word", "<|endoftext|>"])
                                   for _ in range(size // 8)),
    }


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.llm.get_tokenizer()


@pytest.mark.parametrize("name", list(_texts()))
def test_a_text_that_fits_is_never_refused(tokenizer, name):
    text = _texts()[name]
    exact = len(tokenizer.encode(text, add_special_tokens=False))
    assert tokens_beyond(text, tokenizer, exact) is None
    assert tokens_beyond(text[:PIECE_CHARS], tokenizer, 1) is None  # one piece: left to the exact check


def test_a_huge_text_is_refused_after_its_first_pieces(tokenizer, monkeypatch):
    text = _texts()["words"] * 20  # ~4 MB
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda piece, **kw: encoded.append(len(piece)) or encode(piece, **kw))
    count = tokens_beyond(text, tokenizer, 4096)
    assert count is not None and count > 4096
    assert sum(encoded) <= 2 * PIECE_CHARS


def test_the_server_refuses_a_huge_prompt_without_tokenising_it(server, tokenizer, monkeypatch):
    text = "lorem ipsum dolor " * 60_000  # ~1 MB, far beyond max_model_len 4096
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda piece, **kw: encoded.append(len(piece)) or encode(piece, **kw))
    response = server.post("/v1/completions", json={"model": server.model, "prompt": text, "max_tokens": 1})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    response = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": text}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert max(encoded) <= PIECE_CHARS and sum(encoded) <= 4 * PIECE_CHARS


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_tokenize_refuses_a_huge_text_without_tokenising_it(server, tokenizer, monkeypatch, field):
    """/tokenize (vLLM's endpoint) of a text far beyond max_model_len: a 400 after at most two pieces
    of it were tokenised (counting 1 MB whole would hold a tokenizer thread for seconds)."""
    text = "lorem ipsum dolor " * 60_000
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda piece, **kw: encoded.append(len(piece)) or encode(piece, **kw))
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    response = server.post("/tokenize", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == field
    assert "max_model_len is 4096" in error["message"]
    assert max(encoded) <= PIECE_CHARS and sum(encoded) <= 2 * PIECE_CHARS


def test_tokenize_still_counts_a_text_of_one_piece_exactly(server, tokenizer):
    """Within one piece the count is exact, also beyond max_model_len (as vLLM's /tokenize)."""
    text = "word " * 5000
    assert len(text) <= PIECE_CHARS
    count = server.post("/tokenize", json={"prompt": text}).json()["count"]
    assert count == len(tokenizer.encode(text, add_special_tokens=False)) > 4096


def test_detokenize_takes_at_most_max_model_len_ids(server, tokenizer):
    ids = tokenizer.encode("word " * 4096, add_special_tokens=False)[:4096]
    assert server.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
    response = server.post("/detokenize", json={"tokens": ids + ids[:1]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tokens" and "4097 ids" in error["message"]
    assert "split them" in error["message"]
