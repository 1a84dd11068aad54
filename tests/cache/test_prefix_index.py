"""The prefix index against brute force: the longest exact common prefix with any indexed sequence."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.prefix_index import PrefixIndex


def _common(a, b) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def _brute_force(indexed: OrderedDict, tokens, block_size):
    """(length, owner) of the longest exact common prefix (ties: earliest added), None below one block."""
    best = None
    for owner, other in indexed.items():
        length = _common(tokens, other)
        if best is None or length > best[0]:
            best = (length, owner)
    return best if best is not None and best[0] >= block_size else None


@pytest.mark.parametrize("seed", [0, 1])
def test_longest_match_equals_brute_force_through_adds_removes_and_evictions(seed):
    # prompts behind a few shared anchors, diverging anywhere (inside a block, at its edge, at the end,
    # or not at all); ids from a small vocabulary so that owners often continue alike past a block
    rng = np.random.default_rng(seed)
    index, indexed = PrefixIndex(4, capacity=12), OrderedDict()
    anchors = [rng.integers(0, 3, int(n)).tolist() for n in (3, 4, 9, 16, 23)]
    owners = [f"r{i}" for i in range(20)]
    for _ in range(400):
        tokens = anchors[rng.integers(len(anchors))] + rng.integers(0, 3, int(rng.integers(0, 14))).tolist()
        hasher = PrefixHasher(tokens, 4)
        match = index.longest_match(tokens, hasher)
        expected = _brute_force(indexed, tokens, 4)
        assert (match.length, match.owner) == expected if match is not None else expected is None
        owner = owners[rng.integers(len(owners))]
        if rng.random() < 0.2:
            index.remove(owner)
            indexed.pop(owner, None)
        else:
            index.add(owner, tokens, hasher)
            indexed.pop(owner, None)
            indexed[owner] = tokens
            while len(indexed) > 12:
                indexed.popitem(last=False)
        assert len(index) == len(indexed)
        index.check_integrity()
    for owner in list(indexed):
        index.remove(owner)
    assert len(index) == 0 and not index._nodes  # removing every sequence leaves no node behind


def test_a_burst_behind_one_anchor_matches_the_first_at_the_anchor_end():
    rng = np.random.default_rng(3)
    anchor = rng.integers(0, 200, 400).tolist()
    index = PrefixIndex(16)
    for i in range(64):
        tokens = anchor + [1000 + i] + rng.integers(0, 200, 30).tolist()
        match = index.longest_match(tokens, PrefixHasher(tokens, 16))
        assert (match.length, match.owner) == (400, "p0") if i else match is None
        index.add(f"p{i}", tokens, PrefixHasher(tokens, 16))
    assert len(index._nodes) == 25 + 64  # the anchor's 25 blocks once, then each prompt's one more
    index.check_integrity()
