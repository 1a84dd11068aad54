"""SegmentEncoder: the ids of a text built from cached turn pieces equal the tokenizer's own ids of the
whole text, on fresh random conversations rendered with the real Qwen3.5 template and on random texts
with turn openers anywhere; cuts that an added token spans are refused; unsupported tokenizers get no
cuts; the cache keeps its byte bound and its namespaces apart, under concurrent use too."""

from __future__ import annotations

import random
import threading

import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from forkpoint.inputs import LoadedTokenizer
from forkpoint.inputs.chat import render_chat
from forkpoint.inputs.segment_tokens import MAX_CUTS, SegmentEncoder, supported_openers

# pieces of text that stress the cut: partial and whole control tokens, the marker, combining marks
# (NFC composes across them), CRLF and runs of spaces/newlines (the pre-tokenizer's \s+ rules), digits
FRAGMENTS = ["river", " flood", "é", "e\u0301", "\u0301", "日本語", "🙂", "\n", "\n\n", "\r\n", "  ", " ", "'s",
             "123", "<|im_", "im_start|>", "<|im_start|>", "<|im_end|>", "<|mamba_checkpoint|>", "<think>",
             "</think>", "<tool_call>", "|>", "<", "\t", "x" * 40, "!?", "ß", "ｆｕｌｌ"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, pieces)))


def random_conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": "You are an agent. " + random_text(rng, 12)}]
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": random_text(rng, 10) or "hi"})
        if rng.random() < 0.8:
            reply = {"role": "assistant", "content": random_text(rng, 10)}
            if rng.random() < 0.4:
                reply["tool_calls"] = [{"type": "function", "function": {"name": "lookup",
                                                                          "arguments": {"q": random_text(rng, 3)}}}]
            messages.append(reply)
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "tool", "content": random_text(rng, 8)})
    return messages


def plain(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_qwen_cuts_before_im_start(qwen: LoadedTokenizer):
    assert supported_openers(qwen.tokenizer) == ("<|im_start|>",)
    encoder = SegmentEncoder(qwen.tokenizer)
    text = render_chat(qwen.tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert encoder.pieces(text) == ["<|im_start|>system\ns<|im_end|>\n", "<|im_start|>user\nu<|im_end|>\n",
                                    "<|im_start|>assistant\n"]


def test_rendered_random_conversations_tokenise_exactly(qwen: LoadedTokenizer):
    rng = random.Random(1)
    tokenizer = qwen.tokenizer
    warm = SegmentEncoder(tokenizer)  # shared by every conversation: later ones hit earlier pieces
    for _ in range(150):
        messages = random_conversation(rng)
        kwargs = {"tools": TOOLS} if rng.random() < 0.5 else {}
        thinking = rng.choice([None, True, False])
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        for end in range(1, len(messages) + 1):  # every prefix of the conversation, as the turns grow
            text = render_chat(tokenizer, messages[:end], add_generation_prompt=rng.random() < 0.7, **kwargs)
            want = plain(tokenizer, text)
            assert warm.encode(text) == want
            assert SegmentEncoder(tokenizer).encode(text) == want  # cold
    assert warm.hits > 0
    warm.check_integrity()


def test_random_texts_with_openers_anywhere_tokenise_exactly(qwen: LoadedTokenizer):
    rng = random.Random(2)
    encoder = SegmentEncoder(qwen.tokenizer, max_bytes=1 << 16)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS + ["<|im_start|>"] * 6) for _ in range(rng.randint(1, 30)))
        assert "".join(encoder.pieces(text)) == text
        assert encoder.encode(text) == plain(qwen.tokenizer, text), repr(text)
    encoder.check_integrity()


def word_tokenizer(*added: str, **flags: bool) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "a", "b", "user", "hello"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, **flags)
                                                                for t in ("<|im_start|>", *added)]})
    return tokenizer


def test_a_cut_that_an_added_token_spans_is_refused():
    tokenizer = word_tokenizer("a<|im_start|>")
    encoder = SegmentEncoder(tokenizer)
    assert encoder.openers == ("<|im_start|>",)
    text = "hello a<|im_start|>user b <|im_start|>user a"
    assert encoder.pieces(text) == ["hello a<|im_start|>user b ", "<|im_start|>user a"]
    assert encoder.encode(text) == plain(tokenizer, text)


def test_only_added_tokens_that_can_span_a_cut_are_checked(qwen: LoadedTokenizer):
    assert SegmentEncoder(qwen.tokenizer)._added == ()  # no Qwen3.5 added token has a "<" past its start
    tokenizer = word_tokenizer("b<|im", "<|im_start|>user", "|><|im_start|>", "a|>", "<|im_end|>")
    encoder = SegmentEncoder(tokenizer)
    assert set(encoder._added) == {"b<|im", "|><|im_start|>"}  # one starting at the cut does not span it
    rng = random.Random(5)
    fragments = ["a", " b", "b", "user", " ", "<|im_start|>", "<|im", "|>", "<|im_end|>", "hello"]
    for _ in range(300):  # texts where these tokens overlap the opener every way: the ids stay exact
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 20)))
        assert encoder.encode(text) == plain(tokenizer, text), repr(text)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_neighbour_dependent_added_tokens_disable_cuts(flag):
    tokenizer = word_tokenizer(**{flag: True})
    encoder = SegmentEncoder(tokenizer)
    assert encoder.openers == ()
    text = "hello <|im_start|> user a"
    assert encoder.pieces(text) == [text]
    assert encoder.encode(text) == plain(tokenizer, text)


def test_metaspace_pre_tokenizer_disables_cuts():
    tokenizer = word_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    assert supported_openers(tokenizer) == ()


def test_byte_bound_and_oversized_pieces(qwen: LoadedTokenizer):
    encoder = SegmentEncoder(qwen.tokenizer, max_bytes=4096)
    rng = random.Random(3)
    for _ in range(40):
        encoder.encode(render_chat(qwen.tokenizer, random_conversation(rng)))
        encoder.check_integrity()
        assert encoder.cached_bytes <= 4096
    huge = "<|im_start|>user\n" + "river " * 2000  # over max_bytes / 8: tokenised, never kept
    misses = encoder.misses
    assert encoder.encode(huge) == encoder.encode(huge) == plain(qwen.tokenizer, huge)
    assert encoder.misses == misses + 2
    with pytest.raises(ValueError, match="max_bytes"):
        SegmentEncoder(qwen.tokenizer, max_bytes=-1)


def test_namespaces_share_no_piece(qwen: LoadedTokenizer):
    encoder = SegmentEncoder(qwen.tokenizer)
    text = render_chat(qwen.tokenizer, [{"role": "user", "content": "a secret document"}])
    encoder.encode(text, "tenant-a")
    hits = encoder.hits
    assert encoder.encode(text, "tenant-b") == plain(qwen.tokenizer, text)
    assert encoder.hits == hits  # nothing of tenant a's was read
    encoder.encode(text, "tenant-a")
    assert encoder.hits == hits + len(encoder.pieces(text))


def test_concurrent_threads_get_exact_ids_and_keep_the_bound(qwen: LoadedTokenizer):
    encoder = SegmentEncoder(qwen.tokenizer, max_bytes=1 << 14)  # small: entries are evicted while others read
    rng = random.Random(4)
    texts = [render_chat(qwen.tokenizer, random_conversation(rng)) for _ in range(24)]
    wants = [plain(qwen.tokenizer, text) for text in texts]
    failures: list[str] = []

    def work(seed: int) -> None:
        order = random.Random(seed).sample(range(len(texts)), len(texts))
        for index in order * 2:
            if encoder.encode(texts[index], str(seed % 2)) != wants[index]:
                failures.append(f"thread {seed}, text {index}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    encoder.check_integrity()


def test_a_text_of_many_openers_is_one_piece(qwen: LoadedTokenizer):
    encoder = SegmentEncoder(qwen.tokenizer)
    many = "<|im_start|>a" * (MAX_CUTS + 1)  # a client's text: a tokenizer call per opener would be the cost
    assert encoder.pieces(many) == [many]
    assert encoder.encode(many) == plain(qwen.tokenizer, many)
    fewer = "<|im_start|>a" * MAX_CUTS
    assert len(encoder.pieces(fewer)) == MAX_CUTS
