"""Exact longest-common-prefix search over recently seen token sequences.

Sequences are indexed by their chained full-block hashes (cache/hashing.py `PrefixHasher`): walking
a new sequence's block hashes finds, in one pass, the deepest full block it shares with an indexed
sequence; comparing tokens past that block gives the exact divergence position, so no position is
rounded to a block. Prefixes shorter than one block are not found (they are below any useful
checkpoint length anyway). Bounded: the least recently added sequence leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from forkpoint.cache.hashing import PrefixHasher


@dataclass(frozen=True)
class PrefixMatch:
    """`length` tokens shared with the sequence `owner` (its id when it was added)."""

    length: int
    owner: str


class PrefixIndex:
    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("the prefix index needs a capacity of at least one sequence")
        self.block_size = block_size
        self.capacity = capacity
        self._sequences: OrderedDict[str, tuple[Sequence[int], list[bytes]]] = OrderedDict()
        self._by_block: dict[bytes, dict[str, None]] = {}  # block hash -> owners, oldest first

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, owner: str, tokens: Sequence[int], hasher: PrefixHasher) -> None:
        """Index `tokens` (hashed by `hasher`) under `owner`, replacing an earlier entry of that id."""
        self.remove(owner)
        self._sequences[owner] = (tokens, list(hasher.block_hashes))
        for block in hasher.block_hashes:
            self._by_block.setdefault(block, {})[owner] = None
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
        depth = 0
        while depth < len(hasher.block_hashes) and any(
                owner != exclude for owner in self._by_block.get(hasher.block_hashes[depth], ())):
            depth += 1
        if depth == 0:
            return None
        best: PrefixMatch | None = None
        start = depth * self.block_size
        for owner in self._by_block[hasher.block_hashes[depth - 1]]:
            if owner == exclude:
                continue
            other = self._sequences[owner][0]
            length, limit = start, min(len(tokens), len(other))
            while length < limit and tokens[length] == other[length]:
                length += 1
            if best is None or length > best.length:
                best = PrefixMatch(length, owner)
        return best
