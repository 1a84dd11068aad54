"""Block pool, state pool and checkpoint registry invariants (bookkeeping only; the tensors the
indices address: tests/runner/test_storage.py)."""

from __future__ import annotations

import pytest
import torch

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool


def test_state_pool_takes_any_mixer_declaration():
    spec = RecurrentStateSpec((20, 3), torch.bfloat16, (4, 8, 6), torch.float32)  # Mamba2: [H, P, N]
    pool = StatePool(3, 2)
    # rows: zero, 3 requests, 2 checkpoints, scratch (the tensors' shapes: tests/runner/test_storage.py)
    assert pool.num_rows == 7 and pool.scratch_slot == 6
    assert StatePool.bytes_per_slot(5, spec) == 5 * (20 * 3 * 2 + 4 * 8 * 6 * 4)
    pool.check_integrity()


def test_block_pool_refcounts_and_integrity():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    pool.incref(a[:2])
    pool.check_integrity({a[0]: 2, a[1]: 2, a[2]: 1})
    pool.release(a)
    assert pool.num_free == 4
    pool.release(a[:2])
    assert pool.num_free == 6
    pool.check_integrity({})
    # the scratch block sits after the counted ones and is never handed out
    assert pool.scratch_block == 6
    assert pool.scratch_block not in pool.allocate(6)
    pool.release(list(range(6)))
    with pytest.raises(MemoryError):
        pool.allocate(7)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([0])


def test_state_pool_slots():
    pool = StatePool(2, 1)
    first, second = pool.requests.allocate(), pool.requests.allocate()
    assert {first, second} == {1, 2}
    with pytest.raises(MemoryError):
        pool.requests.allocate()
    assert pool.checkpoints.allocate() == 3
    pool.check_integrity()


def test_registry_lru_eviction_skips_pinned_and_unready():
    blocks = BlockPool(8, 4)
    states = StatePool(1, 2)
    registry = CheckpointRegistry(states.checkpoints, blocks)
    owned = blocks.allocate(2)
    first = registry.register(b"a", 5, "p", 0.0)
    registry.mark_ready(first, owned)
    second = registry.register(b"b", 6, "p", 0.0)
    assert registry.register(b"c", 7, "p", 0.0) is not None  # evicts the idle ready "a"
    assert registry.get(b"a") is None and registry.num_evicted == 1
    registry.mark_ready(second, owned)
    registry.pin(second, 6)
    assert registry.register(b"d", 8, "p", 0.0) is None  # b pinned, c unready: nothing to evict
    registry.check_integrity(readers={b"b": 1}, waiters={}, producers={b"c": "p"}, reserved={})
    with pytest.raises(AssertionError, match="pins but 0 live readers"):
        registry.check_integrity(readers={}, waiters={}, producers={b"c": "p"}, reserved={})
    registry.unpin(second)
    blocks.release(owned)
    blocks.check_integrity({b: c for b, c in registry.block_refs().items()})


def test_prefix_hashes_are_exact_and_chain():
    tokens = list(range(40))
    hasher = PrefixHasher(tokens, 16)
    assert len({hasher.prefix_hash(n) for n in range(1, 41)}) == 40
    assert hasher.prefix_hash(20) == PrefixHasher(tokens[:20] + [99] * 5, 16).prefix_hash(20)
    assert hasher.prefix_hash(20) != PrefixHasher([1] + tokens[1:], 16).prefix_hash(20)
