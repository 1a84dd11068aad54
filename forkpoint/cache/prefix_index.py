"""Exact longest-common-prefix search over recently seen token sequences.

Sequences are indexed by their chained full-block hashes (cache/hashing.py `PrefixHasher`): a
bisection over a new sequence's block hashes finds the deepest full block it shares with an indexed
sequence; comparing tokens past that block gives the exact divergence position, so no position is
rounded to a block. Prefixes shorter than one block are not found (they are below any useful
checkpoint length anyway). Bounded: the least recently added sequence leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest

from forkpoint.cache.hashing import PrefixHasher


@dataclass(frozen=True)
class PrefixMatch:
    """`length` tokens shared with the sequence `owner` (its id when it was added)."""

    length: int
    owner: str


class PrefixIndex:
    """`add` indexes a sequence's full blocks; `longest_match` finds the longest exact common prefix.

    Per block hash, the owners whose chains hold it (oldest first), each with its id right after the
    block (None where its sequence ends there). A chained hash names its whole prefix, so the blocks
    a query shares with the index form a leading run of its chain and their count is found by
    bisection (about log2(blocks) lookups); the owners at the deepest shared block that continue with
    the query's next id are the only ones that can share more, so only they are compared token by
    token. Both steps rely on what every lookup here relies on: equal hashes mean equal prefixes.
    """

    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("the prefix index needs a capacity of at least one sequence")
        self.block_size = block_size
        self.capacity = capacity
        self._sequences: OrderedDict[str, tuple[Sequence[int], list[bytes]]] = OrderedDict()
        self._by_block: dict[bytes, dict[str, int | None]] = {}  # hash -> {owner: next id}, oldest first

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, owner: str, tokens: Sequence[int], hasher: PrefixHasher) -> None:
        """Index `tokens` (hashed by `hasher`) under `owner`, replacing an earlier entry of that id."""
        self.remove(owner)
        blocks = list(hasher.block_hashes)
        self._sequences[owner] = (tokens, blocks)
        following = tokens[self.block_size:: self.block_size]  # the id after each full block
        by_block = self._by_block
        for block, after in zip_longest(blocks, following[: len(blocks)]):
            owners = by_block.get(block)
            if owners is None:
                by_block[block] = {owner: after}
            else:
                owners[owner] = after
        while len(self._sequences) > self.capacity:
            self.remove(next(iter(self._sequences)))

    def remove(self, owner: str) -> None:
        entry = self._sequences.pop(owner, None)
        if entry is None:
            return
        for block in entry[1]:
            owners = self._by_block[block]
            del owners[owner]
            if not owners:
                del self._by_block[block]

    def longest_match(self, tokens: Sequence[int], hasher: PrefixHasher, *,
                      exclude: str | None = None) -> PrefixMatch | None:
        """The indexed sequence (other than `exclude`) sharing the longest exact prefix with
        `tokens`; ties go to the earliest added. None when no full block is shared."""
        hashes = hasher.block_hashes
        depth, unshared = 0, len(hashes) + 1  # blocks [0, depth) are shared; block unshared - 1 is not
        while unshared - depth > 1:
            middle = (depth + unshared) // 2
            if self._held_by_other(hashes[middle - 1], exclude):
                depth = middle
            else:
                unshared = middle
        if depth == 0:
            return None
        owners = self._by_block[hashes[depth - 1]]
        start = depth * self.block_size
        want = tokens[start] if start < len(tokens) else None
        if want is None or want not in owners.values():  # (a C scan) every owner shares exactly `start`
            return PrefixMatch(start, next(owner for owner in owners if owner != exclude))
        best: PrefixMatch | None = None
        for owner, after in owners.items():
            if owner == exclude:
                continue
            length = start
            if after == want:
                other = self._sequences[owner][0]
                length, limit = start + 1, min(len(tokens), len(other))
                while length < limit and tokens[length] == other[length]:
                    length += 1
            if best is None or length > best.length:
                best = PrefixMatch(length, owner)
        return best

    def _held_by_other(self, block: bytes, exclude: str | None) -> bool:
        owners = self._by_block.get(block)
        return owners is not None and (len(owners) > 1 or exclude not in owners)
