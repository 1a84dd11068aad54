"""Tokenising chat prompts turn by turn, with a bounded cache of the turns already seen.

A chat server re-renders and re-tokenises a session's whole history every turn (3.7k tokens at turn 5
of issue 26's agent workload, three times per request: the prompt, its history and the next-turn probe
of `inputs/turns.py`). Almost all of that text was tokenised before. `SegmentEncoder` cuts a rendered
prompt right before each turn opener (`<|im_start|>`), tokenises each piece once and keeps its ids in a
bounded LRU cache, so a request pays only for the text it adds.

Why the pieces' ids, concatenated, are exactly the ids of the whole text (byte-identical, not close):
a fast tokenizer first splits the raw text at its added tokens (Aho-Corasick, leftmost-longest), then
normalises, pre-tokenises and runs the model on each remaining piece on its own. A cut at position k
where the opener starts is therefore invisible when

- the opener is an added token matched in raw text (``normalized`` false) that never swallows its
  neighbours (``lstrip``, ``rstrip``, ``single_word`` false) - then the whole text splits at k too,
- no added token occurrence spans k (checked at every cut: a token that starts before k and ends after
  it would be matched there instead; such a cut is skipped),
- no added token depends on its neighbours (``single_word``, ``lstrip``, ``rstrip`` all false), and
  every later stage works on each piece alone: a pre-tokenizer of `PIECEWISE_PRE_TOKENIZERS` (not
  Metaspace, whose "first" scheme sees where a piece lies) and a deterministic model (no BPE dropout).

`supported_openers` checks these on the tokenizer's added tokens, pre-tokenizer and model once; a
tokenizer that fails them gets no cuts and every text is tokenised whole (then the encoder is plain
`tokenizer.encode`). Tests compare the two on random conversations.

The cache is per encoder (one per server), keyed by (namespace, piece text): requests of different
`cache_salt`s share no entry, so one tenant cannot time another's text. It holds at most `max_bytes`
(piece text plus 4-byte ids); a piece over `max_bytes // MAX_PIECE_FRACTION` is tokenised and not kept.
Thread-safe: the server's tokenizer threads share it (a lock around each lookup and insert, never
around tokenisation).
"""

from __future__ import annotations

import json
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

TURN_OPENERS = ("<|im_start|>", "<|start_of_role|>")  # ChatML (Qwen, Nemotron-H, Falcon-H1), Granite
PIECEWISE_PRE_TOKENIZERS = frozenset({"Split", "ByteLevel", "Digits", "Punctuation", "Whitespace",
                                      "WhitespaceSplit", "BertPreTokenizer", "UnicodeScripts"})
DETERMINISTIC_MODELS = frozenset({"BPE", "WordLevel", "WordPiece", "Unigram"})
MAX_CUTS = 1024  # turn openers in one text beyond which it is tokenised whole
MAX_PIECE_FRACTION = 8  # a piece over max_bytes / 8 is not cached: one huge prompt cannot flush the cache
DEFAULT_CACHE_BYTES = 64 << 20


def supported_openers(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The turn openers of `TURN_OPENERS` that `tokenizer` lets `SegmentEncoder` cut before (see the
    module docstring), or () when its pipeline is not provably piecewise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: no description to check
        return ()
    added = list(tokenizer.added_tokens_decoder.values())
    if any(token.lstrip or token.rstrip or token.single_word for token in added):
        return ()
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is not None and not _piecewise(json.loads(pre_tokenizer.__getstate__())):
        return ()
    model = backend.model
    if type(model).__name__ not in DETERMINISTIC_MODELS or getattr(model, "dropout", None) not in (None, 0, 0.0):
        return ()
    raw = {token.content for token in added if not token.normalized}
    return tuple(opener for opener in TURN_OPENERS if opener in raw)


def _piecewise(pre_tokenizer: dict[str, Any]) -> bool:
    if pre_tokenizer.get("type") == "Sequence":
        return all(_piecewise(part) for part in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") in PIECEWISE_PRE_TOKENIZERS


class SegmentEncoder:
    """`encode(text, namespace)` == ``list(tokenizer.encode(text, add_special_tokens=False))``, built from
    cached pieces (see the module docstring). max_bytes: the cache's bound (0: no cache; the text is
    still tokenised piece by piece, each piece once per call)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.openers = supported_openers(tokenizer)
        self._added = _may_span(tuple(sorted(tokenizer.get_added_vocab())), self.openers) if self.openers else ()
        self._longest = max((len(token) for token in self._added), default=0)
        self._lock = threading.Lock()
        self._pieces: OrderedDict[tuple[str, str], array] = OrderedDict()  # (namespace, text) -> ids, LRU first
        self._bytes = 0
        self.hits = 0  # pieces found in the cache (for tests and the benchmark)
        self.misses = 0  # pieces tokenised

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def encode(self, text: str, namespace: str = "") -> list[int]:
        """The token ids of `text` (no special tokens added). namespace: the request's cache namespace
        (its cache_salt; "" without one): pieces are shared only within one namespace."""
        ids: list[int] = []
        for piece in self.pieces(text):
            ids += self._piece_ids(piece, namespace)
        return ids

    def pieces(self, text: str) -> list[str]:
        """`text` cut right before each turn opener where a cut is exact; "".join(pieces) == text. A text
        with more than MAX_CUTS openers (a client's, not a conversation's) is one piece: each piece costs a
        tokenizer call, and a megabyte of openers must not cost a million."""
        found: set[int] = set()
        for opener in self.openers:
            start = text.find(opener)
            while start >= 0:
                found.add(start)
                if len(found) > MAX_CUTS:
                    return [text]
                start = text.find(opener, start + 1)
        cuts = sorted(k for k in found if self._exact_cut(text, k))
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def _exact_cut(self, text: str, k: int) -> bool:
        """Whether no added token occurrence spans position k (starts before it and ends after it): k is where
        an opener starts, so only the tokens of `_may_span` can."""
        if k == 0:
            return False
        if not self._added:
            return True
        window = text[max(0, k - self._longest + 1): k + self._longest - 1]
        offset = max(0, k - self._longest + 1)
        for token in self._added:
            if len(token) < 2 or token not in window:
                continue
            for start in _occurrences(window, token):
                if offset + start < k < offset + start + len(token):
                    return False
        return True

    def check_integrity(self) -> None:
        """The byte count is the entries' sizes summed and within max_bytes (AssertionError if not)."""
        with self._lock:
            total = sum(_size(key, ids) for key, ids in self._pieces.items())
            assert total == self._bytes, f"cache counts {self._bytes} bytes, its entries hold {total}"
            assert self._bytes <= self.max_bytes, f"cache holds {self._bytes} bytes, over its bound {self.max_bytes}"

    def _piece_ids(self, piece: str, namespace: str) -> list[int]:
        key = (namespace, piece)
        with self._lock:
            found = self._pieces.get(key)
            if found is not None:
                self._pieces.move_to_end(key)
                self.hits += 1
                return found.tolist()
            self.misses += 1
        ids = list(self.tokenizer.encode(piece, add_special_tokens=False))
        self._keep(key, ids)
        return ids

    def _keep(self, key: tuple[str, str], ids: Sequence[int]) -> None:
        try:
            packed = array("i", ids)
        except OverflowError:  # an id beyond int32 (no real vocabulary): not cached
            return
        size = _size(key, packed)
        if size > self.max_bytes // MAX_PIECE_FRACTION:
            return
        with self._lock:
            if key in self._pieces:  # another thread tokenised it meanwhile: the same ids
                return
            self._pieces[key] = packed
            self._bytes += size
            while self._bytes > self.max_bytes:
                old_key, old = self._pieces.popitem(last=False)
                self._bytes -= _size(old_key, old)


def _may_span(added: Sequence[str], openers: Sequence[str]) -> tuple[str, ...]:
    """The added tokens that can span a cut made right before an opener: a token t occurring at s spans
    k (s < k < s + len(t)) only if its tail t[k - s:] and the opener at k agree on their common length
    (both read the text from k on). Others never do, so `_exact_cut` checks only these (for Qwen3.5's
    `<|im_start|>`: none, as no added token has a `<` past its first character)."""
    return tuple(token for token in added if any(
        token[j:].startswith(opener) or opener.startswith(token[j:]) for j in range(1, len(token))
        for opener in openers))


def _size(key: tuple[str, str], ids: array) -> int:
    """An entry's bytes: its key's strings and its packed ids."""
    return sys.getsizeof(key[0]) + sys.getsizeof(key[1]) + ids.itemsize * len(ids)


def _occurrences(text: str, token: str) -> list[int]:
    found = []
    start = text.find(token)
    while start >= 0:
        found.append(start)
        start = text.find(token, start + 1)
    return found
