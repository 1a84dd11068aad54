"""Chained hashes of token prefixes.

A prefix is identified by the chain of hashes of its full blocks (each block's hash covers the
previous block's hash, its tokens and any extra keys, e.g. a cache salt or image content hashes),
then by the hash of the trailing partial block. So a checkpoint key names one exact token prefix,
never a block-rounded one, and lookups for many prefix lengths of one prompt cost one pass.

Admission hashes every block of every prompt, so the chain is built cheaply: the ids are packed
once as int64 bytes, each block's blake2b state is copied from a keyed template (copying is several
times cheaper than constructing one), and `HasherCache` lets a prompt take the leading block hashes
of a recent prompt whose packed ids and extra keys over those blocks are byte-for-byte the same (the
1-to-N burst's shared anchor is hashed once, not N times). Every path gives the same digests as
`hash_tokens` applied block by block, the reference the tests compare with.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

ROOT_HASH = b"forkpoint-v1"
DIGEST_SIZE = 16  # 128 bits: distinct prefixes never share a key in practice
_NO_EXTRA = (0).to_bytes(4, "little")


def hash_tokens(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """16-byte digest of (parent hash, token ids, extra key bytes): blake2b over
    parent || int64 ids || len(extra) as 4 bytes || extra. The reference for every other path."""
    return _hash_token_bytes(parent, array("q", tokens).tobytes(), extra)


def _hash_token_bytes(parent: bytes, token_bytes, extra: bytes) -> bytes:
    """`hash_tokens` of ids already packed as int64 bytes (a bytes-like slice)."""
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    digest.update(parent)
    digest.update(token_bytes)
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    return digest.digest()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """The ids as native int64 bytes (8 per id), the form every hash covers. Raises OverflowError
    for an id outside int64 and TypeError for a non-integer."""
    return array("q", tokens).tobytes()


class PrefixHasher:
    """Hashes of every prefix length of one token sequence, with full-block hashes computed once.

    `block_hashes[i]` covers tokens[: (i + 1) * block_size]; `prefix_hash(n)` names tokens[:n].

    `extra_keys` are (position, key bytes) pairs, e.g. an image's content hash at the index of its
    first placeholder token: a key enters the hash of the block (or trailing partial block) that
    holds its position, so through the chain every prefix longer than the position covers it.
    Two prompts with the same tokens but different images therefore never share a prefix hash.

    `packed`: `pack_tokens(tokens)` when the caller has it already (not checked: it must be exactly
    that). `reuse`: an earlier hasher whose leading block hashes are taken where they provably
    equal this chain's (same block size and extra, the same packed ids and extra keys over those
    blocks); the rest is hashed. Neither changes any digest.
    """

    def __init__(self, tokens: Sequence[int], block_size: int, extra: bytes = b"",
                 extra_keys: Sequence[tuple[int, bytes]] = (), *, packed: bytes | None = None,
                 reuse: PrefixHasher | None = None) -> None:
        self._tokens = tokens
        self._block_size = block_size
        self._extra = extra
        self._keys = sorted(extra_keys)
        for position, _ in self._keys:
            if not 0 <= position < len(tokens):
                raise ValueError(f"extra key at position {position} outside the {len(tokens)} tokens")
        self.packed = pack_tokens(tokens) if packed is None else packed
        self._root = hash_tokens(ROOT_HASH, (), extra)
        shared = self._shared_blocks(reuse) if reuse is not None else 0
        self.block_hashes: list[bytes] = reuse.block_hashes[:shared] if shared else []
        self._hash_blocks(shared)

    @property
    def extra(self) -> bytes:
        """The bytes every hash of this chain includes (e.g. a cache salt): a hasher for a longer
        sequence of the same request must be built with them."""
        return self._extra

    def _hash_blocks(self, first: int) -> None:
        """Append the hashes of full blocks `first`, `first + 1`, ... (the chain from block `first - 1`)."""
        size = self._block_size
        width = 8 * size
        packed = self.packed
        template = hashlib.blake2b(digest_size=DIGEST_SIZE)
        parent = self.block_hashes[-1] if self.block_hashes else self._root
        append = self.block_hashes.append
        keyed = bool(self._keys)
        for start in range(first * size, len(self._tokens) - size + 1, size):
            digest = template.copy()
            digest.update(parent)
            digest.update(packed[8 * start: 8 * start + width])
            if keyed:
                keys = self._keys_in(start, start + size)
                digest.update(len(keys).to_bytes(4, "little"))
                digest.update(keys)
            else:
                digest.update(_NO_EXTRA)
            parent = digest.digest()
            append(parent)

    def _shared_blocks(self, other: PrefixHasher) -> int:
        """How many leading full blocks have the same hash in `other`'s chain, proven by comparing
        what those hashes cover: block size, extra, the packed ids and the extra keys."""
        if other._block_size != self._block_size or other._extra != self._extra:
            return 0
        blocks = min(len(self._tokens), len(other._tokens)) // self._block_size
        ids = blocks * self._block_size
        if not ids:
            return 0
        if self.packed[: 8 * ids] != other.packed[: 8 * ids]:
            mine = np.frombuffer(self.packed, np.int64, ids)
            theirs = np.frombuffer(other.packed, np.int64, ids)
            ids = int(np.argmax(mine != theirs))  # the first differing id (some id differs)
        if self._keys or other._keys:
            ids = _keys_agree_until(self._keys, other._keys, ids)
        return ids // self._block_size

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
        return _hash_token_bytes(parent, self.packed[8 * start: 8 * length],
                                 b"tail" + self._keys_in(start, length))


def _keys_agree_until(a: list[tuple[int, bytes]], b: list[tuple[int, bytes]], limit: int) -> int:
    """The largest n <= limit such that the sorted key lists `a` and `b` hold the same keys at
    every position below n."""
    for mine, theirs in zip(a, b):
        if mine != theirs:
            return min(limit, mine[0], theirs[0])
    rest = a[len(b):] or b[len(a):]
    return min(limit, rest[0][0]) if rest else limit


class HasherCache:
    """Builds `PrefixHasher`s for a stream of prompts, reusing a recent prompt's leading block
    hashes where they provably apply (see `PrefixHasher`'s `reuse`).

    Remembers the latest hasher per (extra, first block's packed ids), the `capacity` most recent
    first blocks at most, so a burst of prompts behind one shared anchor (or a few interleaved
    anchors) hashes each anchor once. The answer never depends on what is remembered: only the
    cost does.
    """

    def __init__(self, block_size: int, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError("a hasher cache needs a capacity of at least one prompt")
        self.block_size = block_size
        self.capacity = capacity
        self._recent: OrderedDict[tuple[bytes, bytes], PrefixHasher] = OrderedDict()

    def build(self, tokens: Sequence[int], extra: bytes = b"", extra_keys: Sequence[tuple[int, bytes]] = (),
              *, packed: bytes | None = None) -> PrefixHasher:
        """`PrefixHasher(tokens, block_size, extra, extra_keys, packed=packed)`, built faster."""
        packed = pack_tokens(tokens) if packed is None else packed
        if len(tokens) < self.block_size:
            return PrefixHasher(tokens, self.block_size, extra, extra_keys, packed=packed)
        key = (extra, packed[: 8 * self.block_size])
        hasher = PrefixHasher(tokens, self.block_size, extra, extra_keys, packed=packed,
                              reuse=self._recent.get(key))
        self._recent[key] = hasher
        self._recent.move_to_end(key)
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        return hasher
