"""Chained hashes of token prefixes.

A prefix is identified by the chain of hashes of its full blocks (each block's hash covers the
previous block's hash, its tokens and any extra keys, e.g. a cache salt or image content hashes),
then by the hash of the trailing partial block. So a checkpoint key names one exact token prefix,
never a block-rounded one, and lookups for many prefix lengths of one prompt cost one pass.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"forkpoint-v1"


def hash_tokens(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """16-byte digest of (parent hash, token ids, extra key bytes)."""
    return _hash_token_bytes(parent, array("q", tokens).tobytes(), extra)


def _hash_token_bytes(parent: bytes, token_bytes, extra: bytes) -> bytes:
    """`hash_tokens` of ids already packed as int64 bytes (a bytes-like slice)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent)
    digest.update(token_bytes)
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    return digest.digest()


class PrefixHasher:
    """Hashes of every prefix length of one token sequence, with full-block hashes computed once.

    `block_hashes[i]` covers tokens[: (i + 1) * block_size]; `prefix_hash(n)` names tokens[:n].

    `extra_keys` are (position, key bytes) pairs, e.g. an image's content hash at the index of its
    first placeholder token: a key enters the hash of the block (or trailing partial block) that
    holds its position, so through the chain every prefix longer than the position covers it.
    Two prompts with the same tokens but different images therefore never share a prefix hash.
    """

    def __init__(self, tokens: Sequence[int], block_size: int, extra: bytes = b"",
                 extra_keys: Sequence[tuple[int, bytes]] = ()) -> None:
        self._tokens = tokens
        self._block_size = block_size
        self._extra = extra
        self._keys = sorted(extra_keys)
        for position, _ in self._keys:
            if not 0 <= position < len(tokens):
                raise ValueError(f"extra key at position {position} outside the {len(tokens)} tokens")
        self.block_hashes: list[bytes] = []
        parent = hash_tokens(ROOT_HASH, (), extra)
        self._root = parent
        packed = memoryview(array("q", tokens).tobytes())  # once: each block hashes a slice of it
        width = 8 * block_size
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = _hash_token_bytes(parent, packed[8 * start: 8 * start + width],
                                       self._keys_in(start, start + block_size))
            self.block_hashes.append(parent)

    def _keys_in(self, start: int, end: int) -> bytes:
        """Extra keys with start <= position < end, as bytes (b"" when there are none)."""
        if not self._keys:
            return b""
        lo = bisect.bisect_left(self._keys, (start, b""))
        hi = bisect.bisect_left(self._keys, (end, b""))
        return b"".join((position - start).to_bytes(4, "little") + len(key).to_bytes(4, "little") + key
                        for position, key in self._keys[lo:hi])

    def prefix_hash(self, length: int) -> bytes:
        """Hash naming exactly tokens[:length] (0 < length <= len(tokens)) and the extra keys before length."""
        if not 0 < length <= len(self._tokens):
            raise ValueError(f"prefix length {length} outside 1..{len(self._tokens)}")
        full = length // self._block_size
        parent = self.block_hashes[full - 1] if full else self._root
        start = full * self._block_size
        tail = self._tokens[start:length]
        return hash_tokens(parent, tail, b"tail" + self._keys_in(start, length))
