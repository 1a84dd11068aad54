"""Incremental detokenization equals a full decode, at every step and at the end, with work
linear in the number of tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.inputs.detokenizer import IncrementalDetokenizer, window_decoder

TEXTS = ["Hello, world! ", "naïve café ", "日本語のテキスト", "emoji 🤖🧪 and 👩‍👩‍👧", " tabs\tand\nnewlines ",
         "Ελληνικά ", "ﷺ ", "<|im_end|>", "  spaces  "]


@pytest.fixture(scope="module")
def pieces(qwen) -> dict[str, list[int]]:
    tokenizer = qwen.tokenizer
    # ids that decode to part of a character: the single-byte tokens of a multi-byte character
    partial = [i for i in tokenizer.encode("🤖", add_special_tokens=False)]
    return {"text": [i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)],
            "partial": partial,
            "special": [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>"),
                        qwen.checkpoint_token_id]}


def check(tokenizer, ids: list[int], chunks: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    done = 0
    streamed = ""
    for size in chunks + [len(ids)]:
        step = ids[done:done + size]
        done += len(step)
        streamed += detok.add(step)
        expected = tokenizer.decode(ids[:done], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert detok.text == expected.rstrip("\ufffd"), ids[:done]
        assert streamed == detok.text
        assert detok.num_tokens == done
        if done == len(ids):
            break
    assert detok.final_text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_equals_a_full_decode_on_random_sequences(qwen, pieces, data):
    vocab = len(qwen.tokenizer)
    parts = st.one_of(st.sampled_from(pieces["text"]), st.sampled_from(pieces["partial"]),
                      st.sampled_from(pieces["special"]), st.integers(0, vocab - 1))
    ids = data.draw(st.lists(parts, min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    check(qwen.tokenizer, ids, chunks)


def test_a_character_split_over_tokens_waits_for_its_last_byte(qwen, pieces):
    detok = IncrementalDetokenizer(qwen.tokenizer)
    ids = pieces["partial"]
    assert len(ids) > 1  # the emoji is several byte tokens
    for token in ids[:-1]:
        assert detok.add([token]) == ""
        assert detok.text == "" and detok.final_text.endswith("\ufffd")
    assert detok.add(ids[-1:]) == "🤖"


def test_word_level_tokenizer_and_skipped_special_tokens(tiny_model_factory):
    from forkpoint.inputs.tokenizer import load_tokenizer

    directory, _ = tiny_model_factory("qwen3_5_moe_text")
    tokenizer = load_tokenizer(directory, checkpoint_token=None).tokenizer
    words = tokenizer.encode("w1 w2 w3 w4", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ids = [words[0], eos, words[1], words[2], eos, eos, words[3]]
    for chunks in ([1] * 7, [2, 3, 2], [7]):
        check(tokenizer, ids, chunks)


def test_work_is_linear_in_the_tokens(qwen):
    tokenizer = qwen.tokenizer
    ids = tokenizer.encode(" ".join(TEXTS) * 60, add_special_tokens=False)
    decoded = []

    class Counting:
        def decode(self, window, **kwargs):
            decoded.append(len(window))
            return tokenizer.decode(window, **kwargs)

    detok = IncrementalDetokenizer(Counting())
    for token in ids:
        detok.add([token])
    assert len(ids) > 1000
    assert sum(decoded) < 8 * len(ids)  # a full decode per token would be ~len(ids)**2 / 2
    assert detok.final_text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_windows_decode_through_the_rust_tokenizer_exactly_as_decode(qwen, pieces):
    """The Qwen tokenizer's decode is the Rust tokenizer's: the windows skip the Python wrapper and give
    the same text for random ids (special tokens, split characters) with and without skipping specials;
    a tokenizer class that overrides its decode keeps going through it."""
    tokenizer = qwen.tokenizer
    rng = random.Random(3)
    pool = pieces["text"] + pieces["partial"] + pieces["special"] + [rng.randrange(len(tokenizer)) for _ in range(64)]
    for skip in (True, False):
        decode = window_decoder(tokenizer, skip)
        assert "backend" in decode.__code__.co_freevars
        for length in (1, 2, 5, 17):
            ids = [rng.choice(pool) for _ in range(length)]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    tokenizer.__class__, original = Shouting, type(tokenizer)
    try:
        assert window_decoder(tokenizer, True)(pieces["text"][:8]) == tokenizer.decode(pieces["text"][:8],
                                                                                     skip_special_tokens=True).upper()
    finally:
        tokenizer.__class__ = original


def vllm_fast_text(tokenizer, ids: list[int]) -> str:
    """vLLM's fast-tokenizer text with special tokens kept and spaces_between_special_tokens=False, by full
    decodes: each token adds what it adds to the decode of the tokens before it, except an added token right
    after another added token, which adds its bare content."""
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    text = ""
    for n, token in enumerate(ids):
        if token in added and n and ids[n - 1] in added:
            text += added[token]
        else:
            before = tokenizer.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            text += tokenizer.decode(ids[: n + 1], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)[len(before):]
    return text


def streamed(tokenizer, ids: list[int], chunks: list[int], **kwargs) -> tuple[str, IncrementalDetokenizer]:
    detok, done, text = IncrementalDetokenizer(tokenizer, **kwargs), 0, ""
    for size in chunks:
        text += detok.add(ids[done:done + size])
        done += size
    text += detok.add(ids[done:])
    return text, detok


def test_spaces_between_special_tokens_as_vllm_fast_path(tiny_model_factory):
    """A word-level decoder puts a space between every two tokens; with special tokens kept and
    spaces_between_special_tokens=False, an added token after another added token comes without it (vLLM's
    FastIncrementalDetokenizer), in any chunking; with True, or with special tokens skipped, the text is the
    full decode."""
    from forkpoint.inputs.tokenizer import load_tokenizer

    directory, _ = tiny_model_factory("qwen3_5_moe_text")
    tokenizer = load_tokenizer(directory, checkpoint_token="<|mamba_checkpoint|>").tokenizer
    words = tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    specials = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")]
    ids = [words[0], specials[0], specials[1], words[1], specials[1], specials[1], specials[0], words[2]]
    expected = "w1 <|im_end|><|im_start|> w2 <|im_start|><|im_start|><|im_end|> w3"
    assert vllm_fast_text(tokenizer, ids) == expected
    rng = random.Random(5)
    for chunks in ([1] * len(ids), [2, 3, 1], [len(ids)], [3, 4]):
        text, detok = streamed(tokenizer, ids, chunks, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert text == detok.final_text == expected, chunks
        text, _ = streamed(tokenizer, ids, chunks, skip_special_tokens=False)
        assert text == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text, _ = streamed(tokenizer, ids, chunks, spaces_between_special_tokens=False)  # skipped: no effect
        assert text == "w1 w2 w3"
    for _ in range(30):
        ids = [rng.choice(words + specials) for _ in range(rng.randrange(1, 20))]
        chunks = [rng.randrange(1, 4) for _ in range(10)]
        text, detok = streamed(tokenizer, ids, chunks, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert text == detok.final_text == vllm_fast_text(tokenizer, ids), ids


def test_spaces_between_special_tokens_change_nothing_for_a_byte_level_decoder(qwen, pieces):
    """Qwen's byte-level decoder puts nothing between tokens: the text is the full decode either way."""
    rng = random.Random(8)
    pool = pieces["text"] + pieces["partial"] + pieces["special"] * 8
    for _ in range(20):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 30))]
        text, detok = streamed(qwen.tokenizer, ids, [rng.randrange(1, 4) for _ in range(12)],
                               skip_special_tokens=False, spaces_between_special_tokens=False)
        assert detok.final_text == qwen.tokenizer.decode(ids, skip_special_tokens=False,
                                                         clean_up_tokenization_spaces=False), ids
        assert text == detok.text


def test_a_python_tokenizer_gets_the_spaces_flag_in_its_decode(qwen):
    """Without a Rust backend, the windows go through the tokenizer's own decode, which is told the flag."""
    seen = []

    class Python:
        def decode(self, window, **kwargs):
            seen.append(kwargs["spaces_between_special_tokens"])
            return qwen.tokenizer.decode(window, **kwargs)

    ids = qwen.tokenizer.encode("hello there", add_special_tokens=False)
    for flag in (False, True):
        detok = IncrementalDetokenizer(Python(), skip_special_tokens=False, spaces_between_special_tokens=flag)
        detok.add(ids)
        assert detok.text == "hello there" and set(seen) == {flag}
        seen.clear()


def test_a_long_text_is_read_whole_or_by_its_tail(qwen, pieces):
    """Past FOLD_PIECES committed pieces the text is kept as one string plus recent pieces: `text`,
    `text_length`, `final_text` and `tail(start)` (from inside the folded string, the recent pieces or an
    incomplete character) stay those of a full decode."""
    from forkpoint.inputs.detokenizer import FOLD_PIECES

    tokenizer = qwen.tokenizer
    ids = (pieces["text"] + pieces["partial"]) * 6
    assert len(ids) > 3 * FOLD_PIECES
    detok = IncrementalDetokenizer(tokenizer)
    for done in range(1, len(ids) + 1):
        streamed = detok.add(ids[done - 1:done])
        full = tokenizer.decode(ids[:done], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        text = full.rstrip("\ufffd")
        assert detok.text == text and detok.text_length == len(text) and detok.final_text == full
        assert text.endswith(streamed)
        for start in (0, len(text) // 3, max(0, len(text) - 5), len(text)):
            assert detok.tail(start) == text[start:], (done, start)
