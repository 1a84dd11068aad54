"""Exact longest-common-prefix search over recently seen token sequences.

Sequences are indexed by their chained full-block hashes (cache/hashing.py `PrefixHasher`) in a tree
of blocks: one node per distinct block hash, its children the blocks that follow it in indexed
sequences. A bisection over a new sequence's block hashes finds the deepest full block it shares with
an indexed sequence; comparing tokens past that block gives the exact divergence position, so no
position is rounded to a block. Prefixes shorter than one block are not found (they are below any
useful checkpoint length anyway). Bounded: the least recently added sequence leaves first.

Adding a sequence creates nodes only for the blocks no indexed sequence holds yet, so N prompts
behind one long shared anchor cost O(anchor + N * suffix) blocks, not O(N * anchor):

    anchor blocks  a0 - a1 - ... - a255 -+- p0's suffix blocks (16)      owners sit at the node of
                                         +- p1's suffix blocks           their last full block
                                         +- ...
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


class _Node:
    """One block of indexed sequences. `first`: the block's first id; `children`: the next blocks,
    by their first id, then hash; `ends`: the owners whose last full block this is, each with its id
    right after the block (None where the sequence ends there); `oldest`: (add number, owner) of
    the earliest-added owner holding this block (at this node or below)."""

    __slots__ = ("key", "parent", "first", "children", "ends", "oldest")

    def __init__(self, key: bytes, parent: _Node | None, first: int, oldest: tuple[int, str]) -> None:
        self.key = key
        self.parent = parent
        self.first = first
        self.children: dict[int, dict[bytes, _Node]] = {}
        self.ends: dict[str, int | None] = {}
        self.oldest = oldest


class PrefixIndex:
    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("the prefix index needs a capacity of at least one sequence")
        self.block_size = block_size
        self.capacity = capacity
        self._sequences: OrderedDict[str, tuple[Sequence[int], list[bytes], int]] = OrderedDict()  # oldest first
        self._nodes: dict[bytes, _Node] = {}
        self._added = 0  # add number of the next sequence: orders owners by age

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, owner: str, tokens: Sequence[int], hasher: PrefixHasher) -> None:
        """Index `tokens` (hashed by `hasher`) under `owner`, replacing an earlier entry of that id."""
        self.remove(owner)
        number = self._added
        self._added += 1
        blocks = list(hasher.block_hashes)
        self._sequences[owner] = (tokens, blocks, number)
        if blocks:
            held = self._held_blocks(blocks)
            parent = self._nodes[blocks[held - 1]] if held else None
            size = self.block_size
            for index in range(held, len(blocks)):  # existing nodes keep `oldest`: this owner is the newest
                node = _Node(blocks[index], parent, tokens[index * size], (number, owner))
                self._nodes[node.key] = node
                if parent is not None:
                    parent.children.setdefault(node.first, {})[node.key] = node
                parent = node
            end = len(blocks) * size
            parent.ends[owner] = tokens[end] if end < len(tokens) else None
        while len(self._sequences) > self.capacity:
            self.remove(next(iter(self._sequences)))

    def remove(self, owner: str) -> None:
        entry = self._sequences.pop(owner, None)
        if entry is None or not entry[1]:
            return
        number = entry[2]
        node = self._nodes[entry[1][-1]]
        del node.ends[owner]
        while node is not None:  # up the path: drop emptied nodes, renew `oldest` where it was this owner
            parent = node.parent
            if not node.ends and not node.children:
                del self._nodes[node.key]
                if parent is not None:
                    siblings = parent.children[node.first]
                    del siblings[node.key]
                    if not siblings:
                        del parent.children[node.first]
            elif node.oldest[0] == number:
                node.oldest = self._oldest_below(node)
            else:
                return  # an older owner holds this block, so it holds every block above too
            node = parent

    def longest_match(self, tokens: Sequence[int], hasher: PrefixHasher) -> PrefixMatch | None:
        """The indexed sequence sharing the longest exact prefix with `tokens`; ties go to the
        earliest added. None when no full block is shared."""
        hashes = hasher.block_hashes
        depth = self._held_blocks(hashes)
        if depth == 0:
            return None
        node = self._nodes[hashes[depth - 1]]
        start = depth * self.block_size
        best = (start, node.oldest)  # every owner at or below the node shares `start` tokens
        if start == len(tokens):
            return PrefixMatch(start, node.oldest[1])
        want = tokens[start]
        # only owners continuing with the query's next id share more: ending at this node, or in the
        # subtree of a next block that starts with it (all owners there share that block's ids)
        continuing = [(self._sequences[owner][0], (self._sequences[owner][2], owner))
                      for owner, after in node.ends.items() if after == want] if want in node.ends.values() else []
        continuing += [(self._sequences[child.oldest[1]][0], child.oldest)
                       for child in node.children.get(want, {}).values()]
        for other, age in continuing:
            length, limit = start + 1, min(len(tokens), len(other))
            while length < limit and tokens[length] == other[length]:
                length += 1
            if length > best[0] or (length == best[0] and age < best[1]):
                best = (length, age)
        return PrefixMatch(best[0], best[1][1])

    def _held_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain the index holds. A chained hash names its whole
        prefix, so the held blocks form a leading run: found by bisection (about log2 lookups)."""
        held, missing = 0, len(hashes) + 1  # blocks [0, held) are held; block missing - 1 is not
        while missing - held > 1:
            middle = (held + missing) // 2
            if hashes[middle - 1] in self._nodes:
                held = middle
            else:
                missing = middle
        return held

    def _oldest_below(self, node: _Node) -> tuple[int, str]:
        ages = [(self._sequences[owner][2], owner) for owner in node.ends]
        ages += [child.oldest for siblings in node.children.values() for child in siblings.values()]
        return min(ages)

    def check_integrity(self) -> None:
        """Every node is held by some indexed sequence, every sequence's blocks are nodes chained
        parent to child, and each node's `oldest` is the earliest owner at or below it."""
        oldest: dict[bytes, tuple[int, str]] = {}
        for owner, (tokens, blocks, number) in self._sequences.items():
            for index, block in enumerate(blocks):
                node = self._nodes[block]
                assert node.parent is (self._nodes[blocks[index - 1]] if index else None)
                assert node.first == tokens[index * self.block_size]
                oldest[block] = min(oldest.get(block, (number, owner)), (number, owner))
            if blocks:
                assert owner in self._nodes[blocks[-1]].ends
        assert oldest.keys() == self._nodes.keys()
        for key, node in self._nodes.items():
            assert node.oldest == oldest[key], f"node {key.hex()} names {node.oldest}, not {oldest[key]}"
            assert all(child.parent is node and child.first == first
                       for first, siblings in node.children.items() for child in siblings.values())
