"""Chat rendering: the default ChatML template, content parts, markers surviving rendering."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forkpoint.inputs import LoadedTokenizer, prompt_to_token_ids, render_chat, strip_checkpoint_markers

MARKER = "<|mamba_checkpoint|>"  # the default checkpoint_token


def test_chatml_rendering(qwen: LoadedTokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert render_chat(qwen.tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(qwen.tokenizer, messages, add_generation_prompt=False).endswith("Hi!<|im_end|>\n")


def test_text_parts_are_joined_like_the_template_does(qwen: LoadedTokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    rendered = render_chat(qwen.tokenizer, [{"role": "user", "content": parts}])
    assert rendered == "<|im_start|>user\nfirst\nsecond<|im_end|>\n<|im_start|>assistant\n"
    # The template itself accepts list content and joins the same way.
    direct = qwen.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    assert direct == rendered


def test_markers_in_messages_survive_and_parse(qwen: LoadedTokenizer):
    tok = qwen.tokenizer
    messages = [
        {"role": "system", "content": f"You are a careful judge.{MARKER}"},
        {"role": "user", "content": [
            {"type": "text", "text": f"Document: a long listing.{MARKER}"},
            {"type": "text", "text": "Question: same product?"},
        ]},
    ]
    rendered = render_chat(tok, messages)
    assert rendered.count(MARKER) == 2

    raw = prompt_to_token_ids(rendered, tok)
    parsed = strip_checkpoint_markers(raw.token_ids, qwen.checkpoint_token_id, raw.checkpoint_positions, 4)

    first, second, _ = rendered.split(MARKER)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert parsed.checkpoint_positions == (len(enc(first)), len(enc(first + second)))
    assert parsed.token_ids == enc(rendered.replace(MARKER, ""))
    assert parsed.token_ids[: parsed.checkpoint_positions[0]] == enc("<|im_start|>system\nYou are a careful judge.")


def test_explicit_template_and_template_kwargs(tiny_tokenizer_dir: Path):
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    template = "{{ greeting }}{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    rendered = render_chat(tok, [{"role": "user", "content": "hello"}], chat_template=template, greeting=">")
    assert rendered == ">[user:hello]"


def test_no_chat_template(tiny_tokenizer_dir: Path):
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    with pytest.raises(ValueError, match="the tokenizer has no chat template: pass chat_template="):
        render_chat(tok, [{"role": "user", "content": "hello"}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "messages must be a list of message dicts, not str"),
        ({"role": "user", "content": "x"}, "messages must be a list of message dicts, not dict"),
        ([], "messages is empty"),
        (["hello"], r"messages\[0\] must be a dict with 'role' and 'content', not str"),
        ([{"content": "x"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "", "content": "x"}], r"messages\[0\]\['role'\] must be a non-empty str"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a str or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
         r"messages\[0\]\['content'\]\[0\] is not a text part \('image_url'\)"),
        ([{"role": "user", "content": ["text"]}], r"messages\[0\]\['content'\]\[0\] is not a text part"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
         r"messages\[0\]\['content'\]\[0\]\['text'\] must be a str"),
    ],
)
def test_malformed_messages(qwen: LoadedTokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        render_chat(qwen.tokenizer, messages)
