"""Refusing a prompt text that cannot fit `max_model_len` before tokenising all of it.

A request body may hold megabytes of text (the body limit admits any prompt that fits, written with
the longest tokens and the worst JSON escaping: 49 MiB for 32k tokens of Qwen3.5). Tokenising 50 MB
takes ~50 CPU-seconds and GBs of memory only to answer "too long". `tokens_beyond` tokenises the text
piece by piece instead and stops as soon as the pieces hold more tokens than the limit allows:

    text     |----- piece 1 -----|----- piece 2 -----|--- ...      pieces of PIECE_CHARS, each cut
    tokens        n1                  n2                           just before a space where one is
    stop once n1 + n2 + ... > limit + CUT_SLACK x cuts             in the piece's second half

Each cut can change the count only near it (pre-tokenisers start a new word at a space, so byte-level
BPE sees the same words on both sides; a cut with no space near it splits one word), by far less than
CUT_SLACK tokens: a prompt that fits is never refused here; one that does not is refused after about
limit tokens' worth of text. Texts of at most one piece are left to the ordinary (exact) check.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

PIECE_CHARS = 1 << 16
CUT_SLACK = 8  # tokens a cut may add to the pieces' total over the whole text's


def tokens_beyond(text: str, tokenizer: PreTrainedTokenizerBase, limit: int) -> int | None:
    """The token count of a leading part of `text` once it proves `text` has more than `limit`
    tokens, else None (the text may fit: tokenise it whole). Tokenises at most about `limit` tokens
    of text plus one piece past it."""
    if len(text) <= PIECE_CHARS:
        return None
    count = cuts = start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            space = text.rfind(" ", start + PIECE_CHARS // 2, end)
            end = space if space > start else end
            cuts += 1
        count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if count > limit + CUT_SLACK * cuts:
            return count
        start = end
    return None
