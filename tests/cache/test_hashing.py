"""Chained prefix hashes with extra keys by position (image content hashes)."""

from __future__ import annotations

import numpy as np
import pytest

from forkpoint.cache.hashing import ROOT_HASH, HasherCache, PrefixHasher, hash_tokens


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


def _reference_chain(tokens, extra=b"", keys=()):
    """Block hashes by `hash_tokens`, block by block: the spec the fast paths must reproduce."""
    keys = sorted(keys)
    parent, chain = hash_tokens(ROOT_HASH, (), extra), []
    for start in range(0, len(tokens) - 15, 16):
        block_keys = b"".join((p - start).to_bytes(4, "little") + len(k).to_bytes(4, "little") + k
                              for p, k in keys if start <= p < start + 16)
        parent = hash_tokens(parent, tokens[start: start + 16], block_keys)
        chain.append(parent)
    return chain


def test_reused_chains_equal_fresh_ones_for_random_prompts():
    # a burst of prompts sharing anchors of random lengths, some with image keys and salts: every
    # hasher the cache builds (taking a recent prompt's leading blocks) equals the block-by-block
    # reference in every block hash and every prefix hash
    rng = np.random.default_rng(5)
    cache = HasherCache(16, capacity=3)
    anchors = [rng.integers(0, 50, int(n)).tolist() for n in (0, 5, 16, 40, 100, 160)]
    reused = 0
    for _ in range(150):
        anchor = anchors[rng.integers(len(anchors))]
        tokens = anchor + rng.integers(0, 50, int(rng.integers(1, 60))).tolist()
        if rng.random() < 0.2 and len(tokens) > 20:  # a single changed id inside the anchor
            tokens[int(rng.integers(len(tokens)))] = 51
        extra = b"salt" if rng.random() < 0.15 else b""
        keys = [(int(rng.integers(len(tokens))), bytes([int(rng.integers(2))]) * 3)
                for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.3 else 0)]
        earlier = [h.block_hashes[0] for h in cache._recent.values() if h.block_hashes]
        hasher = cache.build(tokens, extra, keys)
        reference = _reference_chain(tokens, extra, keys)
        assert hasher.block_hashes == reference
        fresh = PrefixHasher(tokens, 16, extra, keys)
        assert fresh.block_hashes == reference
        for length in range(1, len(tokens) + 1):
            assert hasher.prefix_hash(length) == fresh.prefix_hash(length)
        reused += bool(hasher.block_hashes) and any(h is hasher.block_hashes[0] for h in earlier)
    assert reused > 20  # the cache did take leading blocks from earlier prompts (the same objects)


def test_reuse_stops_at_the_first_differing_id_or_key():
    tokens = list(range(100))
    base = PrefixHasher(tokens, 16, extra_keys=[(70, b"img")])
    changed = tokens[:50] + [999] + tokens[51:]  # block 3 (ids 48..63) differs
    assert PrefixHasher(changed, 16, extra_keys=[(70, b"img")], reuse=base)._shared_blocks(base) == 3
    other_image = PrefixHasher(tokens, 16, extra_keys=[(70, b"dog")], reuse=base)
    assert other_image._shared_blocks(base) == 70 // 16  # block 4 holds the image: hashed anew
    assert other_image.block_hashes == _reference_chain(tokens, keys=[(70, b"dog")])
    salted = PrefixHasher(tokens, 16, b"salt", reuse=base)
    assert salted._shared_blocks(base) == 0 and salted.block_hashes == _reference_chain(tokens, b"salt")
    assert PrefixHasher(tokens, 8, reuse=base)._shared_blocks(base) == 0  # another block size
