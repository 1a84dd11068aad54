"""Chained hashes of token prefixes.

A prefix is identified by the chain of hashes of its full blocks (each block's hash covers the
previous block's hash, its tokens and any extra keys, e.g. a cache salt or image content hashes),
then by the hash of the trailing partial block. So a checkpoint key names one exact token prefix,
never a block-rounded one, and lookups for many prefix lengths of one prompt cost one pass.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"forkpoint-v1"


def hash_tokens(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """16-byte digest of (parent hash, token ids, extra key bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    return digest.digest()


class PrefixHasher:
    """Hashes of every prefix length of one token sequence, with full-block hashes computed once.

    `block_hashes[i]` covers tokens[: (i + 1) * block_size]; `prefix_hash(n)` names tokens[:n].
    """

    def __init__(self, tokens: Sequence[int], block_size: int, extra: bytes = b"") -> None:
        self._tokens = tokens
        self._block_size = block_size
        self._extra = extra
        self.block_hashes: list[bytes] = []
        parent = hash_tokens(ROOT_HASH, (), extra)
        self._root = parent
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_tokens(parent, tokens[start : start + block_size])
            self.block_hashes.append(parent)

    def prefix_hash(self, length: int) -> bytes:
        """Hash naming exactly tokens[:length] (0 < length <= len(tokens))."""
        if not 0 < length <= len(self._tokens):
            raise ValueError(f"prefix length {length} outside 1..{len(self._tokens)}")
        full = length // self._block_size
        parent = self.block_hashes[full - 1] if full else self._root
        tail = self._tokens[full * self._block_size : length]
        return hash_tokens(parent, tail, b"tail")
