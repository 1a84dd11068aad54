"""Paged KV cache accounting: which blocks are free, and how many holders each used block has.

Blocks are reference counted: a request holds one reference on each block of its table, and a
checkpoint holds one on each block covering its prefix. A block returns to the free list when its
count drops to zero. The blocks' tensors are the runner's (runner/storage.py); this class only
hands out their indices.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Blocks 0 .. num_blocks-1 are allocated and counted; block `scratch_block` (= num_blocks) is
    outside the accounting: the padding rows of captured decode steps and the start-up warm-up
    write and read only it (runner/decode_graphs.py, runner/warmup.py), so its content is
    meaningless (finite) and no request's table ever holds it. The storage holds num_blocks + 1
    blocks per attention layer."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block: raise kv_cache_bytes or num_kv_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @staticmethod
    def bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        """K and V of one block over `num_layers` layers; `dtype` is anything with `itemsize`
        (a torch.dtype)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` fresh blocks (reference count 1). Raises MemoryError when too few are free."""
        if count > len(self._free):
            raise MemoryError(f"need {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"incref of free KV block {block}")
            self._ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero are free again."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Free list == blocks with count 0, no duplicates; optionally counts equal `expected_refs`."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("KV free list holds duplicates")
        zero = {b for b, c in enumerate(self._ref_counts) if c == 0}
        if free != zero:
            raise AssertionError(f"KV free list disagrees with ref counts: {sorted(free ^ zero)[:8]}")
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError("negative KV block ref count")
        if expected_refs is not None:
            actual = {b: c for b, c in enumerate(self._ref_counts) if c}
            if actual != expected_refs:
                diff = {b: (actual.get(b, 0), expected_refs.get(b, 0)) for b in set(actual) | set(expected_refs)
                        if actual.get(b, 0) != expected_refs.get(b, 0)}
                raise AssertionError(f"KV block ref counts (actual, expected) differ: {dict(list(diff.items())[:8])}")
