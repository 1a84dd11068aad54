"""Incremental detokenization: the text of a growing token sequence, decoding only a small window
of new tokens per step (vLLM's look-back approach), so host work stays linear in the output.

Two offsets into the token ids, as in vLLM:

    ids:     ... | prefix_offset ... read_offset | new tokens ...
                   '---- look-back window ----'
    prefix_text = decode(ids[prefix_offset:read_offset])
    full        = decode(ids[prefix_offset:])
    new text    = full[len(prefix_text):]

Decoding from the same start on both sides makes context-dependent decoders (a leading space
dropped at a window's start, bytes of one character spread over several tokens) agree; the
difference is the text the new tokens add. While `full` ends in U+FFFD (a character whose
remaining bytes are still to come), the window is kept and nothing is committed; `text` then shows
the part before the incomplete character, and `final_text` includes the replacement characters,
as a full decode does.

The windows are decoded by the Rust tokenizer itself when the tokenizer's `decode` (spaces not cleaned
up) is exactly that call (a `TokenizersBackend` that overrides neither `decode` nor `_decode`): the
Python wrapper around it cost about half of each token's work (256 streams: 1.76 against 0.85 ms of
every decode step on a 2-core CPU, measured side by side by bench/output_path_cost.py).

`spaces_between_special_tokens`, as vLLM does it (vllm/v1/engine/detokenizer.py): the Rust
tokenizer's decode has no such option, and transformers 5's `decode` does not take it either; the text
is whatever the decoder puts between tokens (Qwen's byte-level decoder: nothing; a word-level one
without a decoder: a space). vLLM's detokenizer for fast tokenizers (`FastIncrementalDetokenizer`)
does the same when the flag is True, and when it is False with special tokens kept, gives an added
token that follows another added token as its bare content, without what the decoder put before it:
"w1 <|im_end|><|im_start|> w2" where the decoder makes "w1 <|im_end|> <|im_start|> w2". Tokenizers
without a Rust backend get the flag in their `decode` call (vLLM's slow path puts spaces around added
tokens itself; transformers 5's Python tokenizers ignore the flag).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT = "\ufffd"
FOLD_PIECES = 64  # committed pieces kept apart before they are joined into one string (IncrementalDetokenizer)


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, equal to ``tokenizer.decode(ids,
    skip_special_tokens=...)`` of all of them (without cleaning up tokenisation spaces, as vLLM), but
    for vLLM's rule for `spaces_between_special_tokens=False` (module docstring).

    Each `add` decodes two windows of a few tokens. A window only grows past the tokens just added
    while its text ends in an incomplete character or the new tokens decode to nothing (special
    tokens that are skipped).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_ids = window_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # added token id -> its content, when an added token after another one is its bare content
        self._bare_added = ({} if skip_special_tokens or spaces_between_special_tokens
                            or not isinstance(tokenizer, TokenizersBackend) else added_token_texts(tokenizer))
        self._last_added = False  # the last token added is an added token (only with _bare_added)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # text of ids[:read_offset] = _older + "".join(_recent): appending a piece to one string would copy
        # the whole text every token (the string is shared with outputs, so never extended in place); the
        # recent pieces are folded into _older every FOLD_PIECES pieces, so each character is copied
        # about len / FOLD_PIECES times in all, and `tail` reads the end without joining the rest
        self._older = ""
        self._recent: list[str] = []
        self._recent_len = 0
        self._pending = ""  # text the tokens past read_offset add so far (may end incomplete)

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return len(self._ids)

    @property
    def text(self) -> str:
        """The text so far, without a trailing incomplete character (O(length): a new string)."""
        return self._older + "".join(self._recent) + self._pending.rstrip(REPLACEMENT)

    @property
    def final_text(self) -> str:
        """The text of every token, replacement characters of an incomplete tail included."""
        return self._older + "".join(self._recent) + self._pending

    @property
    def text_length(self) -> int:
        """len(text), without building it."""
        return len(self._older) + self._recent_len + len(self._pending.rstrip(REPLACEMENT))

    def tail(self, start: int) -> str:
        """text[start:], in time in proportion to its length and the number of recent pieces (not to the
        text's length)."""
        pending = self._pending.rstrip(REPLACEMENT)
        skip = start - len(self._older)
        if skip < 0:
            return self._older[start:] + "".join(self._recent) + pending
        parts = [pending[max(0, skip - self._recent_len):]]
        position = self._recent_len  # where the piece below ends
        for piece in reversed(self._recent):
            if position <= skip:
                break
            position -= len(piece)
            parts.append(piece[max(0, skip - position):])
        return "".join(reversed(parts))

    def add(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; returns the text they completed (possibly empty)."""
        if not token_ids:
            return ""
        before = self.text_length
        start = 0
        if self._bare_added:
            for i, token in enumerate(token_ids):
                content = self._bare_added.get(token)
                if content is not None and self._last_added:
                    self._extend(token_ids[start:i])
                    self._append_bare(token, content)
                    start = i + 1
                self._last_added = content is not None
        self._extend(token_ids[start:])
        return self.tail(before)

    def _commit(self, text: str) -> None:
        if not text:
            return
        self._recent.append(text)
        self._recent_len += len(text)
        if len(self._recent) >= FOLD_PIECES:
            self._older += "".join(self._recent)
            self._recent.clear()
            self._recent_len = 0

    def _extend(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        new_text = full[len(prefix_text):]
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            self._commit(new_text)
            self._pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        else:
            self._pending = new_text

    def _append_bare(self, token_id: int, content: str) -> None:
        """Append an added token whose text is `content` as it is; the next window starts before it, so
        the tokens after it decode in its context."""
        self._ids.append(token_id)
        self._commit(self._pending + content)
        self._pending = ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids) if ids else ""


def added_token_texts(tokenizer: TokenizersBackend) -> dict[int, str]:
    """Added token id -> its content (special or not), from the Rust tokenizer, as vLLM reads them."""
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return {token_id: token.content for token_id, token in added.items()}


def window_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                   spaces_between_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...,
    clean_up_tokenization_spaces=False)`, through the Rust tokenizer directly when that is all the
    tokenizer's decode does (see the module docstring; the Rust decode has no spaces option)."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)  # lists and tuples alike
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens,
                                        clean_up_tokenization_spaces=False)
