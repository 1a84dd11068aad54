"""Chained prefix hashes with extra keys by position (image content hashes)."""

from __future__ import annotations

import pytest

from forkpoint.cache.hashing import ROOT_HASH, PrefixHasher, hash_tokens


def test_prefix_hash_covers_image_keys_from_their_position_on():
    tokens = list(range(40))
    plain = PrefixHasher(tokens, 16)
    a = PrefixHasher(tokens, 16, extra_keys=[(20, b"cat")])
    b = PrefixHasher(tokens, 16, extra_keys=[(20, b"dog")])
    same = PrefixHasher(tokens, 16, extra_keys=[(20, b"cat")])
    for length in (1, 16, 20):  # prefixes that end before the image: the image is not part of them
        assert a.prefix_hash(length) == b.prefix_hash(length) == plain.prefix_hash(length)
    for length in (21, 32, 33, 40):  # the image starts inside: different images, different hashes
        assert a.prefix_hash(length) != b.prefix_hash(length)
        assert a.prefix_hash(length) == same.prefix_hash(length)
    with pytest.raises(ValueError, match="outside the 40 tokens"):
        PrefixHasher(tokens, 16, extra_keys=[(40, b"x")])


def test_block_hashes_chain_the_hash_of_each_block():
    # the hasher packs the ids once and hashes slices: the chain must equal hashing block by block
    tokens = [(i * 7919) % 50000 for i in range(16 * 9 + 5)]
    hasher = PrefixHasher(tokens, 16, extra=b"salt")
    parent = hash_tokens(ROOT_HASH, (), b"salt")
    for i, block_hash in enumerate(hasher.block_hashes):
        parent = hash_tokens(parent, tokens[16 * i: 16 * (i + 1)])
        assert block_hash == parent
    assert len(hasher.block_hashes) == 9
